"""The published evaluation on the simulated A100 testbed (16 GPUs, 2 nodes), beside the published numbers.

Every number this benchmark produces comes from the simulated A100 (labelled simulated); the published
ones were measured on 16 real A100 40 GB (/work/shared/paper/published.md, ``PUBLISHED`` below).
Each configuration runs the project's own pipeline in this process, as ``python -m kareus`` runs it
(``kareus.pipeline``: partition searches through the launcher, residual work, Megatron's reference and
Megatron + Perseus' space through the profiler, then ``compose``), with tracking off:

- end to end: the 12 configurations the paper attempted (two models; TP 8 and CP 2 + TP 4 under PP 2;
  micro-batch 8 and 16 at 8 microbatches; sequence 4096, 8192 where published), each with Megatron
  (its own layout, top clock), Megatron + Perseus (M+P: that layout, a clock per instruction), N+P
  (``+experiment=nanobatch_perseus``) and Kareus: the max-throughput point against Megatron, the energy
  saved against M+P at equal time and the time saved at equal energy (on M+P's frontier thinned to 10
  points, as the paper compared frontiers). A configuration the project's memory model refuses on
  A100 40 GB is marked OOM and not run; the pair that ran out of memory in the paper is named beside;
- Table 8: each ablation bundle against full Kareus, at equal time (the least energy within the full
  run's max-throughput time, or the variant's fastest plan where none is that fast) and at each
  variant's own max-throughput point;
- the 70B emulation: llama3.3-70b pp10_tp8 searched once; its plans re-composed for 16, 32, 64 and 128
  microbatches (a composition-only key, as ``resume=`` treats it), global batch 2048 at micro-batch 8,
  so dp = 2048 / (8 x microbatches) pipelines (energy of all their GPUs; the gradient all-reduce
  between them is not modelled);
- search cost: profiled candidates and simulated GPU-hours against the exhaustive partition space;
- sensitivity (``--sensitivity N``, alone): the simulated claims under N draws of the simulator's assumed
  parameters, each uniform within its range (``kareus/hardware/assumed.py``), the 7 fitted ones refitted
  on the same two windows of the real A100 table each time (``sim_fidelity.refit``). Per draw: the
  mission configuration (qwen1.7b tp8 mb8 s4096, Table 8's workload) at the run's own budgets, its
  Table 8 variants, and the fidelity scores on the real table's held-out rows; reported as the median
  and the 10-90% band over draws (interpolated between draws), beside the shipped config's values.

    python benchmarks/paper.py                   # everything (about 7 min on 2 cores)
    python benchmarks/paper.py --quick           # 3 configurations, the ablations, 70B at 16 and 64 microbatches
    python benchmarks/paper.py --smoke           # one configuration at a tiny budget (what the tests run)
    python benchmarks/paper.py --sensitivity 20  # the sensitivity study alone (7-10 min on 2 cores)

Writes runs/bench/paper.json (``--sensitivity``: its ``sensitivity`` key, the rest kept; a later run of
the rest keeps that key).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # sim_fidelity.py, when imported from elsewhere

from omegaconf import DictConfig  # noqa: E402

from kareus.frontier import within_limit  # noqa: E402
from kareus.plan.baseline import least_energy_within  # noqa: E402
from kareus.plan.report import even_spread  # noqa: E402

PUBLISHED = {
    "max_throughput_vs_megatron": {"time_saving_pct_up_to": 14.9, "energy_saving_pct_up_to": 22.1},
    "vs_mp": {"energy_saving_equal_time_pct_up_to": 28.3, "time_saving_equal_energy_pct_up_to": 27.5},
    "small_workload": {"config": "qwen1.7b cp2tp4 mb8 s4096", "np_time_saving_pct": -20.4,
                       "kareus_time_saving_pct": -0.5},
    "ablations": {"no_clock_search": {"time_pct": 1.0, "energy_pct": 12.9},
                  "no_kernel_scheduling": {"time_pct": 8.2, "energy_pct": 10.8},
                  "plain_nanobatching": {"time_pct": 7.8, "energy_pct": 20.6}},
    "seventy_b": {"time_saving_pct": [9.1, 9.3], "energy_saving_pct": [19.7, 20.2],
                  "energy_saving_vs_mp_equal_time_pct": [11.6, 15.3],
                  "time_saving_vs_mp_equal_energy_pct": [16.0, 19.1]},
    "search_cost": {"candidates": 85000, "exhaustive_gpu_hours": 4912, "mbo_gpu_hours": 32},
}
MP_POINTS = 10  # the paper compared 10-point frontiers
# (name, overrides, published row, takes the run's search budget): the shipped bundles, and plain
# nanobatching with its small space (one slot, one SM count, 10 clocks) profiled whole: the bundle's
# budget fraction leaves it 2 profiles per partition
ABLATIONS = (
    ("no_clock_search", ["+experiment=no_clock_search"], "no_clock_search", True),
    ("no_kernel_scheduling", ["+experiment=no_kernel_scheduling"], "no_kernel_scheduling", True),
    ("plain_nanobatching", ["+experiment=plain_nanobatching"], "plain_nanobatching", True),
    ("plain_nanobatching, whole space", ["+experiment=plain_nanobatching", "search=exhaustive"], "plain_nanobatching",
     False),
)
SEVENTY_B_MICROBATCHES = (16, 32, 64, 128)
GLOBAL_BATCH_70B = 2048
NP_BUNDLE = "nanobatch_perseus"
METHOD = {
    "configs": "micro-batch 8 or 16 sequences at 8 microbatches (global batch 64 or 128), as published; Megatron: "
               "its own layout at the top clock; M+P: that layout, one clock per instruction (the run's Megatron + "
               "Perseus frontier); N+P: +experiment=nanobatch_perseus; Kareus: the default run (mbo, 15% of each "
               "partition's space)",
    "against_mp": f"energy saved at equal time and time saved at equal energy, at Megatron's time and the most over "
                  f"M+P's frontier thinned to {MP_POINTS} points",
    "ablations": "equal time: the least energy of the variant and of full Kareus within the later of the two "
                 "fastest times; max throughput: each one's fastest plan",
    "seventy_b": "searched once (16 microbatches), the same measurements composed per microbatch count with "
                 "dp = 2048 / (8 x microbatches) pipelines (energy of all their GPUs; no gradient all-reduce)",
    "search_cost": "exhaustive: each partition's space at its mean simulated GPU-seconds per profiled candidate",
}
TIE_PCT = 0.05  # per-cent differences within this are ties (the paper's "tie after rounding")


@dataclass(frozen=True)
class Config:
    """One end-to-end configuration: PP 2 over the two nodes, 8 microbatches."""

    model: str
    parallel: str  # pp2_tp8 | pp2_cp2_tp4
    micro_batch: int
    seq_len: int
    published_oom: bool = False  # ran out of memory on the paper's A100 40 GB testbed
    num_microbatches: int = 8
    hardware: tuple[str, ...] = ()  # hardware.* overrides (a sensitivity draw)

    @property
    def name(self) -> str:
        layout = {"pp2_tp8": "tp8", "pp2_cp2_tp4": "cp2tp4"}.get(self.parallel, self.parallel)
        return f"{self.model} {layout} mb{self.micro_batch} s{self.seq_len}"

    def overrides(self) -> list[str]:
        return [f"+model={self.model}", f"parallel={self.parallel}", f"parallel.micro_batch_size={self.micro_batch}",
                f"parallel.seq_len={self.seq_len}", f"parallel.num_microbatches={self.num_microbatches}",
                *self.hardware]


CONFIGS = (
    Config("llama3.2-3b", "pp2_tp8", 8, 4096),
    Config("llama3.2-3b", "pp2_tp8", 8, 8192, published_oom=True),
    Config("llama3.2-3b", "pp2_tp8", 16, 4096, published_oom=True),
    Config("llama3.2-3b", "pp2_cp2_tp4", 8, 4096),
    Config("llama3.2-3b", "pp2_cp2_tp4", 8, 8192),
    Config("llama3.2-3b", "pp2_cp2_tp4", 16, 4096),
    Config("qwen1.7b", "pp2_tp8", 8, 4096),
    Config("qwen1.7b", "pp2_tp8", 8, 8192),
    Config("qwen1.7b", "pp2_tp8", 16, 4096),
    Config("qwen1.7b", "pp2_cp2_tp4", 8, 4096),
    Config("qwen1.7b", "pp2_cp2_tp4", 8, 8192),
    Config("qwen1.7b", "pp2_cp2_tp4", 16, 4096),
)
ABLATION_CONFIG = "qwen1.7b tp8 mb8 s4096"  # Table 8's workload
QUICK = ("qwen1.7b tp8 mb8 s4096", "qwen1.7b cp2tp4 mb8 s4096", "llama3.2-3b tp8 mb8 s8192")


@dataclass
class Outcome:
    """One run of the pipeline: its context, composition and what the searches and fixed work cost."""

    ctx: Any
    comp: Any
    results: list
    fixed: Any
    sizes: dict[str, int]
    fixed_gpu_seconds: float
    perseus_gpu_seconds: float
    wall_s: float


# --- running the pipeline -----------------------------------------------------------------------------

def composed(overrides: Sequence[str]) -> DictConfig:
    """The Hydra config ``python -m kareus OVERRIDES`` composes, tracking and the live display off."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from kareus.components import register_all
    from kareus.config.overrides import CONFIG_MODULE, CONFIG_NAME

    register_all()
    GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return compose(CONFIG_NAME, overrides=[*overrides, "tracking.enabled=false", "progress=false"])


