"""Search efficiency: hypervolume of each searcher's measured frontier / the exhaustive frontier's.

Problems: every partition type of qwen1.7b pp2_tp8 and llama3.2-3b pp2_cp2_tp4 on the simulated A100
(numbers are simulated), and every partition of the real A100 attention table through the replay
backend. Every searcher gets the same budget and the same initial design for a seed. Two protocols,
both run by default (``--lookup`` or ``--noisy`` runs one):

- ``lookup`` (``summary`` and the other top-level keys): each space is measured once (a simulated
  partition by Kareus' profiler with its default protocol, on a GPU of its own; the recorded table as
  the median of its repeats) and every searcher evaluates from that lookup, so measuring a setting
  again returns the same number, and the front is scored at the numbers the searcher saw.
- ``noisy`` (the ``noisy`` section): every measurement is a fresh reading, as real profiling gives.
  A simulated partition is read by the profiler's default protocol on a GPU of the search's own with
  its reading noise on (each reading a new window and noise draw); the recorded table serves each
  setting's repeats in turn, cycling, from a start drawn per seed and setting. Each reading counts
  against the budget, a re-measurement of a setting too. The front a searcher reports (its measured
  Pareto front, from its own readings: what it hands the composer) is scored at each setting's
  noise-free truth: the simulated GPU's reading with reading noise off (the profiler's default
  protocol on a GPU of its own), the recorded table's medians. Beside it, ``exhaustive_one_reading``:
  an exhaustive search that reads every setting once and keeps the front of those readings.

Objectives are normalised so the exhaustive (true) Pareto front spans [0, 1] in time and total energy
(ideal: best time and energy; nadir: the front's worst), reference point (1.1, 1.1); an objective the
front spans by a rounding error alone (a host-bound partition whose settings all take the same time)
is scaled by its magnitude instead, or the score would hang on which setting rounding made fastest. Beside the
hypervolume ratio: its standard error over seeds, IGD+ in the same frame, the share of true Pareto
points measured, the same ratio for the (time, dynamic energy) front (the one the microbatch composer
combines), and (lookup) per partition and clock how far the lowest-energy setting leads the next (with
the repeat spread, on the recorded table): the corners where a near-tie decides the score. On the
recorded table, also the ratio an exhaustive search keeps when it picks its front from one repeat per
setting (how much of the front one reading tells apart). Per budget, the ceiling of a searcher whose model were
a second reading of every setting (another noise seed; one repeat on the recorded table) and which
measures the budget's worth nearest that model's front (``model_ceiling``): what a better surrogate
could still gain.
summary[searcher][budget_frac] averages each workload over its partitions and seeds, then the
workloads with equal weight: the two simulated ones and the recorded table, a third each.

``--holdout`` replaces those workloads with the report seeds of the held-out family of
``benchmarks/heldout.py`` (random model shapes and layouts on the three simulated GPUs, the simulator's
assumed parameters drawn, ~1% reading noise; small subsampled spaces), which MBO's defaults were never
chosen on; ``--holdout tuning`` runs its tuning seeds instead. ``--workload`` runs shipped
model/layout/GPU configs in place of the two simulated workloads (the workload the former
``--holdout`` ran: ``--workload llama3.3-70b:pp10_tp8:h100_sim --no-replay``).

    python benchmarks/search_efficiency.py                 # all searchers but qnehvi, 5 seeds, lookup and noisy
    python benchmarks/search_efficiency.py --lookup        # the lookup protocol alone (--noisy: the noisy one alone)
    python benchmarks/search_efficiency.py --qnehvi        # + BoTorch qLogNEHVI, 1 seed (slow on 700-candidate spaces)
    python benchmarks/search_efficiency.py --quick         # 2 seeds, for a smoke run
    python benchmarks/search_efficiency.py --holdout       # the held-out family's first 6 report seeds (--quick: 2)
    python benchmarks/search_efficiency.py --holdout tuning --noisy --mbo-variant mbo-posterior:report=posterior
        # MBO with search.report=posterior beside the searchers (any search.* override; repeatable)
    python benchmarks/search_efficiency.py --no-sim --searchers mbo --qnehvi --qnehvi-seeds 5 --lookup \
        --out runs/bench/search_efficiency_qnehvi.json    # qnehvi on the real table, 5 seeds (~5 min)
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # heldout.py, when imported from elsewhere

from kareus.frontier import pareto_mask  # noqa: E402
from kareus.profiler import Profiler, ProfilerConfig  # noqa: E402
from kareus.search.base import Evaluate, SearchProblem  # noqa: E402
from kareus.search.config import SearcherConfig, initial_size  # noqa: E402
from kareus.search.design import latin_hypercube  # noqa: E402
from kareus.search.hv import hvi, hypervolume, igd_plus, nondominated, normalise  # noqa: E402
from kareus.types import Candidate, Measurement, ModelSpec, ParallelSpec, PartitionType  # noqa: E402

BUDGETS = (0.1, 0.15, 0.25, 0.4)
PEERS = ("random", "nsga2", "tpe", "artifact", "mbo")
REF = (1.1, 1.1)
REPLAY_SRC = ROOT.parent / "shared" / "data" / "a100_attention_tp2"

# the summary's simulated workloads: (model, parallel) from the shipped configs, on the A100; the
# recorded table (replay) is the third, with the same weight
WORKLOADS = (("qwen1.7b", "pp2_tp8"), ("llama3.2-3b", "pp2_cp2_tp4"))


@dataclass
class Truth:
    """One partition's whole space, measured once: the lookup every searcher evaluates from."""

    workload: str
    partition: PartitionType
    space: list[Candidate]
    table: dict[Candidate, tuple[float, float, float]]  # time_s, energy_j, dynamic_energy_j
    static_power_w: float
    repeats: dict[Candidate, list[tuple[float, float]]] | None = None  # (time_s, energy_j) of each repeat (recorded tables)
    readings: "SimReadings | ReplayReadings | None" = None  # fresh readings of the noisy protocol

    def evaluate(self, batch, annotations=None) -> list[Measurement]:
        out = []
        for c in batch:
            t, e, d = self.table[c]
            out.append(Measurement(c, t, e, d, self.static_power_w, 0.0, float(c.freq_mhz), 1))
        return out

    def frame(self, objective: str = "total"):
        """(ideal, nadir, front) of the whole space in (time, ``objective``): total or dynamic energy."""
        col = {"total": 1, "dynamic": 2}[objective]
        pts = np.array([(self.table[c][0], self.table[c][col]) for c in self.space])
        front = nondominated(pts)
        return front.min(axis=0), front.max(axis=0), front


