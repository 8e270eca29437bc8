"""Composer benchmark: Kareus' LP deadline sweep against Perseus (lowtime's Phillips-Dessouky solver).

Both composers get the same 1F1B DAG and the same instruction options, and both frontiers are priced
by the same exact evaluator (critical path of measured option times; energy = dynamic x GPUs per
stage + static power x all GPUs x iteration time). The options are SYNTHETIC (kareus.compose.synthetic:
clock-derived, convex-ish time/energy tradeoffs with overlap-like jitter), not measurements.

Hypervolume reference point: the worst time and energy over both frontiers, pushed out by 10% of
each frontier span (a tight point, so the ratio is not flattered by empty area).

    python benchmarks/composer.py                 # 4x8, 4x16, 8x32 with lowtime; 10x128 ours only
    python benchmarks/composer.py --lowtime-all   # also run lowtime on 10x128 (hours)

Writes runs/bench/composer.json. Wall times are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kareus.compose.lp import KareusComposer, KareusComposerConfig  # noqa: E402
from kareus.compose.perseus import PerseusComposer, PerseusComposerConfig  # noqa: E402
from kareus.compose.schedule import pipeline_dag  # noqa: E402
from kareus.compose.synthetic import synthetic_options  # noqa: E402

SIZES = ((4, 8), (4, 16), (8, 32), (10, 128))
STATIC_POWER_W = 75.0  # A100-like power of a GPU blocked in a pipeline receive
GPUS_PER_STAGE = 8
PROBE_STEPS = 20  # lowtime steps timed to estimate a skipped full run (a lower bound: later steps are slower)


def _ref(*frontiers, margin: float = 0.1) -> tuple[float, float]:
    ts = [t for f in frontiers for t in f.times]
    es = [e for f in frontiers for e in f.energies]
    return (max(ts) + margin * (max(ts) - min(ts)), max(es) + margin * (max(es) - min(es)))


def run_size(stages: int, mbs: int, with_lowtime: bool, seed: int, num_deadlines: int) -> dict:
    dag = pipeline_dag("1f1b", stages, mbs)
    options = synthetic_options(stages, seed=seed)
    cpu0 = time.process_time()
    ours = KareusComposer(KareusComposerConfig(num_deadlines=num_deadlines)).compose(
        dag, options, STATIC_POWER_W, GPUS_PER_STAGE, stages)
    cpu = time.process_time() - cpu0
    row: dict = {"seconds": round(ours.seconds, 3), "cpu_seconds": round(cpu, 3), "points": len(ours),
                 "instructions": len(dag),
                 "fastest_time_s": float(ours.times[0]), "min_energy_j": float(ours.energies.min())}
    if with_lowtime:
        peer = PerseusComposer(PerseusComposerConfig())
        cpu0 = time.process_time()
        theirs = peer.compose(dag, options, STATIC_POWER_W, GPUS_PER_STAGE, stages)
        cpu = time.process_time() - cpu0
        ref = _ref(ours, theirs)
        wide = _ref(ours, theirs, margin=1.0)
        row.update({
            "lowtime_seconds": round(theirs.seconds, 3), "lowtime_cpu_seconds": round(cpu, 3),
            "lowtime_points": len(theirs),
            "lowtime_steps": peer.steps, "hv_ratio": ours.hypervolume(ref) / theirs.hypervolume(ref),
            "speedup": theirs.seconds / max(ours.seconds, 1e-9), "hv_reference": list(ref),
            "hv_ratio_wide_reference": ours.hypervolume(wide) / theirs.hypervolume(wide),
            "lowtime_fastest_time_s": float(theirs.times[0]), "lowtime_min_energy_j": float(theirs.energies.min()),
        })
    estimate, basis = _lowtime_estimate(dag, options, stages, ours)
    row.update({"lowtime_estimated_seconds": estimate, "lowtime_estimate_basis": basis})  # measured sizes: its check
    if not with_lowtime:
        row.update({"lowtime_seconds": None, "hv_ratio": None, "lowtime_skipped": True})
    return row


def _lowtime_estimate(dag, options, stages: int, ours) -> tuple[int, str]:
    """lowtime's time for a full walk, extrapolated from its first ``PROBE_STEPS`` steps: a lower bound,
    since its steps slow down as the walk goes on (the rows where lowtime also runs in full show by how much)."""
    probe = PerseusComposer(PerseusComposerConfig(max_steps=PROBE_STEPS))
    start = time.perf_counter()
    with _walk_cut_short_on_purpose():
        probe.compose(dag, options, STATIC_POWER_W, GPUS_PER_STAGE, stages)
    per_step = (time.perf_counter() - start) / max(probe.steps, 1)
    # a full walk shortens the iteration from all-cheapest to all-fastest one time unit per step
    span = ours.model.assess(ours.model.uniform("cheapest")).time_s - ours.times[0]
    steps = span / PerseusComposerConfig().unit_time_s
    return round(per_step * steps), (f"at least: {probe.steps} timed steps at {per_step:.3f} s/step x "
                                     f"~{steps:.0f} steps ({span:.3f} s span / 1 ms quantum)")


class _walk_cut_short_on_purpose:
    """Silences the Perseus composer's warning that compose.max_steps cut its walk short, where a
    probe or a warm-up sets it on purpose."""

    def __enter__(self) -> None:
        self.log = logging.getLogger("kareus.compose.perseus")
        self.level = self.log.level
        self.log.setLevel(logging.ERROR)

    def __exit__(self, *exc) -> None:
        self.log.setLevel(self.level)


def _warm_up() -> None:
    """Pay both composers' one-time imports (scipy/HiGHS, lowtime/networkx/matplotlib) before timing."""
    dag, options = pipeline_dag("1f1b", 2, 2), synthetic_options(2, seed=99)
    KareusComposer(KareusComposerConfig(num_deadlines=2)).compose(dag, options, STATIC_POWER_W, 1, 2)
    with _walk_cut_short_on_purpose():
        PerseusComposer(PerseusComposerConfig(max_steps=2)).compose(dag, options, STATIC_POWER_W, 1, 2)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(f"{s}x{m}" for s, m in SIZES))
    ap.add_argument("--lowtime-all", action="store_true", help="run lowtime on 10x128 too (hours)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-deadlines", type=int, default=KareusComposerConfig().num_deadlines)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "composer.json"))
    args = ap.parse_args(argv)
    summary, notes = {}, []
    _warm_up()
    for size in args.sizes.split(","):
        s, m = (int(x) for x in size.lower().split("x"))
        with_lowtime = args.lowtime_all or s * m < 10 * 128
        row = run_size(s, m, with_lowtime, args.seed, args.num_deadlines)
        summary[f"{s}x{m}"] = row
        if not with_lowtime:
            notes.append(f"lowtime skipped on {s}x{m}: estimated at least {row['lowtime_estimated_seconds']} s "
                         f"({row['lowtime_estimate_basis']})")
        _print_row(f"{s}x{m}", row)
    result = {
        "benchmark": "composer",
        "options": "synthetic (kareus.compose.synthetic), not measured; same DAG and options for both composers",
        "static_power_w": STATIC_POWER_W, "gpus_per_stage": GPUS_PER_STAGE, "seed": args.seed,
        "cpu_count": os.cpu_count(),
        "timing": "wall seconds (and process CPU seconds) on a shared machine, so noisy; one-time imports "
                  "excluded by a 2x2 warm-up of both composers",
        "hv_reference": "worst time/energy over both frontiers + 10% of their span (hv_ratio); "
                        "+100% of the span for hv_ratio_wide_reference (less sensitive to the ends)",
        "notes": notes, "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for n in notes:
        print("note:", n)
    print(f"wrote {out}")
    return result


def _print_row(name: str, row: dict) -> None:
    lt = row.get("lowtime_seconds")
    hv = row.get("hv_ratio")
    print(f"{name:>7}  ours {row['seconds']:8.2f} s (cpu {row['cpu_seconds']:.2f} s, {row['points']:3d} pts)   lowtime "
          + (f"{lt:8.2f} s ({row['lowtime_points']:4d} pts)  speedup {row['speedup']:6.1f}x  hv_ratio {hv:.4f}"
             + f" (first-steps estimate {row['lowtime_estimated_seconds']} s)"
             if lt is not None else f"skipped (est. at least {row['lowtime_estimated_seconds']} s)"), flush=True)


if __name__ == "__main__":
    main()
