"""Plan quality: what searching a fraction of each partition's space costs in the execution plans.

The partition hypervolume ratios of search_efficiency.py weigh every part of a partition's frontier
alike; a user sees the plans. Here, per workload on the simulated A100 (numbers are simulated), every
partition's whole space is measured once, as search_efficiency.py measures it (the profiler's
default protocol), but on one simulated GPU in turn, then the residual work, Megatron's reference and
Megatron's layout at every clock of the search space (Perseus' space) through the profiler; every
searcher reads that one lookup. Each searcher's measured
candidates are then composed into the iteration frontier exactly as a run composes them
(``kareus.pipeline.composing.compose``), beside the composition of every candidate (exhaustive).

Reported per searcher and budget, mean over seeds and then workloads, against the exhaustive
composition: the iteration frontier's hypervolume ratio (normalised as in search_efficiency.py), and
the extra energy of two plans a user picks: the least-energy plan within Megatron's iteration time
(``plan.deadline_s``) and the fastest plan (``plan.select=max_throughput``, whose extra time is reported too).
Beside them, the energy the least-energy plan within Megatron's time saves against Megatron + Perseus
(Megatron's layout with a clock per instruction, composed the same way) at that time: the published
system's headline comparison.

``--noisy`` runs search_efficiency.py's noisy protocol instead: every measurement a search takes is a
fresh reading (the simulated GPU's reading noise on, each search on a GPU of its own, every reading
charged to the budget), while the lookup every plan is priced from, the residual work and Megatron's
reference are read with the reading noise off (the truth). Each searcher's measured settings are
composed at that truth, as search_efficiency.py scores a reported front at it: what noise cost is
the settings the search did not find.

    python benchmarks/plan_quality.py            # mbo, tpe, artifact, random at 10% and 15%, 3 seeds
    python benchmarks/plan_quality.py --quick    # 1 seed
    python benchmarks/plan_quality.py --noisy    # the noisy protocol

Writes runs/bench/plan_quality.json (``--noisy``: plan_quality_noisy.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import search_efficiency as se  # noqa: E402

from kareus.search.hv import hypervolume, nondominated, normalise  # noqa: E402

SEARCHERS = ("mbo", "tpe", "artifact", "random")
BUDGETS = (0.1, 0.15)


def workload_context(model: str, parallel: str, run_dir: Path):
    """The run context ``python -m kareus +model=MODEL parallel=PARALLEL`` builds (default simulated A100)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from kareus.components import register_all
    from kareus.config.overrides import CONFIG_MODULE, CONFIG_NAME
    from kareus.config.validate import validate
    from kareus.pipeline.context import build_context

    register_all()
    GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose(CONFIG_NAME, overrides=[f"+model={model}", f"parallel={parallel}"])
    return build_context(cfg, validate(cfg), run_dir)


def quiet_backend(ctx):
    """The run's simulated GPU with its reading noise off: the noisy protocol's truth."""
    from dataclasses import replace

    from kareus.pipeline.searching import hardware_config
    from kareus.registry import HARDWARE

    hw = replace(hardware_config(ctx), time_noise=0.0, power_noise=0.0)
    return HARDWARE.build(ctx.hardware_name, config=hw, seed=int(ctx.cfg.seed))


def with_readings(ctx, truths: list) -> list:
    """``truths`` with the noisy protocol's fresh readings: the run's simulated GPU, reading noise on."""
    from dataclasses import asdict

    from kareus.pipeline.searching import hardware_config

    hw = asdict(hardware_config(ctx))
    for t in truths:
        t.readings = se.SimReadings(hw, t.partition)
    return truths


def settings_at_truth(truth, result):
    """A noisy search's result with each setting it measured at ``truth``: plans composed from what it
    found, priced without its reading noise (as search_efficiency.py scores a reported front)."""
    from dataclasses import replace

    found = [m.candidate for m in result.per_setting() if not m.failed]
    return replace(result, measurements=truth.evaluate(found), settings=[])