class FreshProfiler(Profiler):
    """Kareus' profiler with its default protocol, but every measurement a new reading: it would
    answer a setting measured before from memory, and real profiling of it again reads another number."""

    def __init__(self, backend) -> None:
        super().__init__(ProfilerConfig(), backend)

    def _cached(self, cand: Candidate, reading: int = 0) -> None:
        return None


@dataclass
class SimReadings:
    """The noisy protocol on a simulated partition: a GPU of the search's own, reading noise on."""

    hardware: dict  # the sim config, reading noise on
    partition: PartitionType

    def reader(self, seed: int) -> Evaluate:
        import kareus.hardware  # noqa: F401  (registers backends)
        from kareus.registry import HARDWARE

        profiler = FreshProfiler(HARDWARE.build("sim", config=self.hardware, seed=seed))
        return lambda batch, annotations=None: [profiler.measure(self.partition, c) for c in batch]


@dataclass
class ReplayReadings:
    """The noisy protocol on a recorded table: each setting's repeats in turn, cycling, from a start
    drawn per seed and setting (so the k-th reading of a setting is the same for every searcher)."""

    repeats: dict[Candidate, list[tuple[float, float]]]
    static_power_w: float

    def reader(self, seed: int) -> Evaluate:
        import random

        served: dict[Candidate, int] = {}

        def evaluate(batch, annotations=None) -> list[Measurement]:
            out = []
            for c in batch:
                reps = self.repeats[c]
                k = served.get(c, random.Random(f"{seed}|{c}").randrange(len(reps)))
                served[c] = k + 1
                t, e = reps[k % len(reps)]
                out.append(Measurement(c, t, e, e - self.static_power_w * t, self.static_power_w, 0.0,
                                       float(c.freq_mhz), 1))
            return out

        return evaluate


class Counted:
    """A searcher's evaluate that charges every reading, a repeat of a setting too, to its budget."""

    def __init__(self, evaluate: Evaluate, budget: int) -> None:
        self.evaluate, self.budget, self.readings = evaluate, budget, 0

    def __call__(self, batch, annotations=None) -> list[Measurement]:
        self.readings += len(batch)
        if self.readings > self.budget:
            raise RuntimeError(f"{self.readings} readings on a budget of {self.budget}")
        return self.evaluate(batch, annotations)


def conf_workload(model: str, parallel: str) -> tuple[ModelSpec, ParallelSpec]:
    """A model and a parallel layout from the shipped configs (``kareus/conf/model``, ``.../parallel``)."""
    from omegaconf import OmegaConf

    from kareus.config.schema import ModelConfig, ParallelConfig

    m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "kareus" / "conf" / "model" / f"{model}.yaml"))
    p = OmegaConf.merge(OmegaConf.structured(ParallelConfig),
                        OmegaConf.load(ROOT / "kareus" / "conf" / "parallel" / f"{parallel}.yaml"))
    return OmegaConf.to_object(m).spec(), OmegaConf.to_object(p).spec()


def sim_truths(seed: int = 0, hardware: str | dict = "a100_sim", workloads=None, space_cfg=None,
               keys: tuple[str, ...] | None = None, noise: bool = True, space=None) -> list[Truth]:
    """Every partition type of ``workloads`` ((label, model, parallel) triples; default: the two of the
    summary), or those named in ``keys``, measured over its whole space (``space(partition, gpu)``, else
    ``space_cfg``; default: the searcher's default space) on the simulated ``hardware`` (a shipped
    config's name or the config itself). ``noise=False`` reads with the reading noise off: the noisy
    protocol's truth. Each truth carries the noisy protocol's readings (reading noise on)."""
    import kareus.hardware  # noqa: F401  (registers backends)
    import kareus.partition  # noqa: F401

    from kareus.registry import HARDWARE, PARTITIONERS
    from kareus.search.space import SpaceConfig, build_space
    from kareus.workload import build_workload

    hw = sim_config(hardware)
    quiet = hw if noise else {**hw, "time_noise": 0.0, "power_noise": 0.0}
    space = space or (lambda t, gpu: build_space(t, gpu, space_cfg or SpaceConfig()))
    out = []
    if workloads is None:
        workloads = [(f"{m}-{p} (simulated)", *conf_workload(m, p)) for m, p in WORKLOADS]
    for label, model, par in workloads:
        parts = PARTITIONERS.build("nanobatch", config={}).partition(build_workload(model, par))
        for t in parts.types:
            if keys is None or t.key in keys:  # a fresh GPU each: no heat or counter phase from the one before
                backend = HARDWARE.build("sim", config=quiet, seed=seed)
                truth = measure_space(label, backend, t, space(t, backend.gpu))
                truth.readings = SimReadings(hw, t)
                out.append(truth)
    return out


def sim_config(hardware: str | dict) -> dict:
    """A sim config as a plain dict: a shipped one by name (``kareus/conf/hardware``), or a copy."""
    if isinstance(hardware, dict):
        return dict(hardware)
    from heldout import shipped

    return shipped(hardware)


def heldout_truths(members: list, seed: int = 0, noise: bool = True, full: bool = False) -> list[Truth]:
    """The kept partitions of held-out workloads (``heldout.HeldOut``) over their subsampled spaces (``full``:
    the spaces a run searches), each on its own drawn simulated GPU."""
    out = []
    for w in members:
        out += sim_truths(seed, w.hardware, [(w.label, w.model, w.parallel)], keys=w.partitions, noise=noise,
                          space=w.full_space if full else w.space)
    return out


