"""The replay backend: answers from a recorded measurement table (CSV), for offline search and tests.

Columns ``partition,slot,sms,freq_mhz,time_s,energy_j`` and an optional ``repeat``; rows of one
configuration are repeats, returned in turn. Energy and time are per GPU for one execution.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kareus.errors import not_text
from kareus.hardware.base import GPUSpec, LockedClock
from kareus.hardware.spec import GPUConfig
from kareus.registry import HARDWARE
from kareus.types import SEQUENTIAL, Candidate, Direction, Op, OpKind, PartitionType, Reading, Slot

REQUIRED = ("partition", "slot", "sms", "freq_mhz", "time_s", "energy_j")


class TableError(ValueError):
    """A malformed replay table; the message is one line naming the file and line."""


@dataclass
class ReplayConfig(GPUConfig):
    """Schema of ``hardware=replay``: the GPU's datasheet plus the recorded table."""

    name: str = "replay"
    table: str = ""  # path of the CSV (hardware.table=PATH)

    def problems(self, ctx: object = None) -> list[str]:
        """Config-time checks (run by validate()): the table is named, exists and parses."""
        if not self.table:
            return ["hardware.table: not set; pass hardware.table=PATH (a CSV with columns "
                    "partition,slot,sms,freq_mhz,time_s,energy_j[,repeat])"]
        try:
            load_table(self.table)
        except TableError as exc:
            return [f"hardware.table: {exc}"]
        return []

    def recorded_space(self) -> bool:
        return True


Key = tuple[str, str, int, int]
_PATH_CHARS = ("/", "\\", "\0")  # a partition key becomes part of file names (Kareus' own hold ':')