def exhaustive_inputs(ctx, label: str, run_dir: Path, noise: bool = True):
    """Every partition measured over its whole space, then the residual work and the reference
    (``noise=False``: with the simulated GPU's reading noise off)."""
    from kareus.pipeline.composing import measure_fixed_work, measure_perseus_space
    from kareus.pipeline.searching import make_backend
    from kareus.profiler import Journal, Profiler, ProfilerConfig
    from kareus.profiler.journal import journal_path_for
    from kareus.registry import SEARCHERS as REG, to_dataclass
    from kareus.search import build_space

    backend = make_backend(ctx) if noise else quiet_backend(ctx)
    space_cfg = ctx.typed["search"].space
    truths = [se.measure_space(label, backend, t, build_space(t, ctx.gpu, space_cfg)) for t in ctx.partitioning.types]
    results = [REG.build("exhaustive", config={"seed": 0}).run(se.problem(t, len(t.space), 0))
               for t in truths]
    journal = Journal.open(journal_path_for(run_dir), ctx.config_hash)
    try:
        with Profiler(to_dataclass(ProfilerConfig, ctx.typed["profiler"]), backend, journal) as profiler:
            fixed = measure_perseus_space(ctx, profiler, measure_fixed_work(ctx, profiler, results))
    finally:
        journal.close()
    return truths, results, fixed


def plan_points(frontier, reference_time_s: float) -> dict:
    """The fastest plan, and the least-energy plan within Megatron's iteration time (None if none is)."""
    pts = np.array([[p.time_s, p.energy_j] for p in frontier.frontier])
    fastest = pts[np.argmin(pts[:, 0])]
    within = pts[pts[:, 0] <= reference_time_s]
    deadline = within[np.argmin(within[:, 1])] if len(within) else None
    return {"points": pts, "fastest": fastest, "deadline": deadline}


def perseus_energy_within(comp, time_s: float) -> float | None:
    """Megatron + Perseus' least iteration energy within ``time_s`` (None without its frontier or
    a point that fast)."""
    from kareus.plan.baseline import least_energy_within

    if comp.perseus is None:
        return None
    return least_energy_within([(p.time_s, p.energy_j) for p in comp.perseus.frontier], time_s)


def compare(ours: dict, exh: dict, perseus_energy_j: float | None = None) -> dict:
    ideal, nadir = exh["points"].min(axis=0), exh["points"].max(axis=0)
    base = hypervolume(normalise(nondominated(exh["points"]), ideal, nadir), se.REF)
    out = {"hv_ratio": hypervolume(normalise(nondominated(ours["points"]), ideal, nadir), se.REF) / base,
           "fastest_extra_time": float(ours["fastest"][0] / exh["fastest"][0] - 1),
           "fastest_extra_energy": float(ours["fastest"][1] / exh["fastest"][1] - 1)}
    if exh["deadline"] is not None:  # the extra energy averages the runs with such a plan; this says how many
        out["deadline_met"] = float(ours["deadline"] is not None)
    if ours["deadline"] is not None and exh["deadline"] is not None:
        out["deadline_extra_energy"] = float(ours["deadline"][1] / exh["deadline"][1] - 1)
    if ours["deadline"] is not None and perseus_energy_j:
        out["perseus_energy_saving"] = float(1 - ours["deadline"][1] / perseus_energy_j)
    return out