def measure_space(label: str, backend, partition: PartitionType, space: list[Candidate]) -> Truth:
    """Every candidate read as Kareus's profiler reads it (its default protocol: a fixed cooldown, a
    window of about 5 s of back-to-back executions), so the exhaustive front carries the noise of a
    real profile, not that of a shorter window."""
    from kareus.profiler import Profiler, ProfilerConfig

    table = {}
    with Profiler(ProfilerConfig(), backend) as profiler:
        for c in space:
            m = profiler.measure(partition, c)
            if m.failed:  # a NaN row would reach the searchers as a success: the truth must be whole
                raise RuntimeError(f"{label} {partition.key}: ground truth failed at {c}: {'; '.join(m.flags)}")
            table[c] = (m.time_s, m.energy_j, m.dynamic_energy_j)
    return Truth(label, partition, space, table, backend.gpu.static_power_w)


def replay_truths(tmp: Path) -> list[Truth]:
    import kareus.hardware  # noqa: F401
    from kareus.hardware.tables import convert_a100_attention
    from kareus.registry import HARDWARE

    csv = convert_a100_attention(REPLAY_SRC, tmp / "a100_attention_tp2.csv")
    backend = HARDWARE.build("replay", config={"table": str(csv)}, seed=0)
    P = backend.gpu.static_power_w
    out = []
    for t in backend.partitions():
        space = backend.space(t)
        table, repeats = {}, {}
        for c in space:
            backend.set_clock(c.freq_mhz)
            reads = [backend.measure(t, c, 1.0) for _ in range(3)]  # the table's repeats: take medians
            ti = statistics.median(r.time_s for r in reads)
            e = statistics.median(r.energy_j for r in reads)
            table[c] = (ti, e, e - P * ti)
            repeats[c] = [(r.time_s, r.energy_j) for r in reads]
        out.append(Truth("a100-attention-tp2-replay (real)", t, space, table, P, repeats, ReplayReadings(repeats, P)))
    return out


def at_truth(truth: Truth, frontier, objective: str = "total") -> np.ndarray:
    """(time, energy) of a reported front's settings: ``truth``'s numbers for each point's candidate
    (``objective``: total or dynamic energy), not the readings that put it on the front."""
    col = {"total": 1, "dynamic": 2}[objective]
    return np.array([[truth.table[p.payload.candidate][0], truth.table[p.payload.candidate][col]]
                     for p in frontier]).reshape(-1, 2)


def score(truth: Truth, result, truthful: bool = False) -> dict:
    """The (time, total energy) front's HV ratio, IGD+ and share of true Pareto points measured; beside
    them the HV ratio of the (time, dynamic energy) front, the one the microbatch composer combines.
    ``truthful`` (the noisy protocol) scores the reported fronts' settings at ``truth``'s numbers."""
    ideal, nadir, front = truth.frame()
    pts = (at_truth(truth, result.frontier) if truthful
           else np.array([[p.time_s, p.energy_j] for p in result.frontier]).reshape(-1, 2))
    nf = normalise(front, ideal, nadir)
    npts = normalise(pts, ideal, nadir)
    # front rows matched by a measured reading: two settings that read the same front point count once
    seen = np.array([truth.table[m.candidate][:2] for m in result.measurements]).reshape(-1, 2)
    found = sum(_on_front(p, seen) for p in front)
    d_ideal, d_nadir, d_front = truth.frame("dynamic")
    d_pts = (at_truth(truth, result.dynamic_frontier, "dynamic") if truthful
             else np.array([[p.time_s, p.energy_j] for p in result.dynamic_frontier]).reshape(-1, 2))
    return {"hv_ratio": hypervolume(npts, REF) / hypervolume(nf, REF), "igd_plus": igd_plus(npts, nf),
            "pareto_share": found / max(len(front), 1), "profiled": len(result.measurements),
            "hv_ratio_dynamic": hypervolume(normalise(d_pts, d_ideal, d_nadir), REF)
            / hypervolume(normalise(d_front, d_ideal, d_nadir), REF)}


def corner_noise(truth: Truth) -> list[dict]:
    """Per clock: the lowest-energy setting's lead over the next one, the hypervolume ratio an
    otherwise exhaustive search keeps when it measures the next one instead, and (recorded tables)
    how far one setting's repeats spread. A corner won by less than the repeat spread is picked by
    noise, yet the normalised hypervolume charges a miss in full."""
    ideal, nadir, front = truth.frame()
    base = hypervolume(normalise(front, ideal, nadir), REF)
    out = []
    for mhz in sorted({c.freq_mhz for c in truth.space}):
        at = sorted((c for c in truth.space if c.freq_mhz == mhz), key=lambda c: truth.table[c][1])
        if len(at) < 2:
            continue
        corner, runner_up = at[0], at[1]
        rest = np.array([truth.table[c][:2] for c in truth.space if c != corner])
        e0, e1 = truth.table[corner][1], truth.table[runner_up][1]
        row = {"freq_mhz": mhz, "corner": f"{corner.slot}/{corner.sms} SMs", "lead": (e1 - e0) / e0,
               "hv_ratio_without": hypervolume(normalise(nondominated(rest), ideal, nadir), REF) / base}
        if truth.repeats:
            energies = [[e for _t, e in truth.repeats[c]] for c in at if c in truth.repeats]
            spread = [(max(r) - min(r)) / statistics.median(r) for r in energies]
            row["repeat_spread_median"] = float(statistics.median(spread))
        out.append(row)
    return out


def kept(truth: Truth, points) -> float:
    """The hypervolume ratio of the front of ``points`` (the table's readings of some settings) to the
    whole table's, in the frame the searchers are scored in."""
    ideal, nadir, front = truth.frame()
    return (hypervolume(normalise(nondominated(points), ideal, nadir), REF)
            / hypervolume(normalise(front, ideal, nadir), REF))


