"""Warm-started re-search: profiles MBO needs to reach 0.98 of the exhaustive hypervolume, cold and warm.

On the simulated A100 (numbers are simulated) the old workload is qwen1.7b pp2_tp8. Its search (MBO at
the default budget, 15% of each space, reading noise on) leaves the measurements a journal would hold;
each scenario then changes the workload and searches the new one's partitions twice per seed, cold and
warm-started from those measurements (``search.warm_start``: prior points, never this run's):

- ``microbatches``: num_microbatches 8 -> 16 (the partitions are the same; the prior differs by noise);
- ``micro_batch_size``: micro_batch_size 8 -> 4 (every partition's shapes halve);
- ``seq_len``: seq_len 4096 -> 8192 (attention grows faster than the GEMMs);
- ``drift``: the same workload on a GPU that drifted (``hardware.drift=0.05``: every execution 5% slower
  at unchanged power, as ``mode=check`` flags it).

Every profile is a fresh noisy reading (the profiler's default protocol on a simulated GPU of the
search's own, reading noise on), as real profiling gives. After each profile the front of the readings
so far (what the search would report) is scored at the settings' noise-free truth against the new
partition's exhaustive front, normalised as ``benchmarks/search_efficiency.py`` does (ideal and nadir of
the true front, reference (1.1, 1.1)). Profiles to 0.98: the first profile count from which the ratio
stays at or above 0.98 until the search's budget (``--budget``, a share of the space) is spent; a search
that never gets there counts at its budget and is reported as censored. A cold search of that budget
starts with a 32-point Latin hypercube, so its count carries that design; ``--metric budget`` instead
runs a search per budget on a grid (2% .. 40% of the space) and reports the smallest budget whose search
ends at or above 0.98, as does the next one's (slower). Saving: 1 - warm / cold, per partition and seed;
per scenario the mean; overall the mean over scenarios.

    python benchmarks/warm_start.py           # 4 scenarios, every partition, 3 seeds
    python benchmarks/warm_start.py --quick   # 3 scenarios, 2 partitions, 1 seed (a few minutes on 2 cores)
    python benchmarks/warm_start.py --quick --metric budget   # the smallest budget, cold and warm

Writes runs/bench/warm_start.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kareus.search.hv import hypervolume, nondominated, normalise  # noqa: E402

TARGET = 0.98
REF = (1.1, 1.1)
OLD = ("qwen1.7b", "pp2_tp8")
SCENARIOS = {  # name -> (parallel overrides, hardware overrides)
    "microbatches": ({"num_microbatches": 16}, {}),
    "micro_batch_size": ({"micro_batch_size": 4}, {}),
    "seq_len": ({"seq_len": 8192}, {}),
    "drift": ({}, {"drift": 0.05}),
}
QUICK = ("micro_batch_size", "seq_len", "drift")


def workload(changes: dict) -> tuple:
    """(model, parallel) specs of the old workload with ``changes`` to its layout."""
    from search_efficiency import conf_workload

    model, par = conf_workload(*OLD)
    return model, replace(par, **changes)


def truths(changes: dict, hardware: dict, keys: tuple[str, ...] | None) -> list:
    """The new workload's partitions, each measured over its whole space with reading noise off."""
    from search_efficiency import sim_truths

    model, par = workload(changes)
    return sim_truths(0, hardware, [("new", model, par)], keys=keys, noise=False)


def mbo_config(budget_frac: float, seed: int):
    from kareus.search.config import MBOConfig, SurrogateConfig

    return MBOConfig(seed=seed, budget_frac=budget_frac, surrogate=SurrogateConfig(threads=1))


def search(truth, reader_seed: int, budget_frac: float, seed: int, prior: list | None = None):
    """One MBO search on fresh noisy readings; (result, readings in the order taken)."""
    from kareus.search import SearchProblem, budget_for
    from kareus.search.mbo import MBOSearcher

    cfg = mbo_config(budget_frac, seed)
    read = truth.readings.reader(reader_seed)
    taken = []

    def evaluate(batch, annotations=None):
        ms = read(batch, annotations)
        taken.extend(ms)
        return ms

    budget = budget_for(cfg, len(truth.space))
    problem = SearchProblem(truth.partition, truth.space, evaluate, budget, seed,
                            truth.static_power_w, prior=list(prior or []))
    return MBOSearcher(cfg).run(problem), taken


def trajectory(truth, taken: list) -> list[float]:
    """HV ratio after each profile: the readings' (time, total energy) front so far, scored at the truth."""
    ideal, nadir, front = truth.frame()
    base = hypervolume(normalise(front, ideal, nadir), REF)
    best: dict = {}
    out = []
    for m in taken:
        if not m.failed:
            best[m.candidate] = (m.time_s, m.energy_j)
        cands = list(best)
        read = np.array([best[c] for c in cands]).reshape(-1, 2)
        on = [cands[i] for i in range(len(cands)) if _pareto(read, i)]
        pts = np.array([truth.table[c][:2] for c in on]).reshape(-1, 2)
        out.append(hypervolume(normalise(pts, ideal, nadir), REF) / base if len(pts) else 0.0)
    return out


def _pareto(pts: np.ndarray, i: int) -> bool:
    p = pts[i]
    return not bool(np.any(np.all(pts <= p, axis=1) & np.any(pts < p, axis=1)))


def profiles_to(traj: list[float], target: float = TARGET) -> tuple[int, bool]:
    """(profiles from which the ratio stays >= target, reached); not reached: (len(traj), False)."""
    for k in range(len(traj)):
        if all(x >= target for x in traj[k:]):
            return k + 1, True
    return len(traj), False