def read_text(path: str | Path) -> str:
    """A table file's text; one TableError line naming the file if it cannot be read or is not UTF-8
    (a byte-order mark, as spreadsheets write, is dropped)."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise TableError(f"{path}: {not_text(e)}") from None
    except OSError as e:
        raise TableError(f"{path}: cannot read ({e.strerror})") from None


def load_table(path: str | Path) -> dict[Key, list[tuple[float, float]]]:
    """Parse and check a replay table: {(partition, slot, sms, freq_mhz): [(time_s, energy_j), ...]}."""
    p = Path(path)
    if not str(path):
        raise TableError("replay table not set; pass hardware.table=PATH")
    if not p.is_file():
        raise TableError(f"replay table {p} does not exist")
    rows: dict[Key, dict[int, tuple[float, float]]] = {}
    order: dict[Key, list[tuple[float, float]]] = {}
    with io.StringIO(read_text(p), newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TableError(f"{p}:1: empty table")
        header = [h.strip() for h in header]
        missing = [c for c in REQUIRED if c not in header]
        if missing:
            raise TableError(f"{p}:1: missing column(s) {', '.join(missing)}")
        idx = {c: header.index(c) for c in header}
        has_repeat = "repeat" in idx
        for line, rec in enumerate(reader, start=2):
            if not rec or all(not x.strip() for x in rec):
                continue
            if len(rec) < len(header):
                raise TableError(f"{p}:{line}: expected {len(header)} fields, got {len(rec)}")
            get = lambda c: rec[idx[c]].strip()  # noqa: E731
            try:
                sms, mhz = int(get("sms")), int(get("freq_mhz"))
                t, e = float(get("time_s")), float(get("energy_j"))
                rep = int(get("repeat")) if has_repeat and get("repeat") else None
            except ValueError as exc:
                raise TableError(f"{p}:{line}: non-numeric value ({exc})") from None
            if not (math.isfinite(t) and math.isfinite(e)):
                raise TableError(f"{p}:{line}: time and energy must be finite")
            if t <= 0 or e <= 0:  # the profiler refuses such a reading: the setting would only ever fail
                raise TableError(f"{p}:{line}: negative or zero time/energy (time_s={t}, energy_j={e})")
            if sms <= 0 or mhz <= 0:
                raise TableError(f"{p}:{line}: sms and freq_mhz must be positive")
            key = (get("partition"), get("slot") or SEQUENTIAL, sms, mhz)
            if not key[0]:
                raise TableError(f"{p}:{line}: empty partition")
            if any(c in key[0] for c in _PATH_CHARS) or key[0] in (".", ".."):
                raise TableError(f"{p}:{line}: partition {key[0]!r}: a key names the run's files "
                                 f"(frontiers/partition_<key>.csv), so it may not hold '/', '\\' or be '.' or '..'")
            if rep is None:
                order.setdefault(key, []).append((t, e))
                continue
            reps = rows.setdefault(key, {})
            if rep in reps:
                raise TableError(f"{p}:{line}: duplicate {key} with repeat {rep} already given")
            reps[rep] = (t, e)
    for key, reps in rows.items():
        if key in order:
            raise TableError(f"{p}: {key} mixes rows with and without a repeat number")
        order[key] = [reps[r] for r in sorted(reps)]
    if not order:
        raise TableError(f"{p}: no rows")
    return order


_KIND_OF = {"linear": ("gemm", OpKind.GEMM), "attn": ("attention", OpKind.ATTENTION),
            "norm": ("memory", OpKind.NORM), "rope": ("memory", OpKind.ROPE)}


class ReplayBackend(LockedClock):
    """Replays a recorded table; its search space per partition is exactly the table's configurations."""

    def __init__(self, cfg: ReplayConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.gpu: GPUSpec = cfg.gpu_spec()
        self.name = f"replay:{Path(cfg.table).name}"
        self.table = load_table(cfg.table)
        self._next: dict[Key, int] = {}
        self._clock = self.gpu.max_mhz
        self._now = 0.0
        self._idle_c = 40.0

    @property
    def static_power_w(self) -> float:
        return self.gpu.static_power_w



    def temperature(self) -> float:
        return self._idle_c

    def idle_temperature(self) -> float:
        return self._idle_c

    def now(self) -> float:
        return self._now

    def idle(self, seconds: float) -> None:
        self._now += max(0.0, seconds)

    def _rows(self, partition: PartitionType, candidate: Candidate) -> list[tuple[float, float]] | None:
        self.check_clock(candidate)
        return self.table.get((partition.key, candidate.slot, candidate.sms, candidate.freq_mhz))

    def run_once(self, partition: PartitionType, candidate: Candidate) -> float:
        rows = self._rows(partition, candidate)
        if not rows:
            raise KeyError(f"{candidate.key} is not in the replay table")
        t = sorted(r[0] for r in rows)[len(rows) // 2]
        self._now += t
        return t

    def measure(self, partition: PartitionType, candidate: Candidate, window_s: float) -> Reading:
        rows = self._rows(partition, candidate)
        self._now += max(window_s, 0.0)
        if not rows:
            return Reading(math.nan, math.nan, self._idle_c, self._clock, window_s, 0, False,
                           f"{candidate.key} is not in the replay table")
        key = (partition.key, candidate.slot, candidate.sms, candidate.freq_mhz)
        i = self._next.get(key, 0)
        self._next[key] = i + 1
        t, e = rows[i % len(rows)]
        return Reading(t, e, self._idle_c, self._clock, window_s, max(1, round(window_s / t)))

    def measure_ops(self, ops: Sequence[Op], window_s: float) -> Reading:
        self._now += max(window_s, 0.0)
        return Reading(math.nan, math.nan, self._idle_c, self._clock, window_s, 0, False,
                       "a replay table holds partitions only, not plain op sequences")

    def space(self, partition: PartitionType) -> list[Candidate] | None:
        return sorted(Candidate(k[0], k[1], k[2], k[3]) for k in self.table if k[0] == partition.key)

    def partitions(self) -> list[PartitionType]:
        """PartitionTypes built from the table alone, so a search can run without a model.

        Each slot label becomes a one-op placeholder in a synthetic compute chain (in order of first
        appearance); a key ``<name>.join_<label>`` joins the comm after that slot's op.
        """
        labels: dict[str, list[str]] = {}
        for part, slot, _, _ in self.table:
            seen = labels.setdefault(part, [])
            if slot != SEQUENTIAL and slot not in seen:
                seen.append(slot)
        out = []
        for part, slots in labels.items():
            join_label = part.split(".join_", 1)[1] if ".join_" in part else None
            if join_label is not None and join_label not in slots:
                slots.append(join_label)
            ops, slot_objs = [], []
            for i, label in enumerate(slots):
                kind, op_kind = _KIND_OF.get(label.split("_")[0], ("memory", OpKind.ELEMENTWISE))
                ops.append(Op(label, op_kind))
                slot_objs.append(Slot(label, (i,), kind))
            join = slots.index(join_label) if join_label is not None else None
            comm = Op("comm", OpKind.COMM)
            out.append(PartitionType(part, Direction.FWD, tuple(ops), comm, tuple(slot_objs), join))
        return out


@HARDWARE.register("replay", ReplayConfig)
def build_replay(cfg: ReplayConfig, seed: int = 0) -> ReplayBackend:
    """Answers from a recorded (partition, slot, sms, clock) -> time, energy table."""
    return ReplayBackend(cfg, seed)