def one_repeat_each(truth: Truth, rng: np.random.Generator) -> np.ndarray:
    """A recorded table's (time, energy) with one repeat per setting drawn at random, in space order."""
    reads = np.array([truth.repeats[c] for c in truth.space])  # (candidates, repeats, 2)
    return reads[np.arange(len(reads)), rng.integers(reads.shape[1], size=len(reads))]


def single_repeat_exhaustive(truth: Truth, draws: int = 200, seed: int = 0) -> dict | None:
    """Recorded tables: the hypervolume ratio an exhaustive search keeps when it picks its front from
    one repeat per setting (drawn at random) instead of the median of three, scored at the medians:
    how much of the front one reading tells apart. It measures only the front it sees; a searcher that
    measures more keeps what noise put on the table's front too, and can score above it
    (``nearest_front`` is that searcher's reference)."""
    if not truth.repeats:
        return None
    medians = np.array([truth.table[c][:2] for c in truth.space])
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(draws):
        one = one_repeat_each(truth, rng)
        ratios.append(kept(truth, medians[pareto_mask(one[:, 0], one[:, 1])]))
    return {"draws": draws, "mean": float(np.mean(ratios)), "p10": float(np.percentile(ratios, 10)),
            "min": float(np.min(ratios))}


def remeasured_exhaustive(truth: Truth, again: Truth) -> float:
    """Simulated tables: the hypervolume ratio an exhaustive search keeps when it picks its front from
    a second reading of every setting (another noise seed), scored at the table's: as
    ``single_repeat_exhaustive`` for the recorded table, not a bound on a searcher's ratio."""
    second = np.array([again.table[c][:2] for c in truth.space])
    return kept(truth, np.array([truth.table[c][:2] for c in truth.space])[pareto_mask(second[:, 0], second[:, 1])])


def nearest_front(truth: Truth, model: np.ndarray, budget: int) -> float:
    """The hypervolume ratio of a searcher whose model is ``model`` (each setting's (time, energy)
    read another time, in space order; as good a model as one more reading) and which
    measures the ``budget`` settings nearest that model's front (additive epsilon in the normalised
    frame; ties on the front by their exclusive hypervolume there), scored at the table's readings.
    Unlike the exhaustive resolutions it spends the whole budget, so it keeps the settings that
    noise put on the table's front beside the model's: what a better surrogate could still gain."""
    ideal, nadir, _front = truth.frame()
    m = normalise(model, ideal, nadir)
    mf = nondominated(m)
    eps = np.min(np.max(m[:, None, :] - mf[None, :, :], axis=2), axis=1)
    own = np.zeros(len(m))
    whole = hypervolume(mf, REF)
    for i in np.flatnonzero(eps <= 0):  # what the model front loses without the point
        own[i] = whole - hypervolume(mf[np.any(mf != m[i], axis=1)], REF)
    picked = np.lexsort((-own, eps))[:budget]
    return kept(truth, np.array([truth.table[c][:2] for c in truth.space])[picked])