def run_workload(model: str, parallel: str, searchers, budgets, seeds: int, protocol: str = "lookup") -> list[dict]:
    """Rows of every searcher, budget and seed on one workload under ``protocol`` (lookup or noisy)."""
    from kareus.pipeline.composing import compose
    from kareus.registry import SEARCHERS as REG

    rows = []
    noisy = protocol == "noisy"
    with tempfile.TemporaryDirectory() as tmp:
        ctx = workload_context(model, parallel, Path(tmp))
        t0 = time.perf_counter()
        truths, results, fixed = exhaustive_inputs(ctx, f"{model}-{parallel}", Path(tmp), noise=not noisy)
        if noisy:
            with_readings(ctx, truths)
        comp = compose(ctx, results, fixed)
        ref_t = comp.reference.time_s
        exh = plan_points(comp.frontier, ref_t)
        perseus = perseus_energy_within(comp, ref_t)
        rows.append({"workload": f"{model}-{parallel}", "searcher": "exhaustive", "budget_frac": 1.0, "seed": 0,
                     "profiled": sum(len(r.measurements) for r in results), **compare(exh, exh, perseus)})
        print(f"{model} {parallel}: {sum(len(t.space) for t in truths)} candidates, exhaustive frontier "
              f"{len(exh['points'])} plans ({time.perf_counter() - t0:.0f} s; simulated)", flush=True)
        for frac in budgets:
            for seed in range(seeds):
                for name in searchers:
                    raw = []
                    for t in truths:
                        budget = se.budget_of(frac, len(t.space))
                        s = REG.build(se.searcher_name(name), config=se.searcher_config(name, seed, budget))
                        raw.append(s.run(se.for_protocol(se.problem(t, budget, seed), t, protocol)))
                    res = [settings_at_truth(t, r) for t, r in zip(truths, raw)] if noisy else raw
                    ours = plan_points(compose(ctx, res, fixed).frontier, ref_t)
                    rows.append({"workload": f"{model}-{parallel}", "searcher": name, "budget_frac": frac, "seed": seed,
                                 "profiled": sum(len(r.measurements) for r in raw), **compare(ours, exh, perseus)})
                print(f"  budget {frac:g} seed {seed} done", flush=True)
    return rows


NOISY = ("; noisy protocol: every reading a search takes is fresh (reading noise on, each search on a GPU of its "
         "own, every reading charged), while the candidates, residual work and Megatron's reference are priced "
         "with the reading noise off, and each searcher's measured settings are composed at those prices")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 seed")
    ap.add_argument("--searchers", default=",".join(SEARCHERS))
    ap.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS))
    ap.add_argument("--noisy", action="store_true", help="search_efficiency.py's noisy protocol (see above)")
    ap.add_argument("--out", default=None, help="default: runs/bench/plan_quality[_noisy].json")
    args = ap.parse_args(argv)
    protocol = "noisy" if args.noisy else "lookup"
    seeds = 1 if args.quick else args.seeds
    searchers = [s for s in args.searchers.split(",") if s]
    budgets = tuple(float(b) for b in args.budgets.split(","))
    t0 = time.perf_counter()
    rows = []
    for model, parallel in se.WORKLOADS:
        rows += run_workload(model, parallel, searchers, budgets, seeds, protocol)
    metrics = ("hv_ratio", "deadline_met", "deadline_extra_energy", "fastest_extra_energy", "fastest_extra_time",
               "perseus_energy_saving")
    doc = {"description": "iteration frontiers composed from each searcher's measured candidates against the "
                          "composition of every candidate (simulated A100): HV ratio, and the extra energy "
                          "(and time) of the least-energy plan within Megatron's time and of the fastest plan; "
                          "the energy that plan saves against Megatron + Perseus at Megatron's time "
                          "(exhaustive: every candidate, budget 1.0)" + (NOISY if args.noisy else ""),
           "protocol": protocol, "workloads": [f"{m}-{p}" for m, p in se.WORKLOADS], "seeds": seeds,
           **{m: se.summarise(rows, m) for m in metrics}, "runs": rows, "wall_s": time.perf_counter() - t0}
    out = Path(args.out or ROOT / "runs" / "bench" / f"plan_quality{'_noisy' if args.noisy else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc, (*budgets, 1.0))
    print(f"wrote {out} ({doc['wall_s']:.0f} s)")
    return doc


def print_table(doc: dict, budgets) -> None:
    se.print_budget_tables(doc, [str(b) for b in budgets], (
        ("iteration frontier HV ratio (simulated)", "hv_ratio", "{:.4f}"),
        ("share of runs with a plan within Megatron's time (simulated)", "deadline_met", "{:.0%}"),
        ("extra energy, least-energy plan within Megatron's time (runs with one; simulated)", "deadline_extra_energy",
         "{:+.2%}"),
        ("extra energy, fastest plan (simulated)", "fastest_extra_energy", "{:+.2%}"),
        ("extra time, fastest plan (simulated)", "fastest_extra_time", "{:+.2%}"),
        ("energy saved against Megatron + Perseus at Megatron's time (simulated)", "perseus_energy_saving", "{:+.2%}")))


if __name__ == "__main__":
    main()