def memory_problem_of(cfg: DictConfig) -> str | None:
    """Why the project's memory model refuses the layout on the configured GPU (None: it may fit)."""
    from kareus.workload.memory import memory_problem

    return memory_problem(cfg.model, cfg.parallel, str(cfg.hardware.gpu), float(cfg.hardware.memory_gb))


def memory_gb_least(cfg: DictConfig) -> float:
    """The memory model's least GB on the fullest GPU (bf16 weights and gradients, layer inputs)."""
    from kareus.workload.memory import BYTES_PER_PARAMETER_AT_LEAST, stage_activation_bytes, stage_parameters

    return max((n * BYTES_PER_PARAMETER_AT_LEAST + a) / 1e9 for n, a in
               zip(stage_parameters(cfg.model, cfg.parallel), stage_activation_bytes(cfg.model, cfg.parallel)))


def run_pipeline(cfg: DictConfig, run_dir: Path) -> Outcome:
    """Search every partition, measure the fixed work and Megatron + Perseus' space, compose: what
    ``mode=run`` does before it writes plans (``kareus.pipeline.run``)."""
    from kareus.config.validate import validate
    from kareus.pipeline.composing import compose, measure_fixed_work, measure_perseus_space
    from kareus.pipeline.context import build_context
    from kareus.pipeline.searching import checked_launcher, make_tasks, opened_backend, partition_types, space_sizes
    from kareus.profiler import Journal, Profiler, ProfilerConfig
    from kareus.registry import to_dataclass

    t0 = time.perf_counter()
    ctx = build_context(cfg, validate(cfg), run_dir)
    with opened_backend(ctx) as backend:
        partitions = partition_types(ctx, backend)
        sizes = space_sizes(ctx, backend, partitions)
        results = checked_launcher(ctx, partitions).run(make_tasks(ctx, partitions, lambda p: []))
        searched = {m.candidate.key for r in results for m in r.measurements}
        journal = Journal.open(ctx.journal_path, ctx.config_hash)
        try:
            with Profiler(to_dataclass(ProfilerConfig, ctx.typed["profiler"]), backend, journal) as profiler:
                fixed = measure_fixed_work(ctx, profiler, results)
                fixed_costs = {k: c for k, c in profiler.costs().items() if k not in searched}
                if ctx.typed["plan"].compare_perseus:
                    fixed = measure_perseus_space(ctx, profiler, fixed)
                perseus_costs = {k: c for k, c in profiler.costs().items()
                                 if k not in searched and k not in fixed_costs}
        finally:
            journal.close()
    comp = compose(ctx, results, fixed)
    return Outcome(ctx, comp, list(results), fixed, sizes, sum(fixed_costs.values()), sum(perseus_costs.values()),
                   time.perf_counter() - t0)