def model_ceiling(truths: list[Truth], seconds: dict[tuple[str, str], Truth], budgets: tuple[float, ...],
                  draws: int = 50, seed: int = 0) -> dict[str, dict[str, float]]:
    """``nearest_front`` per workload (mean over its partitions) and budget: a simulated table's model is
    its second reading; a recorded table's one repeat per setting (mean over ``draws`` random draws)."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, list[float]]] = {}
    for t in truths:
        again = seconds.get((t.workload, t.partition.key))
        if again is not None:
            models = [np.array([again.table[c][:2] for c in t.space])]
        elif t.repeats:
            models = [one_repeat_each(t, rng) for _ in range(draws)]
        else:
            continue
        for frac in budgets:
            b = budget_of(frac, len(t.space))
            out.setdefault(t.workload, {}).setdefault(str(frac), []).append(
                float(np.mean([nearest_front(t, mdl, b) for mdl in models])))
    return {w: {f: float(np.mean(v)) for f, v in per.items()} for w, per in out.items()}


def resolution(truths: list[Truth], seconds: dict[tuple[str, str], Truth]) -> dict[str, float]:
    """Per workload, the mean of ``remeasured_exhaustive`` over its partitions (simulated ones only)."""
    out: dict[str, list[float]] = {}
    for t in truths:
        again = seconds.get((t.workload, t.partition.key))
        if again is not None:
            out.setdefault(t.workload, []).append(remeasured_exhaustive(t, again))
    return {w: float(np.mean(v)) for w, v in out.items()}


def _on_front(p, front) -> bool:
    return bool(np.any(np.all(np.isclose(front, p, rtol=0, atol=0), axis=1)))


# --mbo-variant LABEL:key=value,...: MBO with ``search.<key>`` overrides, run and reported as LABEL
VARIANTS: dict[str, dict] = {}


def searcher_config(name: str, seed: int, budget: int) -> dict:
    return {"seed": seed, "budget": budget, **VARIANTS.get(name, {})}


def searcher_name(name: str) -> str:
    """The registered searcher a label runs: ``mbo`` for an ``--mbo-variant``."""
    return "mbo" if name in VARIANTS else name


def parse_variant(spec: str) -> tuple[str, dict]:
    """``LABEL:key=value,key=value`` (values in YAML: 0.1, posterior, [0.002,0.01]) -> (label, overrides)."""
    import yaml

    label, _, rest = spec.partition(":")
    pairs = [kv.split("=", 1) for kv in rest.split(";" if "[" in rest else ",") if kv]
    return label, {k.strip(): yaml.safe_load(v) for k, v in pairs}


def budget_of(frac: float, space: int) -> int:
    return math.ceil(frac * space - 1e-9)


def problem(truth: Truth, budget: int, seed: int) -> SearchProblem:
    """The search of ``truth`` every searcher gets for a seed: same budget, same initial design."""
    init = latin_hypercube(truth.space, truth.partition, initial_size(SearcherConfig(), budget), seed)
    return SearchProblem(truth.partition, truth.space, truth.evaluate, budget, seed, truth.static_power_w, list(init))


PROTOCOLS = ("lookup", "noisy")


def for_protocol(prob: SearchProblem, truth: Truth, protocol: str) -> SearchProblem:
    """``prob`` for one searcher run: the lookup as it is; under ``noisy``, fresh readings of its own
    (a new GPU, or the recorded repeats from their start), every one charged to the budget."""
    if protocol == "lookup":
        return prob
    if truth.readings is None:
        raise ValueError(f"{truth.workload} {truth.partition.key}: no readings for the noisy protocol")
    return replace(prob, evaluate=Counted(truth.readings.reader(prob.seed), prob.budget))


def run_all(truths: list[Truth], searchers: list[str], seeds: int, budgets: tuple[float, ...],
            verbose: bool = True, jobs: int = 1, protocol: str = "lookup") -> tuple[list[dict], dict]:
    """Every searcher x budget x seed on every partition under ``protocol`` (lookup or noisy); ``jobs``
    processes split the partitions."""
    if jobs > 1 and len(truths) > 1:
        from concurrent.futures import ProcessPoolExecutor

        rows: list[dict] = []
        timing: dict[str, list[float]] = {}
        with ProcessPoolExecutor(jobs) as pool:
            futs = [pool.submit(run_all, [t], searchers, seeds, budgets, verbose, 1, protocol) for t in truths]
            for f in futs:
                r, tm = f.result()
                rows += r
                for k, v in tm.items():
                    timing.setdefault(k, []).extend(v)
        return rows, timing
    import kareus.search  # noqa: F401
    from kareus.registry import SEARCHERS

    rows = []
    timing = {}
    for truth in truths:
        n = len(truth.space)
        for frac in budgets:
            budget = budget_of(frac, n)
            for seed in range(seeds):
                prob = problem(truth, budget, seed)
                for name in searchers:
                    s = SEARCHERS.build(searcher_name(name), config=searcher_config(name, seed, budget))
                    run = for_protocol(prob, truth, protocol)
                    t0 = time.perf_counter()
                    res = s.run(run)
                    wall = time.perf_counter() - t0
                    timing.setdefault(name, []).append(wall)
                    row = {"protocol": protocol, "workload": truth.workload, "partition": truth.partition.key,
                           "space": n, "budget_frac": frac, "budget": budget, "seed": seed, "searcher": name,
                           "wall_s": wall, **score(truth, res, truthful=protocol == "noisy")}
                    if isinstance(run.evaluate, Counted):
                        row["readings"] = run.evaluate.readings
                    for tm in getattr(s, "timings", []) or []:
                        row.setdefault("batch_s", []).append(tm.get("fit_s", 0.0) + tm.get("acq_s", 0.0))
                    rows.append(row)
        if verbose:
            print(f"  {truth.workload} {truth.partition.key} ({n} candidates) done", flush=True)
    return rows, timing


def summarise(rows: list[dict], metric: str) -> dict:
    """summary[searcher][frac]: mean over partitions and seeds per workload, then over workloads
    (rows without ``metric`` are left out)."""
    out: dict = {}
    keys = {(r["searcher"], r["budget_frac"]) for r in rows}
    for name, frac in sorted(keys):
        per_w: dict[str, list[float]] = {}
        for r in rows:
            if r["searcher"] == name and r["budget_frac"] == frac and metric in r:
                per_w.setdefault(r["workload"], []).append(r[metric])
        if per_w:
            out.setdefault(name, {})[str(frac)] = float(np.mean([np.mean(v) for v in per_w.values()]))
    return out


def seed_error(rows: list[dict], metric: str) -> dict:
    """Standard error over seeds of ``summarise``: each seed's summary is one sample, so differences
    between searchers or settings smaller than about twice this are within seed noise."""
    seeds = sorted({r["seed"] for r in rows})
    per_seed = [summarise([r for r in rows if r["seed"] == s], metric) for s in seeds]
    out: dict = {}
    for name, fracs in summarise(rows, metric).items():
        for frac in fracs:
            vals = [p[name][frac] for p in per_seed if frac in p.get(name, {})]
            sem = float(np.std(vals, ddof=1) / math.sqrt(len(vals))) if len(vals) > 1 else float("nan")
            out.setdefault(name, {})[frac] = sem
    return out


def by_workload(rows: list[dict], metric: str) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["workload"], {}).setdefault(r["searcher"], {}).setdefault(str(r["budget_frac"]), []).append(
            r[metric])
    return {w: {s: {f: float(np.mean(v)) for f, v in d.items()} for s, d in sd.items()} for w, sd in out.items()}


TIMING_SMS = tuple(range(2, 19, 2))  # one SM level more than the default space: 720 candidates on bwd_attn


def time_mbo_batch() -> dict:
    """Fit + acquisition of MBO batches on a 720-candidate space (the widest qwen1.7b pp2_tp8 partition
    with SM counts 2..18; simulated A100): the issue asks for well under 1 s per batch on 2 cores."""
    import kareus.partition  # noqa: F401
    import kareus.search  # noqa: F401
    from kareus.registry import PARTITIONERS, SEARCHERS
    from kareus.search.space import SpaceConfig
    from kareus.workload import build_workload

    model, parallel = WORKLOADS[0]
    spec = conf_workload(model, parallel)
    types = PARTITIONERS.build("nanobatch", config={}).partition(build_workload(*spec)).types
    widest = max(types, key=lambda t: len(t.slots))
    big = sim_truths(workloads=[(f"{model}-{parallel}", *spec)], space_cfg=SpaceConfig(sms=list(TIMING_SMS)),
                     keys=(widest.key,))[0]
    n = len(big.space)
    budget = math.ceil(0.4 * n)
    runs = []
    for _ in range(2):  # the first run pays xgboost's and the thread pool's start-up: reported apart
        s = SEARCHERS.build("mbo", config={"seed": 0, "budget": budget})
        s.run(SearchProblem(big.partition, big.space, big.evaluate, budget, 0, big.static_power_w))
        runs.append(s.timings)
    cold, warm = runs
    batches = [t["fit_s"] + t["acq_s"] for t in warm]
    # HVI of 5000 candidates against a 50-point front, the vectorised sweep
    rng = np.random.default_rng(0)
    tt = np.sort(rng.random(50))
    front, cands = np.column_stack([tt, 1 - tt]), rng.random((5000, 2))
    reps = []
    for _ in range(20):
        t0 = time.perf_counter()
        hvi(cands, front, (1.1, 1.1))
        reps.append(time.perf_counter() - t0)
    return {"space": n, "partition": big.partition.key, "batches": len(batches),
            "fit_s_mean": float(np.mean([t["fit_s"] for t in warm])),
            "acq_s_mean": float(np.mean([t["acq_s"] for t in warm])),
            "batch_s_max": float(max(batches)), "batch_s_mean": float(np.mean(batches)),
            "cold_first_batch_s": float(cold[0]["fit_s"] + cold[0]["acq_s"]),
            "hvi_5000x50_ms": 1000 * float(np.median(reps))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Protocols: lookup measures each space once and answers every searcher from "
                                        "that lookup; noisy gives a fresh noisy reading per measurement and scores "
                                        "the reported front at the noise-free truth. Both run unless --lookup or "
                                        "--noisy picks one.")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--searchers", default=",".join(PEERS))
    ap.add_argument("--qnehvi", action="store_true", help="add BoTorch qLogNEHVI (needs botorch; slow)")
    ap.add_argument("--qnehvi-seeds", type=int, default=1, help="seeds for qnehvi (slow: it fits GPs per batch)")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 seeds (--holdout: and 2 workloads)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--lookup", action="store_true", help="the lookup protocol alone")
    which.add_argument("--noisy", action="store_true", help="the noisy protocol alone")
    ap.add_argument("--holdout", nargs="?", const="report", choices=("report", "tuning"), default=None,
                    help="the held-out family of benchmarks/heldout.py in place of the summary's workloads: its "
                         "report seeds (1000 on), or with 'tuning' its tuning seeds (0-99); the replay table is "
                         "left out. Written to runs/bench/search_efficiency_holdout[_tuning].json")
    ap.add_argument("--holdout-workloads", type=int, default=6, help="held-out workloads (the first seeds of the kind)")
    ap.add_argument("--holdout-space", choices=("full", "small"), default="full",
                    help="full: the spaces a run searches (160-900 candidates a partition on the first report seeds); small: heldout.py's "
                         "subsampled ones (50-140), for tuning in minutes")
    ap.add_argument("--workload", action="append", default=None, metavar="MODEL:PARALLEL:HARDWARE",
                    help="shipped model, parallel layout and simulated GPU in place of the summary's simulated "
                         "workloads (repeatable), e.g. llama3.3-70b:pp10_tp8:h100_sim")
    ap.add_argument("--partitions", default=None, help="comma-separated partition keys to keep (simulated workloads)")
    ap.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS), help="budget fractions")
    ap.add_argument("--mbo-variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                    help="MBO with search.KEY overrides, reported as LABEL beside the searchers (repeatable; separate "
                         "pairs with ';' when a value is a list), e.g. mbo-posterior:report=posterior")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (partitions are split among them)")
    ap.add_argument("--no-timing", action="store_true", help="skip timing MBO's batches on a 720-candidate space")
    ap.add_argument("--out", default=None, help="default: runs/bench/search_efficiency[_holdout[_tuning]].json")
    return ap.parse_args(argv)


def simulated(args: argparse.Namespace, seed: int, noise: bool) -> list[Truth]:
    """The simulated truths the arguments ask for, read under ``seed`` (reading noise ``noise``)."""
    keys = tuple(args.partitions.split(",")) if args.partitions else None
    if args.holdout:
        import heldout

        count = 2 if args.quick else args.holdout_workloads
        return heldout_truths([heldout.draw(k) for k in heldout.seeds(args.holdout, count)], seed, noise,
                              full=args.holdout_space == "full")
    if args.no_sim:
        return []
    if not args.workload:
        return sim_truths(seed=seed, keys=keys, noise=noise)
    out = []
    for spec in args.workload:
        model, par, hw = spec.split(":")
        out += sim_truths(seed=seed, hardware=hw, workloads=[(f"{model}-{par} ({hw})", *conf_workload(model, par))],
                          keys=keys, noise=noise)
    return out


def searched(truths: list[Truth], searchers: list[str], seeds: int, budgets: tuple[float, ...], args,
             protocol: str) -> list[dict]:
    """Rows of every searcher (qnehvi on its own seeds) under ``protocol``."""
    rows, _timing = run_all(truths, [s for s in searchers if s != "qnehvi"], seeds, budgets, jobs=args.jobs,
                           protocol=protocol)
    if args.qnehvi or "qnehvi" in searchers:
        from kareus.search.qnehvi import MISSING, available

        if not available():
            print(f"qnehvi skipped: {MISSING}")
        else:
            rows += run_all(truths, ["qnehvi"], args.qnehvi_seeds, budgets, jobs=args.jobs, protocol=protocol)[0]
    return rows


def summaries(rows: list[dict], truths: list[Truth]) -> dict:
    """The per-protocol summary keys of the JSON."""
    return {"summary": summarise(rows, "hv_ratio"), "summary_sem": seed_error(rows, "hv_ratio"),
            "summary_dynamic": summarise(rows, "hv_ratio_dynamic"), "igd_plus": summarise(rows, "igd_plus"),
            "pareto_share": summarise(rows, "pareto_share"), "by_workload": by_workload(rows, "hv_ratio"),
            "workloads": sorted({t.workload for t in truths})}


def one_reading_exhaustive(truths: list[Truth], noisy: dict[tuple[str, str], Truth]) -> dict[str, float]:
    """Per workload: an exhaustive search reading every setting once (a simulated partition's noisy
    lookup; one random repeat of the recorded table, averaged over draws), scored at the truth."""
    out = resolution(truths, noisy)
    recorded: dict[str, list[float]] = {}
    for t in truths:
        if t.repeats and (t.workload, t.partition.key) not in noisy:
            recorded.setdefault(t.workload, []).append(single_repeat_exhaustive(t)["mean"])
    return {**out, **{w: float(np.mean(v)) for w, v in recorded.items()}}


NOISY_DESCRIPTION = ("noisy protocol: every measurement a fresh reading (simulated: the profiler's default protocol "
                     "on a GPU of the search's own, reading noise on; recorded: the table's repeats in turn), each "
                     "charged to the budget; the front each searcher reports from its own readings is scored at "
                     "the noise-free truth (simulated: reading noise off; recorded: medians of the repeats), "
                     "normalised by the true front. exhaustive_one_reading: every setting read once, its front "
                     "scored the same way.")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    seeds = 2 if args.quick else args.seeds
    budgets = tuple(float(b) for b in args.budgets.split(","))
    searchers = [s for s in args.searchers.split(",") if s]
    for spec in args.mbo_variant:
        label, overrides = parse_variant(spec)
        VARIANTS[label] = overrides
        searchers.append(label)
    protocols = ("lookup",) if args.lookup else ("noisy",) if args.noisy else PROTOCOLS

    t0 = time.perf_counter()
    name = {None: "search_efficiency.json", "report": "search_efficiency_holdout.json",
            "tuning": "search_efficiency_holdout_tuning.json"}[args.holdout]
    out_path = Path(args.out) if args.out else ROOT / "runs" / "bench" / name
    out_path.parent.mkdir(parents=True, exist_ok=True)
    truths = simulated(args, 0, noise=True)  # the lookup; under noisy, the one-reading exhaustive reference
    seconds = simulated(args, 1, noise=True) if "lookup" in protocols else []  # every setting read again
    quiet = simulated(args, 0, noise=False) if "noisy" in protocols else []  # the noisy protocol's truth
    if not args.no_replay and not args.holdout:
        replayed = replay_truths(out_path.parent)
        truths += replayed
        quiet += replayed if "noisy" in protocols else []
    print(f"ground truth: {len(truths)} partitions, {sum(len(t.space) for t in truths)} candidates measured "
          f"({time.perf_counter() - t0:.1f} s)")
    doc: dict = {"held_out": args.holdout, "holdout_space": args.holdout_space if args.holdout else None,
                 "protocols": list(protocols), "seeds": seeds,
                 "budgets": [str(b) for b in budgets], "mbo_variants": dict(VARIANTS)}
    if "lookup" in protocols:
        rows = searched(truths, searchers, seeds, budgets, args, "lookup")
        doc.update(lookup_doc(rows, truths, seconds, budgets, args))
    if "noisy" in protocols:
        nrows = searched(quiet, searchers, seeds, budgets, args, "noisy")
        lookups = {(t.workload, t.partition.key): t for t in truths if not t.repeats}
        doc["noisy"] = {"description": NOISY_DESCRIPTION, **summaries(nrows, quiet),
                        "exhaustive_one_reading": one_reading_exhaustive(quiet, lookups),
                        "searcher_wall_s": wall_summary(timing_of(nrows)), "runs": nrows}
    if not args.no_timing:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # in an interpreter of its own: the searches above warmed this one (and, with --jobs 1, ran MBO in it)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            doc["mbo_batch_timing"] = pool.submit(time_mbo_batch).result()
    doc["wall_s"] = time.perf_counter() - t0
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc)
    print(f"wrote {out_path} ({doc['wall_s']:.0f} s)")
    return doc


LOOKUP_DESCRIPTION = (
    "lookup protocol (the top-level summary keys; the noisy protocol's are under 'noisy'): hypervolume ratio of "
    "each searcher's measured (time, total energy) frontier to the exhaustive one; objectives normalised so the "
    "exhaustive front spans [0,1] (ideal = best time/energy, nadir = the front's worst), reference point "
    "(1.1, 1.1). Sim partitions are simulated (each workload's simulated GPU), each measured once by the "
    "profiler's default protocol on a GPU of its own, every searcher answered from that lookup; the replay "
    "partitions are real A100 data (medians of the repeats). summary: the mean over a workload's partitions and "
    "seeds, then over the workloads with equal weight; summary_sem is over search seeds (the ground truth is "
    "measured once).")


def wall_summary(timing: dict[str, list[float]]) -> dict:
    return {k: {"mean": float(np.mean(v)), "total": float(np.sum(v))} for k, v in timing.items()}


def lookup_doc(rows: list[dict], truths: list[Truth], seconds: list[Truth], budgets: tuple[float, ...],
               args) -> dict:
    """The lookup protocol's keys of the JSON, at its top level."""
    second = {(t.workload, t.partition.key): t for t in seconds}
    ceiling = model_ceiling(truths, second, budgets)
    return {
        "description": LOOKUP_DESCRIPTION,
        **summaries(rows, truths),
        # an exhaustive search's ratio when it picks its front from a second reading (the recorded
        # table's: partitions[].single_repeat_exhaustive); it measures only the front it sees
        "resolution_simulated": resolution(truths, second),
        # a searcher whose surrogate were another reading of every setting, measuring the budget's worth
        # nearest that reading's front: what a better surrogate could still gain, per budget
        "model_ceiling": ceiling,
        "model_ceiling_summary": {f: float(np.mean([c[f] for c in ceiling.values()])) for f in map(str, budgets)
                                  if ceiling},
        # qnehvi runs on seeds 0..qnehvi_seeds-1 alone: compare it on those (runs[]), not in summary
        "qnehvi_seeds": args.qnehvi_seeds if any(r["searcher"] == "qnehvi" for r in rows) else None,
        "partitions": [{"workload": t.workload, "partition": t.partition.key, "space": len(t.space),
                        "true_pareto": int(len(t.frame()[2])), "corners": corner_noise(t),
                        "single_repeat_exhaustive": single_repeat_exhaustive(t)} for t in truths],
        "searcher_wall_s": wall_summary(timing_of(rows)),
        "runs": rows,
    }


