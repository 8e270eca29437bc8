"""Drift check: false alarms without drift, and how large a drift ``mode=check`` finds.

On the simulated A100 (numbers are simulated) the mission workload (qwen1.7b pp2_tp8) is planned once
per planning seed; each plan's run is then checked as a user checks it (``python -m kareus ... mode=check
check.run=RUN``, the defaults: 4 settings per partition, 3 windows each, alpha 0.01, a 1% floor):
``--checks`` times without drift (each check with its own noise stream, ``check.seed``), and once per
planning seed at each simulated drift (``hardware.drift``: every execution that much slower at unchanged
power). Reported: the share of no-drift checks that flagged anything (the false alarm rate, to stay
under alpha), and per drift the share of checks that flagged every partition and that flagged any.

    python benchmarks/drift_check.py            # 4 planning seeds x 5 checks, drifts 0.5/1/2/5%
    python benchmarks/drift_check.py --quick    # 1 planning seed x 3 checks, drifts 1/5%

Writes runs/bench/drift_check.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ("+model=qwen1.7b", "parallel=pp2_tp8")
QUIET = ("tracking.enabled=false", "progress=false")


def kareus(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "kareus", *WORKLOAD, *QUIET, *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def plan(cwd: Path, seed: int) -> Path:
    """A planning run at ``seed``; its run directory."""
    res = kareus(cwd, f"seed={seed}", f"hydra.run.dir=runs/plan{seed}")
    if res.returncode != 0:
        raise SystemExit(f"planning run {seed} failed:\n{res.stderr[-2000:]}")
    return cwd / "runs" / f"plan{seed}"


def check(cwd: Path, run: Path, seed: int, check_seed: int, drift: float) -> dict:
    """One check's summary (its exit status must agree with it)."""
    out = cwd / "runs" / f"check_{run.name}_{check_seed}_{drift:g}"
    res = kareus(cwd, f"seed={seed}", "mode=check", f"check.run={run}", f"check.seed={check_seed}",
                 f"hardware.drift={drift}", f"hydra.run.dir={out}")
    if res.returncode not in (0, 3):
        raise SystemExit(f"check failed:\n{res.stderr[-2000:]}")
    summary = json.loads((out / "check_summary.json").read_text())
    assert (res.returncode == 3) == bool(summary["drifted"]), "exit status and summary disagree"
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 planning seed x 3 checks, drifts 1 and 5%%")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "drift_check.json"))
    args = ap.parse_args(argv)
    seeds = [0] if args.quick else [0, 1, 2, 3]
    checks = 3 if args.quick else 5
    drifts = [0.01, 0.05] if args.quick else [0.005, 0.01, 0.02, 0.05]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        runs = {s: plan(cwd, s) for s in seeds}
        clean = [check(cwd, runs[s], s, c, 0.0) for s in seeds for c in range(1, checks + 1)]
        moved = {d: [check(cwd, runs[s], s, 100, d) for s in seeds] for d in drifts}
    partitions = len(clean[0]["partitions"])
    result = {
        "simulated": True, "workload": " ".join(WORKLOAD), "planning_seeds": seeds, "partitions": partitions,
        "alpha": clean[0]["alpha"], "min_shift": clean[0]["min_shift"],
        "no_drift": {"checks": len(clean), "false_alarm_rate": sum(bool(c["drifted"]) for c in clean) / len(clean),
                     "alarms": [{"run": c["checked_run"], "partitions": {k: c["partitions"][k] for k in c["drifted"]}}
                                for c in clean if c["drifted"]],
                     "noise_time": [c["noise"]["time"] for c in clean],
                     "noise_energy": [c["noise"]["energy"] for c in clean]},
        "drift": {f"{d:g}": {"checks": len(ms),
                             "all_flagged": sum(len(m["drifted"]) == partitions for m in ms) / len(ms),
                             "any_flagged": sum(bool(m["drifted"]) for m in ms) / len(ms),
                             "mean_time_shift": sum(p["time_shift"] for m in ms for p in m["partitions"].values())
                             / (len(ms) * partitions)}
                  for d, ms in moved.items()},
        "wall_s": time.perf_counter() - start,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    nd = result["no_drift"]
    print(f"drift check on {result['workload']} (simulated A100), {partitions} partitions, alpha {result['alpha']}, "
          f"floor {result['min_shift'] * 100:g}%")
    print(f"no drift: {nd['checks']} checks, false alarm rate {nd['false_alarm_rate']:.2f}")
    for d, r in result["drift"].items():
        print(f"drift {float(d) * 100:g}%: every partition flagged in {r['all_flagged']:.0%} of {r['checks']} checks, "
              f"any in {r['any_flagged']:.0%}; mean measured time shift {r['mean_time_shift'] * 100:+.2f}%")
    print(f"wall time {result['wall_s']:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