def recomposed(out: Outcome, **parallel: int) -> Any:
    """The same measurements composed for another layout of composition-only keys (microbatches, dp)."""
    from kareus.pipeline.composing import compose

    ctx = dataclasses.replace(out.ctx, parallel=dataclasses.replace(out.ctx.parallel, **parallel))
    return compose(ctx, out.results, out.fixed)


# --- reading a composition ---------------------------------------------------------------------------

def points_of(frontier: Any) -> list[tuple[float, float]]:
    """(time, energy) of every point of an iteration frontier."""
    return [(float(p.time_s), float(p.energy_j)) for p in frontier.frontier]


def fastest(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The max-throughput point (the least energy among equally fast ones)."""
    return min(points, key=lambda p: (p[0], p[1]))


def fastest_within_energy(points: Sequence[tuple[float, float]], energy_j: float) -> float | None:
    """The least time among points within an energy budget (None: none is)."""
    within = [t for t, e in points if within_limit(e, energy_j)]
    return min(within) if within else None


def saving(base: float, value: float) -> float:
    """Per cent saved against ``base``, positive = less."""
    return 100.0 * (1.0 - value / base)


def point(time_s: float, energy_j: float, ref: tuple[float, float] | None = None) -> dict[str, float]:
    """A (time, energy) point, with its savings against Megatron's reference where given."""
    out = {"time_s": time_s, "energy_j": energy_j}
    if ref is not None:
        out.update(time_saving_pct=saving(ref[0], time_s), energy_saving_pct=saving(ref[1], energy_j))
    return out


def thinned(points: Sequence[tuple[float, float]], n: int = MP_POINTS) -> list[tuple[float, float]]:
    """``n`` points of a frontier, both ends and an even spread between them."""
    pts = sorted(points)
    return [pts[i] for i in sorted(even_spread(len(pts), n))]


def against_mp(ours: Sequence[tuple[float, float]], mp: Sequence[tuple[float, float]], ref_time_s: float) -> dict:
    """Energy saved at M+P's times and time saved at its energies, at Megatron's time and the most over
    M+P's frontier thinned to ``MP_POINTS`` points."""
    at_ref = least_energy_within(mp, ref_time_s)
    energy, times = [], []
    for t, e in thinned(mp):
        ours_e, ours_t = least_energy_within(ours, t), fastest_within_energy(ours, e)
        if ours_e is not None:
            energy.append(saving(e, ours_e))
        if ours_t is not None:
            times.append(saving(t, ours_t))
    out: dict[str, float | None] = {
        "energy_saving_equal_time_max_pct": max(energy, default=None),
        "time_saving_equal_energy_max_pct": max(times, default=None),
        "energy_saving_at_megatron_time_pct": None, "time_saving_at_mp_energy_pct": None}
    if at_ref is not None:
        ours_e = least_energy_within(ours, ref_time_s)
        ref_mp_t = min(t for t, e in mp if within_limit(t, ref_time_s) and e == at_ref)
        ours_t = fastest_within_energy(ours, at_ref)
        out["energy_saving_at_megatron_time_pct"] = None if ours_e is None else saving(at_ref, ours_e)
        out["time_saving_at_mp_energy_pct"] = None if ours_t is None else saving(ref_mp_t, ours_t)
    return out


def search_cost(out: Outcome) -> dict[str, float]:
    """Profiled candidates and simulated GPU-hours against the exhaustive space, whose cost is each
    partition's space at that partition's mean GPU-seconds per profiled candidate (an estimate)."""
    profiled = sum(len(r.measurements) for r in out.results)
    exhaustive_s = sum(out.sizes[r.partition] * r.gpu_seconds / len(r.measurements)
                       for r in out.results if r.measurements)
    space = sum(out.sizes.values())
    return {"partitions": len(out.results), "space": space, "profiled": profiled, "profiled_share": profiled / space,
            "search_gpu_hours": sum(r.gpu_seconds for r in out.results) / 3600,
            "exhaustive_gpu_hours_estimate": exhaustive_s / 3600,
            "fixed_work_gpu_hours": out.fixed_gpu_seconds / 3600, "mp_gpu_hours": out.perseus_gpu_seconds / 3600,
            "wall_s": out.wall_s}


def compared(comp: Any) -> dict[str, Any]:
    """Megatron, M+P and Kareus from one composition (Kareus' frontier joins M+P's and Megatron's point)."""
    ref = (float(comp.reference.time_s), float(comp.reference.energy_j))
    ours = points_of(comp.frontier)
    mp = points_of(comp.perseus) if comp.perseus is not None else [ref]
    mp_fast = fastest(mp)
    return {
        "megatron": point(*ref),
        "mp": {**point(*mp_fast, ref), "points": len(mp), "min_energy_j": min(e for _, e in mp),
               "energy_at_megatron_time_j": least_energy_within(mp, ref[0])},
        "kareus": {**point(*fastest(ours), ref), "points": len(ours), **against_mp(ours, mp, ref[0])},
    }


# --- the three parts ---------------------------------------------------------------------------------

def config_row(config: Config, extra: Sequence[str], tmp: Path) -> tuple[dict[str, Any], Outcome | None]:
    """One end-to-end configuration: OOM by the memory model, or Megatron, M+P, N+P and Kareus."""
    cfg = composed([*config.overrides(), *extra])
    row: dict[str, Any] = {"name": config.name, "model": config.model, "parallel": config.parallel,
                           "micro_batch_size": config.micro_batch, "seq_len": config.seq_len,
                           "num_microbatches": config.num_microbatches,
                           "global_batch": config.micro_batch * config.num_microbatches,
                           "published": published_for(config), "simulated": True}
    problem = memory_problem_of(cfg)
    row.update(oom=problem is not None, oom_reason=problem, memory_gb_least=memory_gb_least(cfg))
    if problem:
        row.update(megatron=None, mp=None, np=None, kareus=None)
        row["disagreements"] = [] if config.published_oom else ["the memory model refuses a layout that ran"]
        return row, None
    full = run_pipeline(cfg, tmp / f"{config.name.replace(' ', '_')}")
    row.update(compared(full.comp))
    row["search_cost"] = search_cost(full)
    # N+P's space (one slot, one SM count, every clock) is profiled whole: no search budget applies
    np_out = run_pipeline(composed([*config.overrides(), f"+experiment={NP_BUNDLE}", "plan.compare_perseus=false"]),
                          tmp / f"{config.name.replace(' ', '_')}_np")
    ref = (row["megatron"]["time_s"], row["megatron"]["energy_j"])
    nps = points_of(np_out.comp.frontier)
    row["np"] = {**point(*fastest(nps), ref), "points": len(nps), "profiled": sum(len(r.measurements)
                                                                                for r in np_out.results)}
    ours = points_of(full.comp.frontier)
    mp = points_of(full.comp.perseus) if full.comp.perseus is not None else []
    row["kareus"]["shortfall_vs_mp_pct"] = shortfall(ours, mp)
    row["kareus"]["shortfall_vs_np_pct"] = shortfall(ours, nps)
    row["disagreements"] = config_disagreements(row)
    return row, full


def shortfall(ours: Sequence[tuple[float, float]], baseline: Sequence[tuple[float, float]]) -> float:
    """The most extra energy our least-energy plan within a baseline point's time needs over that point
    (per cent; 0: never worse); a point faster than all of ours counts our fastest plan's extra time."""
    worst = 0.0
    for bt, be in baseline:
        e = least_energy_within(ours, bt)
        worst = max(worst, 100 * (e / be - 1) if e is not None else 100 * (fastest(ours)[0] / bt - 1))
    return worst


def published_for(config: Config) -> dict[str, Any]:
    """What the paper published for this configuration (per-configuration values exist for few)."""
    out: dict[str, Any] = {"oom": config.published_oom}
    if config.name == PUBLISHED["small_workload"]["config"]:
        small = PUBLISHED["small_workload"]
        out.update(np_time_saving_pct=small["np_time_saving_pct"],
                   kareus_time_saving_pct=small["kareus_time_saving_pct"])
    return out


def direction(value: float, tol: float = TIE_PCT) -> int:
    """-1, 0 (a tie within ``tol`` per cent) or 1."""
    return 0 if abs(value) <= tol else (1 if value > 0 else -1)


def against_published(what: str, sim: float | None, pub: float) -> str | None:
    """A line where a simulated per-cent value points the other way from the published one, or ties
    where the published one does not (None: same direction, or nothing simulated)."""
    if sim is None or direction(sim) == direction(pub):
        return None
    kind = "opposite direction" if direction(sim) * direction(pub) < 0 else "no difference simulated"
    return f"{kind}: {what} {sim:+.1f}% (simulated), published {pub:+.1f}%"


def config_disagreements(row: dict[str, Any]) -> list[str]:
    """Where the simulated result points another way than the published one."""
    out = []
    pub = row["published"]
    if pub["oom"]:
        out.append("published: out of memory on A100 40 GB; the memory model (a lower bound: weights, gradients, "
                   "layer inputs) lets it fit, so it is simulated")
    k = row["kareus"]
    for key, what in (("time_saving_pct", "time"), ("energy_saving_pct", "energy")):
        if k[key] < -TIE_PCT:
            out.append(f"opposite direction: Kareus' fastest plan takes more {what} than Megatron ({k[key]:+.1f}%, "
                       f"simulated); published: never worse")
    for key, who, sim in (("np_time_saving_pct", "N+P's", row["np"]["time_saving_pct"]),
                          ("kareus_time_saving_pct", "Kareus'", k["time_saving_pct"])):
        line = against_published(f"{who} time saving against Megatron", sim, pub[key]) if key in pub else None
        out += [line] if line else []
    for who, label in (("mp", "M+P"), ("np", "N+P")):
        if k[f"shortfall_vs_{who}_pct"] > TIE_PCT:
            out.append(f"opposite direction: at some {label} point's time Kareus' "
                       f"least-energy plan uses {k[f'shortfall_vs_{who}_pct']:.1f}% more energy (simulated); "
                       f"published: never worse")
    return out


def ablation_rows(full: Outcome, base: Config, extra: Sequence[str], tmp: Path) -> dict[str, Any]:
    """Each Table 8 bundle against full Kareus: at equal time (the least energy of each within the full
    run's fastest time, or within the variant's own fastest time where it is slower: the nearest time
    both meet) and at each one's own max-throughput point."""
    ours = points_of(full.comp.frontier)
    t_full, e_full = fastest(ours)
    rows = {}
    for name, overrides, published, budgeted in ABLATIONS:
        out = run_pipeline(composed([*base.overrides(), *overrides, "plan.compare_perseus=false",
                                     *(extra if budgeted else [])]), tmp / f"ablation_{len(rows)}")
        pts = points_of(out.comp.frontier)
        t_own, e_own = fastest(pts)
        t_eq = max(t_full, t_own)
        e_var, e_ref = least_energy_within(pts, t_eq), least_energy_within(ours, t_eq)
        pub = PUBLISHED["ablations"][published]
        row = {"overrides": overrides,
               "equal_time": {"time_s": t_eq, "time_pct": 100 * (t_eq / t_full - 1),
                              "energy_pct": 100 * (e_var / e_ref - 1), "met_full_time": within_limit(t_own, t_full)},
               "max_throughput": {"time_pct": 100 * (t_own / t_full - 1), "energy_pct": 100 * (e_own / e_full - 1)},
               "profiled": sum(len(r.measurements) for r in out.results), "space": sum(out.sizes.values()),
               "published": pub, "simulated": True}
        # where the variant meets the full run's time, that time is held, not compared with the published delta
        checks = [("equal_time", "energy_pct")] + ([] if row["equal_time"]["met_full_time"] else
                                                   [("equal_time", "time_pct")])
        checks += [("max_throughput", "time_pct"), ("max_throughput", "energy_pct")]
        lines = [against_published(f"{w.replace('_', ' ')} {k[:-4]}", row[w][k], pub[k]) for w, k in checks]
        row["disagreements"] = [line for line in lines if line]
        rows[name] = row
    return {"config": base.name, "full": point(t_full, e_full), "variants": rows, "simulated": True}


def seventy_b_rows(extra: Sequence[str], microbatches: Sequence[int], tmp: Path) -> tuple[list[dict], dict]:
    """llama3.3-70b pp10_tp8 searched once, composed per microbatch count at global batch 2048."""
    cfg = composed(["+model=llama3.3-70b", "parallel=pp10_tp8", *extra])
    problem = memory_problem_of(cfg)
    if problem:
        return [{"microbatches": n, "oom": True, "oom_reason": problem} for n in microbatches], {}
    out = run_pipeline(cfg, tmp / "llama3.3-70b")
    lay = out.ctx.parallel
    mbs, per_pipeline = int(lay.micro_batch_size), lay.tp * lay.pp * lay.cp
    rows = []
    pub = PUBLISHED["seventy_b"]
    for n in microbatches:
        dp = max(1, GLOBAL_BATCH_70B // (mbs * n))
        t0 = time.perf_counter()
        comp = out.comp if (n, dp) == (lay.num_microbatches, lay.dp) else recomposed(out, num_microbatches=n, dp=dp)
        row = {"microbatches": n, "micro_batch_size": mbs, "dp": dp, "gpus": per_pipeline * dp, "oom": False,
               **compared(comp), "compose_s": time.perf_counter() - t0, "simulated": True}
        k = row["kareus"]
        lines = [against_published(key.replace("_", " "), k[key], pub[p][0])
                 for key, p in (("time_saving_pct", "time_saving_pct"), ("energy_saving_pct", "energy_saving_pct"),
                                ("energy_saving_equal_time_max_pct", "energy_saving_vs_mp_equal_time_pct"),
                                ("time_saving_equal_energy_max_pct", "time_saving_vs_mp_equal_energy_pct"))]
        row["disagreements"] = [line for line in lines if line]
        rows.append(row)
    return rows, search_cost(out)


# --- sensitivity to the assumed parameters -----------------------------------------------------------

SENSITIVITY_GPU = "a100_sim"
FIDELITY_SCORES = ("time_median_ape", "energy_median_ape", "time_spearman", "energy_spearman")
PERCENTILES = (10, 50, 90)
MAX_REDRAWS = 50
SENSITIVITY_METHOD = ("each draw: every parameter conf/hardware/a100_sim.yaml labels assumed (and "
                      "kareus/hardware/assumed.py gives a range) drawn uniformly within it; the 7 fitted ones "
                      "refitted on the two fit windows of the real A100 table from those priors (sim_fidelity.refit; "
                      "host_gap_s, the recorded harness's idle, stays 0 in the run); then the mission configuration, "
                      "its Table 8 variants and the held-out fidelity scores. Bands: 10th, 50th and 90th percentiles "
                      "over draws, interpolated between them")


def drawn_assumed(draw: int) -> dict[str, Any]:
    """The assumed parameters of sensitivity draw ``draw`` (the same on every machine), drawn again
    while the config breaks a validation rule."""
    import sim_fidelity

    from kareus.hardware import assumed

    shipped = sim_fidelity.base_config()
    keys = set(assumed.labelled(SENSITIVITY_GPU)) & set(assumed.RANGES)
    rng = random.Random(f"sensitivity|{draw}")
    for _ in range(MAX_REDRAWS):
        values = assumed.draw(dataclasses.asdict(shipped), keys, rng)
        drawn = {k: values[k] for k in sorted(keys)}
        if not dataclasses.replace(shipped, **drawn).problems():
            return drawn
    raise RuntimeError(f"sensitivity draw {draw}: no valid config in {MAX_REDRAWS} draws")


def refitted(values: Mapping[str, Any], fit_rows: list[dict], test: dict) -> dict[str, Any]:
    """The 7 parameters refitted from the priors ``values``: ``fitted`` (what a run carries), ``harness``
    (the recorded harness's host_gap_s, which runs leave at 0), ``at_bound`` (those the fit pushed to a
    bound of sim_fidelity.FIT), the fit's rms log error, and the held-out fidelity scores (``scores``) of
    the model and the ideal-overlap baseline."""
    import sim_fidelity

    got = sim_fidelity.refit(dataclasses.replace(sim_fidelity.base_config(), **values), fit_rows, test)
    every = {k: float(getattr(got["model"], k)) for k in sim_fidelity.FIT}
    scores = {f"fidelity.{k}": got["scores"][k] for k in FIDELITY_SCORES}
    scores.update({f"fidelity_baseline.{k}": got["baseline_scores"][k] for k in FIDELITY_SCORES})
    return {"fitted": {k: v for k, v in every.items() if k not in sim_fidelity.HARNESS_FITTED},
            "harness": {k: every[k] for k in sim_fidelity.HARNESS_FITTED},
            "at_bound": sorted(k for k, v in every.items() if at_bound(v, *sim_fidelity.FIT[k][1:])),
            "rms": got["rms"], "scores": scores}


def at_bound(value: float, low: float, high: float, rel: float = 1e-3) -> bool:
    """Whether a fitted value sits at (within ``rel`` of the span of) a bound of its fit."""
    return min(value - low, high - value) <= rel * (high - low)


def hardware_overrides(values: Mapping[str, Any]) -> list[str]:
    """``hardware.key=value`` overrides (a float's repr keeps every digit)."""
    return [f"hardware.{k}={v!r}" for k, v in sorted(values.items())]


def headline(against: Mapping[str, Any], ablations: Mapping[str, Any]) -> dict[str, float | None]:
    """The numbers the sensitivity reports, flat: Kareus against M+P and Megatron, then Table 8's deltas."""
    k = against["kareus"]
    out = {f"vs_mp.{key}": k[key] for key in ("energy_saving_at_megatron_time_pct",
                                               "energy_saving_equal_time_max_pct")}
    out.update({f"vs_megatron.{key}": k[key] for key in ("time_saving_pct", "energy_saving_pct")})
    for name, v in ablations["variants"].items():
        for where in ("equal_time", "max_throughput"):
            for key in ("time_pct", "energy_pct"):
                out[f"table8.{name}.{where}.{key}"] = v[where][key]
    return out


def evaluate(hardware: Sequence[str], extra: Sequence[str], tmp: Path) -> dict[str, float | None]:
    """The mission configuration (Megatron, M+P, Kareus) and its Table 8 variants on one hardware draw."""
    base = dataclasses.replace(next(c for c in CONFIGS if c.name == ABLATION_CONFIG), hardware=tuple(hardware))
    full = run_pipeline(composed([*base.overrides(), *extra]), tmp / "full")
    return headline(compared(full.comp), ablation_rows(full, base, extra, tmp))


def band(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Median and 10-90% band of one number over draws (a draw without it, None, is counted apart)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"p10": None, "median": None, "p90": None, "draws": 0}
    p10, median, p90 = (float(x) for x in np.percentile(got, PERCENTILES))
    return {"p10": p10, "median": median, "p90": p90, "draws": len(got)}


def sensitivity(n: int, extra: Sequence[str], tmp: Path, src: Path | None = None) -> dict[str, Any]:
    """The shipped config, then ``n`` draws of the assumed parameters (fitted ones refitted each time):
    per headline number its shipped value and its band over draws."""
    import sim_fidelity

    from kareus.hardware import assumed

    t0 = time.perf_counter()
    _, fit_rows, test = sim_fidelity.split(src or ROOT.parent / "shared/data/a100_attention_tp2")
    shipped_fit = refitted({}, fit_rows, test)
    shipped = {**evaluate([], extra, tmp / "shipped"), **shipped_fit["scores"]}
    print(f"sensitivity: shipped config done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    draws = []
    for i in range(n):
        values = drawn_assumed(i)
        fit = refitted(values, fit_rows, test)
        numbers = {**evaluate(hardware_overrides({**values, **fit["fitted"]}), extra, tmp / f"draw_{i}"),
                   **fit["scores"]}
        draws.append({"draw": i, "assumed": values, **{k: v for k, v in fit.items() if k != "scores"},
                      "values": numbers})
        print(f"sensitivity: draw {i + 1}/{n} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    bands = {key: {"shipped": value, **band([d["values"][key] for d in draws])} for key, value in shipped.items()}
    keys = sorted(set(assumed.labelled(SENSITIVITY_GPU)) & set(assumed.RANGES))
    return {"description": "the simulated claims under draws of the simulator's assumed parameters (all numbers "
                           "simulated; fidelity: against the real A100 table's held-out rows)",
            "config": ABLATION_CONFIG, "draws": n, "search_overrides": list(extra), "method": SENSITIVITY_METHOD,
            "ranges": {k: {"low": r.low, "high": r.high, "relative": r.relative, "source": r.source}
                       for k, r in assumed.RANGES.items() if k in keys},
            "headline": bands, "fit": fit_spread(shipped_fit, draws), "drivers": drivers(draws, MISSION_SAVING),
            "per_draw": draws, "simulated": True, "wall_s": time.perf_counter() - t0}


MISSION_SAVING = "vs_mp.energy_saving_at_megatron_time_pct"
DRIVERS = 5


def drivers(draws: Sequence[Mapping[str, Any]], key: str, top: int = DRIVERS) -> dict[str, Any]:
    """The drawn or refitted parameters whose rank follows ``key``'s most over draws (Spearman rho):
    where the band comes from. A hint, not a decomposition: 20 draws leave |rho| < 0.45 within noise."""
    from scipy.stats import spearmanr

    got = [d for d in draws if d["values"].get(key) is not None]
    if len(got) < 3:
        return {"number": key, "rho": {}}
    y = [d["values"][key] for d in got]
    rho = {}
    for group in ("assumed", "fitted"):
        for name in got[0][group]:
            x = [d[group][name] for d in got]
            if len(set(x)) > 1:
                rho[name] = float(spearmanr(x, y)[0])
    best = sorted(rho, key=lambda k: -abs(rho[k]))[:top]
    return {"number": key, "draws": len(got), "rho": {k: rho[k] for k in best}}


def fit_spread(shipped: Mapping[str, Any], draws: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    """Each refitted parameter's shipped-prior fit and band over draws, and how many draws pushed it to a
    bound of its fit (a parameter the two fit windows do not pin down once the priors move)."""
    out = {}
    for group in ("fitted", "harness"):
        for key, value in shipped[group].items():
            out[key] = {"shipped_priors": value, "shipped_at_bound": key in shipped["at_bound"],
                        **band([d[group][key] for d in draws]), "at_bound": sum(key in d["at_bound"] for d in draws)}
    return out


def write_sensitivity(out: Path, result: dict[str, Any]) -> None:
    """Set ``sensitivity`` in the benchmark's JSON, every other key as it was."""
    doc = previous(out) or {"description": __doc__.split("\n")[0], "hardware": "simulated A100-SXM4-40GB",
                            "simulated": True}
    doc["sensitivity"] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")


def previous(out: Path) -> dict[str, Any]:
    """The JSON an earlier run wrote ({} where none, or unreadable)."""
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return {}


# --- printing ----------------------------------------------------------------------------------------

def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1f}%"


def print_configs(rows: Sequence[dict]) -> None:
    """The end-to-end tables: max-throughput points, then Kareus against M+P and the search cost."""
    print_max_throughput(rows)
    ran = [r for r in rows if not r["oom"]]
    if ran:
        print_against_mp(ran)


def print_max_throughput(rows: Sequence[dict]) -> None:
    print("\nEnd to end, max-throughput points against Megatron (simulated A100; savings: positive = less; GB >=: "
          "the memory model's least need on the fullest GPU, of 40 GB)")
    print(f"{'config':<30}{'GB >=':>6}{'Megatron s':>11}{'Megatron J':>12}{'M+P time':>10}{'M+P energy':>11}"
          f"{'N+P time':>10}{'N+P energy':>11}{'K time':>9}{'K energy':>10}  published")
    for r in rows:
        head = f"{r['name']:<30}{r['memory_gb_least']:>6.1f}"
        if r["oom"]:
            print(f"{head}{'OOM (memory model)':>44}  " + ("OOM" if r["published"]["oom"] else "ran"))
            continue
        m, mp, np_, k, pub = r["megatron"], r["mp"], r["np"], r["kareus"], r["published"]
        note = "OOM" if pub["oom"] else ""
        if "kareus_time_saving_pct" in pub:
            note = f"N+P time {pct(pub['np_time_saving_pct'])}, K time {pct(pub['kareus_time_saving_pct'])}"
        print(f"{head}{m['time_s']:>11.3f}{m['energy_j']:>12.0f}{pct(mp['time_saving_pct']):>10}"
              f"{pct(mp['energy_saving_pct']):>11}{pct(np_['time_saving_pct']):>10}{pct(np_['energy_saving_pct']):>11}"
              f"{pct(k['time_saving_pct']):>9}{pct(k['energy_saving_pct']):>10}  {note}")
    ran = [r for r in rows if not r["oom"]]
    if ran:
        p = PUBLISHED["max_throughput_vs_megatron"]
        print(f"{'most over configs':<30}{'':>71}{pct(most(ran, 'time_saving_pct')):>9}"
              f"{pct(most(ran, 'energy_saving_pct')):>10}  "
              f"published up to {pct(p['time_saving_pct_up_to'])}, {pct(p['energy_saving_pct_up_to'])}")


def most(rows: Sequence[dict], key: str) -> float | None:
    """The largest of Kareus' ``key`` over configurations (None where none has it)."""
    return max((r["kareus"][key] for r in rows if r["kareus"][key] is not None), default=None)


def print_against_mp(ran: Sequence[dict]) -> None:
    print(f"\nKareus against M+P (simulated): energy saved at equal time, time saved at equal energy "
          f"(at Megatron's time; most over M+P's frontier thinned to {MP_POINTS} points); short: the most extra "
          f"energy Kareus needs at an M+P or N+P point's time (0.0%: never worse)")
    print(f"{'config':<30}{'E @Megatron t':>14}{'E most':>9}{'T @M+P energy':>15}{'T most':>9}{'short M+P':>10}"
          f"{'short N+P':>10}{'profiled':>10}{'space':>7}{'GPU-h':>8}{'exh. GPU-h':>11}")
    for r in ran:
        k, c = r["kareus"], r["search_cost"]
        print(f"{r['name']:<30}{pct(k['energy_saving_at_megatron_time_pct']):>14}"
              f"{pct(k['energy_saving_equal_time_max_pct']):>9}{pct(k['time_saving_at_mp_energy_pct']):>15}"
              f"{pct(k['time_saving_equal_energy_max_pct']):>9}{k['shortfall_vs_mp_pct']:>9.1f}%"
              f"{k['shortfall_vs_np_pct']:>9.1f}%{c['profiled']:>10}{c['space']:>7}{c['search_gpu_hours']:>8.2f}"
              f"{c['exhaustive_gpu_hours_estimate']:>11.2f}")
    p, c = PUBLISHED["vs_mp"], PUBLISHED["search_cost"]
    print(f"{'most over configs':<30}{'':>14}{pct(most(ran, 'energy_saving_equal_time_max_pct')):>9}{'':>15}"
          f"{pct(most(ran, 'time_saving_equal_energy_max_pct')):>9}  published up to "
          f"{pct(p['energy_saving_equal_time_pct_up_to'])}, {pct(p['time_saving_equal_energy_pct_up_to'])}")
    hours = [r["search_cost"]["search_gpu_hours"] for r in ran]
    exh = [r["search_cost"]["exhaustive_gpu_hours_estimate"] for r in ran]
    print(f"search cost: {min(hours):.2f}-{max(hours):.2f} simulated GPU-hours per configuration against "
          f"{min(exh):.1f}-{max(exh):.1f} for its whole partition space (estimated); published (real A100s): "
          f"MBO {c['mbo_gpu_hours']} GPU-hours, exhaustive about {c['exhaustive_gpu_hours']:,} over about "
          f"{c['candidates']:,} candidates")


def print_ablations(ab: dict) -> None:
    if not ab:
        return
    print(f"\nTable 8 ablations on {ab['config']}, against full Kareus (simulated; + = worse than full). Equal "
          f"time: both at the full run's fastest time, or at the variant's own where it is slower (its time column)")
    print(f"{'variant':<33}{'= time: time':>13}{'energy':>9}{'own fastest: time':>19}{'energy':>9}"
          f"{'published time':>16}{'energy':>9}{'profiled':>10}{'space':>7}")
    for name, r in ab["variants"].items():
        e, m, p = r["equal_time"], r["max_throughput"], r["published"]
        print(f"{name:<33}{pct(e['time_pct']):>13}{pct(e['energy_pct']):>9}{pct(m['time_pct']):>19}"
              f"{pct(m['energy_pct']):>9}{pct(p['time_pct']):>16}{pct(p['energy_pct']):>9}{r['profiled']:>10}"
              f"{r['space']:>7}")


def print_seventy_b(rows: Sequence[dict], cost: dict) -> None:
    if not rows:
        return
    p = PUBLISHED["seventy_b"]
    print("\nllama3.3-70b pp10_tp8, global batch 2048, searched once, composed per microbatch count "
          "(simulated A100; published emulated)")
    print(f"{'microbatches':>12}{'dp':>4}{'Megatron s':>12}{'K time':>14}{'K energy':>15}{'E @Megatron t':>15}"
          f"{'E most':>15}{'T @M+P energy':>15}{'T most':>15}")
    for r in rows:
        if r.get("oom"):
            print(f"{r['microbatches']:>12}  OOM (memory model)")
            continue
        k = r["kareus"]
        print(f"{r['microbatches']:>12}{r['dp']:>4}{r['megatron']['time_s']:>12.2f}{pct(k['time_saving_pct']):>14}"
              f"{pct(k['energy_saving_pct']):>15}{pct(k['energy_saving_at_megatron_time_pct']):>15}"
              f"{pct(k['energy_saving_equal_time_max_pct']):>15}{pct(k['time_saving_at_mp_energy_pct']):>15}"
              f"{pct(k['time_saving_equal_energy_max_pct']):>15}")
    rng = lambda v: f"{v[0]:+.1f}..{v[1]:+.1f}%"  # noqa: E731
    print(f"{'published':>12}{'':>16}{rng(p['time_saving_pct']):>14}{rng(p['energy_saving_pct']):>15}{'':>15}"
          f"{rng(p['energy_saving_vs_mp_equal_time_pct']):>15}{'':>15}"
          f"{rng(p['time_saving_vs_mp_equal_energy_pct']):>15}")
    if cost:
        print(f"search: {cost['profiled']} of {cost['space']} candidates, {cost['search_gpu_hours']:.2f} simulated "
              f"GPU-hours (exhaustive about {cost['exhaustive_gpu_hours_estimate']:.1f})")


def published_of(key: str) -> float | None:
    """The published value a sensitivity number compares with (the "up to" over configurations for the
    end-to-end ones), or None."""
    ends = {"vs_mp.energy_saving_at_megatron_time_pct": PUBLISHED["vs_mp"]["energy_saving_equal_time_pct_up_to"],
            "vs_mp.energy_saving_equal_time_max_pct": PUBLISHED["vs_mp"]["energy_saving_equal_time_pct_up_to"],
            "vs_megatron.time_saving_pct": PUBLISHED["max_throughput_vs_megatron"]["time_saving_pct_up_to"],
            "vs_megatron.energy_saving_pct": PUBLISHED["max_throughput_vs_megatron"]["energy_saving_pct_up_to"]}
    if key in ends:
        return ends[key]
    if key.startswith("table8."):
        name, _where, what = key[len("table8."):].rsplit(".", 2)
        return PUBLISHED["ablations"][next(pub for n, _o, pub, _b in ABLATIONS if n == name)][what]
    return None


def print_fit_spread(result: dict) -> None:
    print(f"\nthe 7 parameters refitted per draw (sim_fidelity.refit; host_gap_s is the recorded harness's, 0 in "
          f"runs): fit from the shipped priors, median and 10-90% over draws, draws at a bound of the fit")
    for key, b in result["fit"].items():
        mark = " (at a bound)" if b["shipped_at_bound"] else ""
        print(f"  {key:<16}{b['shipped_priors']:>11.4g}{mark:<13}{b['median']:>11.4g}  {b['p10']:.4g}..{b['p90']:.4g}"
              f"  at a bound: {b['at_bound']} of {b['draws']}")


def print_drivers(result: dict) -> None:
    d = result["drivers"]
    if d["rho"]:
        print(f"\n{d['number']} follows, over {d['draws']} draws (Spearman rho): " +
              ", ".join(f"{k} {v:+.2f}" for k, v in d["rho"].items()))


def print_sensitivity(result: dict) -> None:
    print(f"\nSensitivity on {result['config']} (simulated A100): {result['draws']} draws of the assumed simulator "
          f"parameters, the fitted ones refitted each time; per cent, fidelity as fractions (held-out real rows)")
    w = max(map(len, result["headline"])) + 2
    print(f"{'number':<{w}}{'shipped':>9}{'median':>9}{'10%':>9}{'90%':>9}{'published':>11}")
    for key, b in result["headline"].items():
        fmt = (lambda v: "n/a" if v is None else f"{v:.3f}") if key.startswith("fidelity") else pct
        pub = published_of(key)
        print(f"{key:<{w}}{fmt(b['shipped']):>9}{fmt(b['median']):>9}{fmt(b['p10']):>9}{fmt(b['p90']):>9}"
              f"{'' if pub is None else pct(pub):>11}")


def print_disagreements(doc: dict) -> None:
    lines = [f"{r['name']}: {d}" for r in doc["configs"] for d in r.get("disagreements", [])]
    lines += [f"ablation {n}: {d}" for n, r in doc["ablations"].get("variants", {}).items() for d in r["disagreements"]]
    lines += [f"70B {r['microbatches']} microbatches: {d}"
              for r in doc["seventy_b"] for d in r.get("disagreements", [])]
    print("\nWhere simulated and published point different ways:" if lines else "\nSimulated and published agree "
          "in direction everywhere they can be compared.")
    for line in lines:
        print(f"  - {line}")


# --- main --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 configurations; 70B at 16 and 64 microbatches")
    ap.add_argument("--smoke", action="store_true", help="one configuration, tiny budgets (for the tests)")
    ap.add_argument("--sensitivity", type=int, default=0, metavar="N",
                    help="alone: N draws of the assumed simulator parameters on the mission configuration and "
                         "Table 8 (with --smoke: tiny budgets); writes the JSON's sensitivity key")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "paper.json"))
    args = ap.parse_args(argv)
    if args.sensitivity < 0:
        ap.error("--sensitivity takes a number of draws >= 1")
    if args.sensitivity:
        return main_sensitivity(args.sensitivity, ["search.budget=8"] if args.smoke else [], Path(args.out))
    t0 = time.perf_counter()
    configs, extra, microbatches = list(CONFIGS), [], SEVENTY_B_MICROBATCHES
    if args.quick or args.smoke:
        configs = [c for c in CONFIGS if c.name in (QUICK[:1] if args.smoke else QUICK)]
        microbatches = (16, 64) if args.quick else (16,)
    if args.smoke:
        extra = ["search.budget=8"]
    doc: dict[str, Any] = {"description": __doc__.split("\n")[0], "hardware": "simulated A100-SXM4-40GB",
                           "simulated": True, "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
                           "search_overrides": extra, "method": METHOD, "published": PUBLISHED,
                           **run_all(configs, extra, microbatches, t0), "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    if "sensitivity" in previous(out):  # written by --sensitivity, which this run does not redo
        doc["sensitivity"] = previous(out)["sensitivity"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_configs(doc["configs"])
    print_ablations(doc["ablations"])
    print_seventy_b(doc["seventy_b"], doc["seventy_b_search_cost"])
    print_disagreements(doc)
    print(f"\nwrote {out} ({doc['wall_s']:.0f} s)")
    return doc


def main_sensitivity(n: int, extra: Sequence[str], out: Path) -> dict:
    """``--sensitivity N``: the study alone, its result set into the JSON beside the rest."""
    with tempfile.TemporaryDirectory() as tmp:
        result = sensitivity(n, extra, Path(tmp))
    write_sensitivity(out, result)
    print_sensitivity(result)
    print_fit_spread(result)
    print_drivers(result)
    print(f"\nwrote {out} (sensitivity; {result['wall_s']:.0f} s)")
    return result


def run_all(configs: Sequence[Config], extra: Sequence[str], microbatches: Sequence[int], t0: float) -> dict:
    """The three parts; Table 8's full run is its end-to-end configuration's (run for it if not listed)."""
    base = next(c for c in CONFIGS if c.name == ABLATION_CONFIG)
    rows, full_base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for c in configs:
            row, out = config_row(c, extra, Path(tmp))
            rows.append(row)
            full_base = out if c == base else full_base
            print(f"{c.name}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if full_base is None:
            _, full_base = config_row(base, extra, Path(tmp))
        ablations = ablation_rows(full_base, base, extra, Path(tmp))
        print(f"ablations: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        seventy, cost = seventy_b_rows(extra, microbatches, Path(tmp))
    return {"configs": rows, "ablations": ablations, "seventy_b": seventy, "seventy_b_search_cost": cost}


if __name__ == "__main__":
    main()
