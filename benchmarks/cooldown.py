"""Cooldown policies on the simulated A100: profiling GPU-time against energy bias.

Profiles the same candidate set (a seeded sample of the attention partition's space, in search
order) with each cooldown policy, each on a fresh simulated GPU with the same seed, so the reading
noise is the same draw for every policy and the difference is the heat each leaves behind. The
reference is fully cooled: every candidate starts within 0.05 C of idle. ``bias`` is the mean
relative total-energy error against it (signed, a fraction); ``gpu_seconds`` is simulated
profiling time (``backend.now()``), probes included. All numbers are simulated.

    python benchmarks/cooldown.py [--candidates 150] [--seeds 8]

Writes runs/bench/cooldown.json: summary[policy] = {"gpu_seconds", "bias", ...} (means over seeds).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kareus.hardware  # noqa: E402,F401  (registers backends)
from kareus.hardware.tables import window_partition  # noqa: E402
from kareus.profiler import Profiler, ProfilerConfig  # noqa: E402
from kareus.registry import HARDWARE  # noqa: E402
from kareus.search.space import SpaceConfig, build_space  # noqa: E402

REFERENCE = {"name": "temperature", "delta_c": 0.05, "timeout_s": 1000.0, "poll_s": 0.5}
POLICIES = {
    "fixed": {"name": "fixed", "seconds": 5.0},
    "none": {"name": "none"},
    "temperature": {"name": "temperature"},
    "predictive": {"name": "predictive"},
    "predictive_5c": {"name": "predictive", "delta_c": 5.0},
    "compensated": {"name": "compensated"},
}


def hardware_config() -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "hardware" / "a100_sim.yaml"))
    cfg.pop("defaults", None)
    return cfg


def profile(cooldown: dict, candidates, partition, seed: int) -> tuple[float, list, Profiler]:
    backend = HARDWARE.build("sim", config=hardware_config(), seed=seed)
    prof = Profiler(ProfilerConfig(cooldown=cooldown), backend, None)
    ms = [prof.measure(partition, c) for c in candidates]
    return backend.now(), ms, prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidates", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args(argv)

    partition = window_partition(-1)
    probe = HARDWARE.build("sim", config=hardware_config(), seed=0)
    space = build_space(partition, probe.gpu, SpaceConfig())
    runs: dict[str, list[dict]] = {name: [] for name in ["reference", *POLICIES]}
    wall = time.time()
    for seed in range(args.seeds):
        cands = random.Random(seed).sample(space, min(args.candidates, len(space)))
        ref_s, ref, _ = profile(REFERENCE, cands, partition, seed)
        runs["reference"].append({"gpu_seconds": ref_s, "bias": 0.0, "abs_error": 0.0})
        for name, cool in POLICIES.items():
            secs, ms, prof = profile(cool, cands, partition, seed)
            rel = [m.energy_j / r.energy_j - 1.0 for m, r in zip(ms, ref) if not (m.failed or r.failed)]
            row = {"gpu_seconds": secs, "bias": statistics.fmean(rel),
                   "abs_error": statistics.fmean(abs(x) for x in rel)}
            if hasattr(prof.cooldown, "slopes"):
                row["leakage_w_per_c"] = {str(k): v for k, v in prof.cooldown.slopes.items()}
                row["tau_s"] = prof.cooldown.tau
                row["probe_gpu_seconds"] = prof.cooldown.probe_seconds
            runs[name].append(row)

    fixed_s = statistics.fmean(r["gpu_seconds"] for r in runs["fixed"])
    summary = {}
    for name, rows in runs.items():
        s = statistics.fmean(r["gpu_seconds"] for r in rows)
        biases = [r["bias"] for r in rows]
        summary[name] = {
            "gpu_seconds": s, "bias": statistics.fmean(biases), "max_abs_bias": max(abs(b) for b in biases),
            "bias_sd_over_seeds": statistics.stdev(biases) if len(biases) > 1 else 0.0,
            "abs_error": statistics.fmean(r["abs_error"] for r in rows),
            "time_vs_fixed": s / fixed_s - 1.0,
            "per_candidate_s": s / args.candidates,
        }
    comp = runs["compensated"]
    probe_s = statistics.fmean(r["probe_gpu_seconds"] for r in comp)
    per_cand = (summary["compensated"]["gpu_seconds"] - probe_s) / args.candidates
    per_fixed = fixed_s / args.candidates
    summary["compensated"]["probe_gpu_seconds"] = probe_s
    summary["compensated"]["per_candidate_without_probe_s"] = per_cand
    # the probe is paid once per GPU and run (kept in the journal): candidates per GPU for a 40% cut
    summary["compensated"]["candidates_for_40pct_cut"] = (probe_s / (0.6 * per_fixed - per_cand)
                                                          if 0.6 * per_fixed > per_cand else None)
    out = {
        "what": "simulated A100 (conf/hardware/a100_sim.yaml), attention partition fwd_attn_tp2, "
                "default profiler protocol (5 s window), each policy vs a fully cooled reference",
        "candidates": args.candidates, "seeds": args.seeds, "policies": {"reference": REFERENCE, **POLICIES},
        "summary": summary, "runs": runs, "goal": "time_vs_fixed <= -0.40 and |bias| <= 0.005",
        "wall_s": time.time() - wall,
    }
    path = ROOT / "runs" / "bench" / "cooldown.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))

    print(f"cooldown policies, simulated A100, {args.candidates} candidates x {args.seeds} seeds (simulated GPU-time)")
    print(f"{'policy':<15}{'GPU-s':>9}{'vs fixed':>10}{'bias':>9}{'max|bias|':>11}{'mean|err|':>11}")
    for name, s in summary.items():
        print(f"{name:<15}{s['gpu_seconds']:>9.0f}{s['time_vs_fixed']:>+10.1%}{s['bias']:>+9.2%}"
              f"{s['max_abs_bias']:>11.2%}{s['abs_error']:>11.2%}")
    c = summary["compensated"]
    print(f"compensated: probe {c['probe_gpu_seconds']:.0f} GPU-s once per GPU and run, then "
          f"{c['per_candidate_without_probe_s']:.2f} s/candidate vs {per_fixed:.2f} (fixed); a 40% cut from "
          f"{c['candidates_for_40pct_cut']:.0f} candidates per GPU on")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
