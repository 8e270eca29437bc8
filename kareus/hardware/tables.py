"""The real A100 attention tables (shared/data/a100_attention_tp2): their workload and replay conversion.

The tables measure the attention half of one layer (hidden 2048, 32 heads, head dim 64, sequence 4096,
nanobatch 2, TP=2, fp16) beside a 32 MiB all-reduce, for windows (start, end): the comm launches
before forward op ``start`` and is joined after op ``end``; (-1, -1) runs it in sequence.
"""
from __future__ import annotations

import csv
import io
import math
import statistics
from pathlib import Path
from typing import Mapping

from kareus.hardware.replay import TableError, read_text
from kareus.types import Collective, Direction, Link, Op, OpKind, PartitionType, Slot, SEQUENTIAL

PARTITION_KEY = "fwd_attn_tp2"
DEFAULT_SRC = Path("../shared/data/a100_attention_tp2")
FILES = {1410: "clock_default.csv", 1200: "clock_1200mhz.csv"}  # the default clock boosts to 1410 MHz
BLOCK_SIZE = 1024  # threads per comm block; only these rows are converted (512 is a different kernel)

# Published naming of the launch slots by op kind and index; memory-bound neighbours form one slot.
SLOTS = (
    Slot("norm_0", (0, 1), "memory"),  # bias-dropout-add, layernorm
    Slot("linear_0", (2,), "gemm"),  # linear_qkv
    Slot("rope_0", (3, 4), "memory"),  # qkv post-process, rotary embedding
    Slot("attn_0", (5,), "attention"),  # causal flash attention
    Slot("linear_1", (6,), "gemm"),  # linear_proj
)
_END_OF = {s.ops[-1]: s.label for s in SLOTS}
_START_OF = {s.ops[0]: s.label for s in SLOTS}
LAST_OP = 6