GRID = (0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4)  # --metric budget: shares of the space


def smallest_budget(truth, seed: int, prior: list | None, top: float) -> tuple[int, bool]:
    """(smallest budget on ``GRID`` up to ``top`` whose search ends at or above the target, as does the
    next grid budget's, reached); none: (the top budget, False). Each budget is a search of its own,
    so the initial design and batch sizes are the ones that budget gets."""
    budgets = sorted({max(2, round(f * len(truth.space))) for f in GRID if f <= top + 1e-9})
    ends = {}

    def end(b: int) -> float:
        if b not in ends:
            ends[b] = trajectory(truth, search(truth, seed, b / len(truth.space), seed, prior)[1])[-1]
        return ends[b]

    for i, b in enumerate(budgets):
        if end(b) >= TARGET and (i + 1 == len(budgets) or end(budgets[i + 1]) >= TARGET):
            return b, True
    return budgets[-1], False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 scenarios, 2 partitions, 1 seed")
    ap.add_argument("--seeds", type=int, default=None, help="search seeds per scenario (default 3; --quick 1)")
    ap.add_argument("--budget", type=float, default=0.4, help="each search's budget, a share of the space")
    ap.add_argument("--scenarios", nargs="*", default=None, choices=list(SCENARIOS))
    ap.add_argument("--partitions", nargs="*", default=None, help="partition keys (default: all; --quick: 2)")
    ap.add_argument("--metric", choices=("anytime", "budget"), default="anytime",
                    help="anytime: profiles into one search of --budget; budget: the smallest budget on a grid "
                         "whose search ends at the target (a search per budget: slower)")
    ap.add_argument("--out", default=None, help="default: runs/bench/warm_start.json (--metric budget: "
                                                "warm_start_budget.json)")
    args = ap.parse_args(argv)
    args.out = args.out or str(ROOT / "runs" / "bench" / ("warm_start.json" if args.metric == "anytime"
                                                          else "warm_start_budget.json"))
    import kareus.search  # noqa: F401  (registers searchers and surrogates)
    from search_efficiency import sim_config

    seeds = list(range(args.seeds if args.seeds is not None else (1 if args.quick else 3)))
    names = args.scenarios or (list(QUICK) if args.quick else list(SCENARIOS))
    keys = tuple(args.partitions) if args.partitions else (("fwd_mlp", "bwd_attn") if args.quick else None)
    hw = sim_config("a100_sim")
    start = time.perf_counter()
    old = truths({}, hw, keys)
    old_runs = {}  # partition -> the old run's readings (what its journal holds), per seed
    for t in old:
        for s in seeds:
            old_runs[(t.partition.key, s)] = search(t, 1000 + s, 0.15, 1000 + s)[1]
    result = {"simulated": True, "old_workload": " ".join(OLD), "hardware": "a100_sim (reading noise on)",
              "target": TARGET, "metric": args.metric, "budget_frac": args.budget, "old_budget_frac": 0.15, "seeds": seeds,
              "scenarios": {}}
    for name in names:
        par_changes, hw_changes = SCENARIOS[name]
        new = truths(par_changes, {**hw, **hw_changes}, keys)
        rows = []
        for t in new:
            for s in seeds:
                prior = [m for m in old_runs.get((t.partition.key, s), []) if not m.failed]
                if args.metric == "budget":
                    cold, warm = (smallest_budget(t, s, p, args.budget) for p in (None, prior))
                else:
                    cold = profiles_to(trajectory(t, search(t, s, args.budget, s)[1]))
                    warm = profiles_to(trajectory(t, search(t, s, args.budget, s, prior)[1]))
                rows.append({"partition": t.partition.key, "seed": s, "space": len(t.space),
                             "prior_points": len(prior), "cold": cold[0], "cold_reached": cold[1],
                             "warm": warm[0], "warm_reached": warm[1], "saving": 1 - warm[0] / cold[0]})
                print(f"  {name} {t.partition.key} seed {s}: cold {cold[0]}{'' if cold[1] else '+'} "
                      f"warm {warm[0]}{'' if warm[1] else '+'} profiles (space {len(t.space)})", flush=True)
        result["scenarios"][name] = {
            "layout": par_changes, "hardware": hw_changes, "runs": rows,
            "cold_mean": statistics.mean(r["cold"] for r in rows), "warm_mean": statistics.mean(r["warm"] for r in rows),
            "saving_mean": statistics.mean(r["saving"] for r in rows),
            "censored": {"cold": sum(not r["cold_reached"] for r in rows), "warm": sum(not r["warm_reached"] for r in rows)}}
    result["mean_saving"] = statistics.mean(v["saving_mean"] for v in result["scenarios"].values())
    result["wall_s"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    how = (f"within one search of {args.budget:.0%} of each space" if args.metric == "anytime"
           else f"the smallest budget on a grid up to {args.budget:.0%} of each space")
    print(f"profiles to {TARGET} of the exhaustive hypervolume (simulated A100, noisy readings, {how}, "
          f"{len(seeds)} seed(s)); old run: {' '.join(OLD)} at 15%")
    print(f"{'scenario':<18}{'cold':>8}{'warm':>8}{'saving':>9}  censored (cold/warm)")
    for name, v in result["scenarios"].items():
        print(f"{name:<18}{v['cold_mean']:>8.1f}{v['warm_mean']:>8.1f}{v['saving_mean']:>8.0%}  "
              f"{v['censored']['cold']}/{v['censored']['warm']}")
    print(f"mean saving {result['mean_saving']:.0%}; wall time {result['wall_s']:.0f} s; written to {args.out}")


if __name__ == "__main__":
    main()