def timing_of(rows: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(r["searcher"], []).append(r["wall_s"])
    return out


def print_budget_tables(doc: dict, budgets: list[str], tables) -> None:
    """One searcher x budget table per (title, key of ``doc``, format); a missing cell prints n/a."""
    for title, key, fmt in tables:
        print(f"\n{title}; mean over workloads: {', '.join(doc['workloads'])}")
        print(f"{'searcher':<10}" + "".join(f"{f:>10}" for f in budgets))
        for name, row in doc[key].items():
            print(f"{name:<10}" + "".join(f"{fmt.format(row[f]) if f in row else 'n/a':>10}" for f in budgets))


def summary_tables(protocol: str) -> tuple:
    """(title, key, format) of the tables both protocols print, titles labelled with ``protocol``."""
    return tuple((f"{protocol}: {title}", key, fmt) for title, key, fmt in (
        ("HV ratio (higher is better)", "summary", "{:.4f}"),
        ("HV ratio: standard error over seeds", "summary_sem", "{:.4f}"),
        ("HV ratio in (time, dynamic energy), the front the composer combines", "summary_dynamic", "{:.4f}"),
        ("IGD+ (lower is better)", "igd_plus", "{:.4f}"),
        ("share of true Pareto points measured", "pareto_share", "{:.3f}")))


def print_table(doc: dict) -> None:
    if "summary" in doc:
        print_lookup(doc)
    if "noisy" in doc:
        print_noisy(doc["noisy"], doc["budgets"])
    b = doc.get("mbo_batch_timing")
    if b:
        print(f"\nMBO fit+acquisition per batch on {b['space']} candidates: mean {b['batch_s_mean']:.3f} s, "
              f"max {b['batch_s_max']:.3f} s (fit {b['fit_s_mean']:.3f} s, acquisition {b['acq_s_mean']:.3f} s); "
              f"first batch in a fresh process {b['cold_first_batch_s']:.3f} s; HVI 5000x50: "
              f"{b['hvi_5000x50_ms']:.2f} ms")


def print_noisy(noisy: dict, fr: list[str]) -> None:
    print("\n=== noisy protocol: a fresh reading per measurement, the reported front scored at the noise-free truth")
    print_budget_tables(noisy, fr, summary_tables("noisy"))
    print("\nnoisy: HV ratio of an exhaustive search that reads every setting once, at the truth: "
          + ", ".join(f"{w} {v:.4f}" for w, v in noisy["exhaustive_one_reading"].items()))


def print_lookup(doc: dict) -> None:
    fr = doc["budgets"]
    print("\n=== lookup protocol: every space measured once, every searcher answered from that lookup")
    print_budget_tables(doc, fr, summary_tables("lookup"))
    recorded = [(p, c) for p in doc["partitions"] for c in p["corners"] if "repeat_spread_median" in c]
    if recorded:
        print("\nrecorded table: per clock, the lowest-energy setting's lead over the next, the HV ratio of the "
              "exhaustive front without it, and the median spread of one setting's repeats")
        for p, c in recorded:
            print(f"  {p['partition']:<28} {c['freq_mhz']:>5} MHz  {c['corner']:<16} lead {100 * c['lead']:5.2f}%  "
                  f"HV ratio without it {c['hv_ratio_without']:.4f}  repeat spread {100 * c['repeat_spread_median']:.2f}%")
    if doc.get("resolution_simulated"):
        print("\nsimulated tables: HV ratio of an exhaustive search that picks its front from a second reading "
              "of every setting (another noise seed): " + ", ".join(f"{w} {v:.4f}"
                                                                    for w, v in doc["resolution_simulated"].items()))
    if doc.get("model_ceiling"):
        print("\nHV ratio of a searcher whose model were a second reading of every setting (one repeat, on the "
              "recorded table), measuring the budget's worth nearest its front; beside MBO's")
        for w, row in doc["model_ceiling"].items():
            mbo_w = doc["by_workload"].get(w, {}).get("mbo", {})
            print(f"  {w:<40}" + "".join(f"  {f}: {row[f]:.4f}" + (f" (MBO {mbo_w[f]:.4f})" if f in mbo_w else "")
                                          for f in fr))
        print(f"  {'mean':<40}" + "".join(f"  {f}: {doc['model_ceiling_summary'][f]:.4f}" for f in fr))
    floors = [p for p in doc["partitions"] if p.get("single_repeat_exhaustive")]
    if floors:
        mbo = {}
        for r in doc["runs"]:
            if r["searcher"] == "mbo":
                mbo.setdefault((r["partition"], str(r["budget_frac"])), []).append(r["hv_ratio"])
        print("\nrecorded table: HV ratio of an exhaustive search that picks its front from one repeat per "
              f"setting ({floors[0]['single_repeat_exhaustive']['draws']} random draws), beside MBO's mean")
        for p in floors:
            f = p["single_repeat_exhaustive"]
            ours = "  ".join(f"{b}: {np.mean(v):.3f}" for b in fr if (v := mbo.get((p["partition"], b))))
            print(f"  {p['partition']:<28} mean {f['mean']:.3f}  p10 {f['p10']:.3f}  min {f['min']:.3f}   MBO {ours}")
        print(f"  {'mean':<28} mean {np.mean([p['single_repeat_exhaustive']['mean'] for p in floors]):.3f}")
    if doc.get("qnehvi_seeds"):
        q = doc["qnehvi_seeds"]
        print(f"\nqnehvi ran on {q} seed(s), the others on {doc['seeds']}; on qnehvi's seeds alone (HV ratio):")
        same = [r for r in doc["runs"] if r["seed"] < q]
        for name, row in summarise(same, "hv_ratio").items():
            print(f"{name:<10}" + "".join(f"{row[f]:>10.4f}" if f in row else f"{'n/a':>10}" for f in fr))


if __name__ == "__main__":
    main()