def attention_ops(hidden: int = 2048, heads: int = 32, head_dim: int = 64, seq: int = 4096,
                  nanobatch: int = 2, tp: int = 2, elem: int = 2) -> tuple[tuple[Op, ...], Op]:
    """The table's compute chain (7 ops, per GPU) and its comm op, from the layer shape."""
    tok = seq * nanobatch
    h_tp = heads // tp * head_dim  # 1024
    act = tok * hidden * elem
    qkv = 3 * h_tp
    ops = (
        # bias-dropout-add: read x and residual, write output and the dropout mask (training)
        Op("bias_dropout_add", OpKind.ELEMENTWISE, flops=3.0 * tok * hidden, bytes=3.0 * act + tok * hidden),
        Op("layernorm", OpKind.NORM, flops=8.0 * tok * hidden, bytes=2.0 * act),
        Op("linear_qkv", OpKind.GEMM, flops=2.0 * tok * hidden * qkv,
           bytes=elem * (tok * hidden + hidden * qkv + tok * qkv)),
        # split + transposes into q, k, v: read and write the qkv tensor
        Op("qkv_postprocess", OpKind.ELEMENTWISE, flops=0.0, bytes=2.0 * tok * qkv * elem),
        # unfused rotary embedding on q and k: several elementwise kernels, ~4 passes over q and k
        Op("rotary_embedding", OpKind.ROPE, flops=6.0 * tok * 2 * h_tp, bytes=4.0 * 2 * tok * h_tp * elem),
        Op("attention", OpKind.ATTENTION, flops=4.0 * nanobatch * (heads // tp) * seq * seq * head_dim * 0.5,
           bytes=4.0 * tok * h_tp * elem),
        Op("linear_proj", OpKind.GEMM, flops=2.0 * tok * h_tp * hidden,
           bytes=elem * (tok * h_tp + h_tp * hidden + tok * hidden)),
    )
    comm = Op("all_reduce", OpKind.COMM, bytes=act, collective=Collective.ALL_REDUCE, message_bytes=act,
              group_size=tp, link=Link.NVLINK)
    return ops, comm


def partition_key(end: int) -> str:
    """Partition key for windows joined after op ``end`` (Kareus' own partitions join at the end)."""
    if end in (-1, LAST_OP):
        return PARTITION_KEY
    return f"{PARTITION_KEY}.join_{_END_OF[end]}"


def window_slot(start: int) -> str:
    return SEQUENTIAL if start < 0 else _START_OF[start]


def window_partition(end: int) -> PartitionType:
    """The PartitionType that expresses the table's windows joined after op ``end`` (-1/6: at the end)."""
    ops, comm = attention_ops()
    join = None if end in (-1, LAST_OP) else end
    slots = tuple(s for s in SLOTS if join is None or s.ops[0] <= join)
    return PartitionType(partition_key(end), Direction.FWD, ops, comm, slots, join)


def _measured(row: dict, column: str, path: str | Path, line: int) -> float:
    """One time or energy reading: a finite, positive number, else a TableError naming its column."""
    try:
        v = float(row[column])
    except (TypeError, ValueError):
        raise TableError(f"{path}: line {line}: column {column!r}: {row[column]!r} is not a number") from None
    if not (math.isfinite(v) and v > 0):
        raise TableError(f"{path}: line {line}: column {column!r}: must be finite and positive, got {v}")
    return v


def _check_window(path: str | Path, line: int, start: int, end: int) -> None:
    """A window launches before a slot's first op and joins after a slot's last op (or is -1, -1)."""
    if (start, end) == (-1, -1):
        return
    if start not in _START_OF or end not in _END_OF or start > end:
        raise TableError(f"{path}: line {line}: overlap {start}..{end} is not a window of slots; overlap_start "
                         f"must be one of {sorted(_START_OF)}, overlap_end one of {sorted(_END_OF)} and not before "
                         f"it, or both -1 (sequential)")


def read_windows(path: str | Path, block_size: int = BLOCK_SIZE) -> list[dict]:
    """Rows of one real table: window, SMs, and per-GPU time/energy per repeat (total energy / 2)."""
    out = []
    seen: dict[tuple[int, int, int], int] = {}  # window -> its line: a repeated one would be written twice
    with io.StringIO(read_text(path), newline="") as fh:
        for line, row in enumerate(csv.DictReader(fh), start=2):
            try:
                if int(row["comm_block_size"]) != block_size:
                    continue
                reps = sorted({k.split(":")[0] for k in row if k and ":" in k}, key=int)
                if not reps:
                    raise KeyError("0:time (s)")
                times = [_measured(row, f"{r}:time (s)", path, line) for r in reps]
                energies = [_measured(row, f"{r}:total energy (J)", path, line) / 2.0 for r in reps]  # 2 GPUs, symmetric ranks
                window = (int(row["overlap_start"]), int(row["overlap_end"]), int(row["comm_sm_number"]))
                _check_window(path, line, window[0], window[1])
                if window in seen:
                    raise TableError(f"{path}: line {line} repeats the window of line {seen[window]} (overlap "
                                     f"{window[0]}..{window[1]}, {window[2]} SMs); keep one row per window")
                seen[window] = line
                out.append({
                    "start": window[0], "end": window[1], "sms": window[2], "times": times, "energies": energies,
                    "time_s": statistics.median(times), "energy_j": statistics.median(energies),
                })
            except TableError:
                raise
            except KeyError as e:
                raise TableError(f"{path}: no column {e.args[0]!r}; expected overlap_start, overlap_end, "
                                 f"comm_sm_number, comm_block_size and k:time (s), k:total energy (J) per repeat k") from None
            except (TypeError, ValueError):
                raise TableError(f"{path}: line {line}: a value that is not a number") from None
    return out


def repeat_spread(tables: Mapping[int, list[dict]]) -> dict[str, dict[str, float]]:
    """How far one setting's repeats spread in the real tables (``read_windows`` rows by clock), per clock
    and pooled (``all``): medians over rows of (max - min) / median and of the coefficient of variation
    (sample standard deviation / mean), in time and energy. The simulator's reading noise is judged
    against these, so the docs quote them from here rather than typing them."""
    groups = {str(mhz): rows for mhz, rows in tables.items()}
    groups["all"] = [r for rows in tables.values() for r in rows]
    return {name: _spread(rows) for name, rows in groups.items()}


def _spread(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {"rows": len(rows)}
    for what, key in (("time", "times"), ("energy", "energies")):
        reps = [r[key] for r in rows if len(r[key]) > 1]  # a single reading has no spread
        ranges = [(max(v) - min(v)) / statistics.median(v) for v in reps]
        cvs = [statistics.stdev(v) / statistics.mean(v) for v in reps]
        out[f"{what}_range"] = statistics.median(ranges) if ranges else math.nan
        out[f"{what}_cv"] = statistics.median(cvs) if cvs else math.nan
    return out


def convert_a100_attention(src_dir: str | Path = DEFAULT_SRC, out_csv: str | Path = "runs/replay/a100_attention_tp2.csv") -> Path:
    """Write the real tables in replay format (per-GPU energy = total / 2; block size 1024 rows only).

    Each window becomes (partition, slot): the slot is the launch position by the published naming,
    and windows joined before the chain's end get their own partition key (``...join_<slot>``).
    Sequential rows are repeated under each partition key so every partition has its baseline.
    """
    src = Path(src_dir)
    out = Path(out_csv)
    tables = {mhz: read_windows(src / name) for mhz, name in FILES.items()}  # every file read before writing
    lines = []
    for mhz, rows in tables.items():
        ends = sorted({r["end"] for r in rows if r["end"] >= 0})
        for r in rows:
            targets = [partition_key(e) for e in ends] if r["start"] < 0 else [partition_key(r["end"])]
            for key in dict.fromkeys(targets):
                for i, (t, e) in enumerate(zip(r["times"], r["energies"])):
                    lines.append((key, r["start"], r["sms"], -mhz, i, window_slot(r["start"]), t, e))
    part = out.with_name(out.name + ".part")  # renamed when whole: a reader never sees half a table
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["partition", "slot", "sms", "freq_mhz", "time_s", "energy_j", "repeat"])
            for key, _, sms, neg_mhz, i, slot, t, e in sorted(lines):  # slots in chain order
                w.writerow([key, slot, sms, -neg_mhz, f"{t:.9g}", f"{e:.9g}", i])
        part.replace(out)
    except BaseException as e:
        if part.is_file():
            part.unlink()  # nothing half-written stays behind
        if isinstance(e, OSError):
            raise OutputError(f"{e.filename or out}: {e.strerror or e}") from None
        raise
    return out


class OutputError(TableError):
    """The converted table could not be written where asked."""


def main(argv: list[str] | None = None) -> int:
    """``python -m kareus.hardware.tables [SRC_DIR] [OUT_CSV]``: convert the real A100 table for replay."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kareus.hardware.tables", description=main.__doc__)
    ap.add_argument("src", nargs="?", default=str(DEFAULT_SRC), help="folder of the recorded A100 CSVs")
    ap.add_argument("out", nargs="?", default="runs/replay/a100_attention_tp2.csv", help="replay table to write")
    args = ap.parse_args(argv)
    if not Path(args.src).is_dir():
        ap.error(f"src: {args.src} is not a folder with {', '.join(FILES.values())}")
    try:
        print(convert_a100_attention(args.src, args.out))
    except TableError as e:
        ap.error(f"{'out' if isinstance(e, OutputError) else 'src'}: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
