"""Typed configs of every searcher (one base dataclass) and their cross-field checks."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

from kareus.config.bounds import MAX_SEED, out_of_bounds
from kareus.search.space import SpaceConfig


class PassName(str, Enum):
    """Acquisition passes; an Enum so that ``search.passes=[total,typo]`` fails at composition."""

    total = "total"  # HVI of predicted (time, total energy)
    dynamic = "dynamic"  # HVI of predicted (time, dynamic energy)
    static = "static"  # HVI of predicted (time, static energy): favours the fastest candidates
    uncertainty = "uncertainty"  # largest predictive spread among candidates that may be Pareto
    fastest = "fastest"  # lowest predicted time (the published artifact's third pass)
    spread = "spread"  # largest predictive spread anywhere (the published artifact's last pass)
    local = "local"  # HVI among grid neighbours of measured Pareto points (exploitation)
    coverage = "coverage"  # best candidate of each slot with fewer than min_per_slot measurements


@dataclass
class SearcherConfig:
    """What every searcher shares. ``budget`` (a count) wins over ``budget_frac`` (of the space)."""

    name: str = ""
    seed: int = 0
    budget: int | None = None
    budget_frac: float | None = 0.15
    batch_size: int = 32
    initial: int | None = None  # initial design size; None: min(32, max(6, budget // 4), budget), whatever batch_size
    min_rounds: int = 5  # batches shrink below batch_size so that the guided phase has this many rounds
    space: SpaceConfig = field(default_factory=SpaceConfig)
    # a related run's directory, or a list of them: its journal's rows of this run's partition keys and
    # hardware are prior points for the surrogate (kareus.search.warm); null: a cold search
    warm_start: Any = None
    # partition keys to search (empty: all); the others are carried from search.warm_start when it is set
    only: list[str] = field(default_factory=list)

    def problems(self, ctx: Any = None) -> list[str]:
        """Cross-field rules for validate(): the config's own, and the space against ``ctx.gpu``."""
        out = config_problems(self)
        if self.only and not self.warm_start and getattr(ctx, "mode", "") == "run":
            out.append(f"search.only: mode=run composes every partition, and the ones outside {list(self.only)} are "
                       f"not searched; give search.warm_start=RUN_DIR to carry their frontiers, or use mode=search")
        gpu = getattr(ctx, "gpu", None)
        if gpu is not None:
            from kareus.search.space import space_problems

            out += space_problems(self.space, gpu, recorded=bool(getattr(ctx, "recorded_space", False)))
        return out


class RidgeBasis(str, Enum):
    """Features of the surrogate's ridge baseline (the trees model what it leaves)."""

    main = "main"  # clock, SMs and their reciprocals, the slot descriptors
    interactions = "interactions"  # + slot identity and each slot descriptor x 1/clock, 1/SMs, SMs
    auto = "auto"  # whichever (with its penalty) has the lower leave-one-out error, per fit


class Centre(str, Enum):
    """Where the ensemble's members are centred: the bootstrap gives the spread, this the mean."""

    none = "none"  # the members' own mean (on a few points pulled towards the neighbours of every point left out)
    trees = "trees"  # the same model fitted on every row
    gp = "gp"  # a Gaussian process's posterior mean once ``gp_min_points`` succeeded, ``trees`` before and beside failures


class GPKernel(str, Enum):
    """The GP centre's kernel."""

    auto = "auto"  # whichever of ard and additive has the higher marginal likelihood (with the length-scale prior), per fit
    ard = "ard"  # one Matern-5/2 over every feature, a length scale each
    additive = "additive"  # a Matern-5/2 on the clock plus one on the other features: SM curves carry across clocks


class FrontReport(str, Enum):
    """Which values pick the front a search reports (and place its points)."""

    readings = "readings"  # each setting's reading (the mean of its readings where it was read again)
    posterior = "posterior"  # the surrogate's centre at each measured setting: a lucky reading is pulled back


BATCH_POLICIES = ("local", "coverage")  # passes that pick only some candidates, and then none
HVI_PASSES = ("total", "dynamic", "static", "local")  # passes that score a hypervolume improvement (search.expected, per_clock, hand_over)


@dataclass
class SurrogateConfig:
    """Bootstrap ensemble of gradient-boosted trees on small data (one thread per member)."""

    name: str = "xgboost"
    members: int = 6
    max_depth: int = 4
    rounds: int = 100
    learning_rate: float = 0.1
    subsample: float = 1.0
    min_child_weight: float = 1.0
    threads: int = 2  # members fitted in parallel, one xgboost thread each
    linear_base: bool = True  # fit a ridge baseline on the features first, trees model the residual
    basis: RidgeBasis = RidgeBasis.auto  # a handful of points cannot carry the interaction terms, hundreds can
    clip_margin: float = 0.25  # member predictions stay within the observed (log) range widened by this share
    center: Centre = Centre.gp  # what the members are shifted onto: the bootstrap gives the spread, not the mean
    gp_min_points: int = 10  # center=gp: below this many successful measurements the GP's hyperparameters are guesses
    gp_kernel: GPKernel = GPKernel.auto  # center=gp: the GP's kernel


@dataclass
class MBOConfig(SearcherConfig):
    """Multi-pass multi-objective Bayesian optimisation."""

    name: str = "mbo"
    passes: list[PassName] = field(default_factory=lambda: [
        PassName.total, PassName.dynamic, PassName.static, PassName.uncertainty])
    # share of each batch per pass; renormalised over the passes actually chosen. Total energy takes
    # most: at 10-15% of a space every pick another pass takes is missing from the total front, and
    # plans built from the searched fronts did not gain from those picks (benchmarks/plan_quality.py)
    shares: dict[str, float] = field(default_factory=lambda: {
        "total": 0.9, "dynamic": 0.05, "static": 0.025, "uncertainty": 0.025,
        "fastest": 0.2, "spread": 0.2, "local": 0.2, "coverage": 0.2})
    surrogate: SurrogateConfig = field(default_factory=SurrogateConfig)
    kappa: float = 0.25  # mean-HVI passes score the optimistic point mean - kappa x std (0: the mean)
    greedy: bool = True  # fill each pass by greedy HVI (each pick joins the front as predicted)
    min_per_slot: int = 3  # slots with fewer measurements get one guided pick per batch (0: off)
    coverage_share: float = 0.34  # at most this share of a batch goes to such picks
    final_local: float = 1.0  # share of the last batch for the local pass (neighbours of measured Pareto points)
    corners: bool = True  # after the initial design: each launch slot's largest SM count at the top clock
    # passes that score the mean HVI over the ensemble members (Monte-Carlo EHVI: explores where some
    # members see a frontier point) instead of the HVI of the mean prediction (exploits)
    expected: list[PassName] = field(default_factory=lambda: [PassName.dynamic, PassName.static])
    # passes that score each candidate against the measured front at its own clock: the microbatch
    # composer adds the partitions' (time, dynamic energy) options clock by clock, so those per-clock
    # fronts are what it combines
    per_clock: list[PassName] = field(default_factory=lambda: [PassName.dynamic])
    # passes that stop once no candidate is predicted to improve the measured front (the batch's picks
    # included), handing the rest of their share to the other passes: exploit while there is a
    # predicted gain, explore with what is left
    hand_over: list[PassName] = field(default_factory=lambda: [PassName.total])
    stop_gain: float = 0.0  # stop when the batch's predicted HV gain / current HV falls below this
    ref_margin: float = 0.1  # reference point: observed maxima + margin x observed range
    # measurement noise: which values pick the reported front, and how much of the budget goes to reading
    # settings again whose distance to the front is within the noise (before the last batch; what they
    # leave unspent goes to it)
    report: FrontReport = FrontReport.readings
    remeasure: float = 0.0  # share of the budget kept for re-measurements before the last batch (0: none)
    remeasure_handed: float = 0.0  # share of the picks the total-energy pass hands over that re-measure instead
    # re-measure while some setting's chance of sitting on the wrong side of the front, times the share of
    # the front's hypervolume it holds there, is at least this
    remeasure_stake: float = 0.002
    # relative sd of one reading (time, energy) assumed until repeated readings tell
    noise_prior: list[float] = field(default_factory=lambda: [0.002, 0.01])


@dataclass
class ArtifactConfig(SearcherConfig):
    """The published artifact's batch policy, kept as the baseline our MBO must beat."""

    name: str = "artifact"
    members: int = 5
    shares_total: float = 0.4
    shares_dynamic: float = 0.2
    shares_fastest: float = 0.2


@dataclass
class ExhaustiveConfig(SearcherConfig):
    """Profile everything: the ground truth. A budget is refused rather than ignored, or the progress
    bar and MLflow would report it beside a search that profiled the whole space."""

    name: str = "exhaustive"
    budget_frac: float | None = 1.0

    def problems(self, ctx: Any = None) -> list[str]:
        out = super().problems(ctx)
        if self.budget is not None:
            out.append(f"search.budget: search=exhaustive profiles every candidate, so it takes no budget "
                       f"(got {self.budget}); drop it, or pick a searcher that uses one")
        if self.budget_frac is not None and self.budget_frac != 1.0:
            out.append(f"search.budget_frac: search=exhaustive profiles the whole space (1.0), got {self.budget_frac}")
        return out


@dataclass
class RandomConfig(SearcherConfig):
    name: str = "random"


@dataclass
class OptunaConfig(SearcherConfig):
    """Optuna ask/tell over the discrete space; repeated suggestions are answered, not charged."""

    name: str = "tpe"
    max_asks_factor: int = 20  # give up asking after this many x budget suggestions; fill randomly


@dataclass
class NSGA2Config(OptunaConfig):
    name: str = "nsga2"
    population: int | None = None  # None: the initial design's size (it is the first generation)


@dataclass
class TPEConfig(OptunaConfig):
    name: str = "tpe"


@dataclass
class QNEHVIConfig(SearcherConfig):
    """BoTorch qLogNEHVI with independent GPs over the exact candidate set (optional extra)."""

    name: str = "qnehvi"
    batch_size: int = 8
    mc_samples: int = 32
    verbose: bool = False

    def problems(self, ctx: Any = None) -> list[str]:
        """The shared rules, and the optional extra: without it the run would stop after its set-up."""
        from kareus.search.qnehvi import MISSING, available

        return super().problems(ctx) + ([] if available() else [f"search: {MISSING}"])


def round_batch(cfg: SearcherConfig, remaining: int) -> int:
    """Batch size after the initial design: ``batch_size``, or smaller so that ``remaining`` profiles
    take at least ``min_rounds`` model updates (profiles run one at a time anyway; small budgets
    gain most from feedback)."""
    return max(1, min(cfg.batch_size, math.ceil(remaining / max(cfg.min_rounds, 1))))


def budget_for(cfg: SearcherConfig, space_size: int) -> int:
    """Profiles allowed on a space of ``space_size`` candidates (at least one, at most the space)."""
    if cfg.budget is not None:
        n = cfg.budget
    elif cfg.budget_frac is not None:
        n = math.ceil(cfg.budget_frac * space_size - 1e-9)
    else:
        n = space_size
    return max(1, min(int(n), space_size))


def initial_fills_budget(cfg: SearcherConfig, sizes: dict[str, int]) -> list[str]:
    """Partitions (of ``sizes``: key -> space size) where a set ``search.initial`` takes the whole
    budget, so a guided searcher never guides. With ``budget_frac`` the budget differs per partition,
    so this is a note for the run to print, not a config error."""
    if cfg.initial is None or isinstance(cfg, (ExhaustiveConfig, RandomConfig)):
        return []
    return [key for key, n in sizes.items() if budget_for(cfg, n) <= cfg.initial]


INITIAL_CAP = 32  # the default initial design's largest size, whatever a searcher's batch size


def initial_size(cfg: SearcherConfig, budget: int) -> int:
    """Size of the initial design (it counts against the budget). The default depends on the budget
    alone, so every searcher with the same seed and budget starts from the same points."""
    if cfg.initial is not None:
        return max(1, min(cfg.initial, budget))
    return max(1, min(INITIAL_CAP, max(6, budget // 4), budget))


def config_problems(cfg: SearcherConfig) -> list[str]:
    """Cross-field problems of a searcher config (the space's GPU checks live in space_problems),
    one ``search.<key>: ...`` line each."""
    out: list[str] = []
    if cfg.budget is not None and cfg.budget <= 0:
        out.append(f"search.budget: must be > 0, got {cfg.budget}")
    if cfg.budget_frac is not None and not 0 < cfg.budget_frac <= 1:
        out.append(f"search.budget_frac: must be in (0, 1], got {cfg.budget_frac}")
    for key in ("batch_size", "min_rounds", "initial"):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            out.append(f"search.{key}: must be > 0, got {value}")
    if not 0 <= cfg.seed <= MAX_SEED:
        out.append(f"search.seed: must be in 0..{MAX_SEED} (numpy's and Optuna's seeds are 32-bit), got {cfg.seed}")
    if cfg.budget is not None and cfg.initial is not None and 0 < cfg.budget < cfg.initial:
        out.append(f"search.initial: must be <= search.budget ({cfg.budget}), as the initial design counts "
                   f"against it; got {cfg.initial}")
    out += _warm_problems(cfg)
    if isinstance(cfg, MBOConfig):
        out += _mbo_problems(cfg)
    if isinstance(cfg, ArtifactConfig):
        names = ("shares_total", "shares_dynamic", "shares_fastest")
        bad = out_of_bounds(cfg, "search.", nonnegative=names)  # NaN passed the sum below
        out += bad
        if not bad and sum(getattr(cfg, k) for k in names) > 1:
            out.append(f"search.shares_total/shares_dynamic/shares_fastest: must sum to <= 1, "
                       f"got {sum(getattr(cfg, k) for k in names)}")
        if cfg.members < 2:
            out.append(f"search.members: must be >= 2 (the spread is the uncertainty), got {cfg.members}")
    if isinstance(cfg, QNEHVIConfig):
        out += out_of_bounds(cfg, "search.", at_least_one=("mc_samples",))
    if isinstance(cfg, OptunaConfig):
        out += out_of_bounds(cfg, "search.", at_least_one=("max_asks_factor",))
    if isinstance(cfg, NSGA2Config) and cfg.population is not None and cfg.population < 2:
        out.append(f"search.population: must be >= 2 (parents to cross), got {cfg.population}")
    return out


def _warm_problems(cfg: SearcherConfig) -> list[str]:
    """``search.warm_start`` (paths with a journal, a searcher with a surrogate) and ``search.only``."""
    from kareus.config.paths import from_start_dir
    from kareus.search.warm import warm_start_problems

    out: list[str] = []
    if cfg.warm_start is not None and not isinstance(cfg, MBOConfig):
        out.append(f"search.warm_start: search={cfg.name} has no surrogate to offer prior points to; "
                   f"use search=mbo, or leave warm_start unset")
    else:
        out += warm_start_problems(cfg.warm_start, from_start_dir)
    only = [str(k) for k in (cfg.only or [])]
    if len(set(only)) != len(only):
        out.append(f"search.only: has duplicates, got {only}")
    return out



def _mbo_problems(cfg: MBOConfig) -> list[str]:
    out: list[str] = []
    valid = [p.value for p in PassName]
    if not cfg.passes:
        out.append(f"search.passes: must name at least one pass; allowed: {', '.join(valid)}")
    if len(set(cfg.passes)) != len(cfg.passes):
        out.append(f"search.passes: has duplicates, got {[p.value for p in cfg.passes]}")
    unknown = [k for k in cfg.shares if k not in valid]
    if unknown:
        out.append(f"search.shares: unknown pass(es) {unknown}; allowed: {', '.join(valid)}")
    neg = out_of_bounds(SimpleNamespace(**cfg.shares), "search.shares.", nonnegative=cfg.shares)
    out += neg
    if not neg and cfg.passes and sum(cfg.shares.get(p.value, 0.0) for p in cfg.passes) <= 0:
        out.append("search.shares: the chosen passes' shares sum to 0")
    if cfg.passes and all(p.value in BATCH_POLICIES for p in cfg.passes):
        regular = [p.value for p in PassName if p.value not in BATCH_POLICIES]
        out.append(f"search.passes: {[p.value for p in cfg.passes]} run dry before the budget is spent; "
                   f"add one of: {', '.join(regular)}")
    s = cfg.surrogate
    out += surrogate_name_problems(s.name)
    if s.members < 2:
        out.append(f"search.surrogate.members: must be >= 2 (the spread is the uncertainty), got {s.members}")
    if not 1 <= s.max_depth <= 12:
        out.append(f"search.surrogate.max_depth: must be in 1..12, got {s.max_depth}")
    for key in ("rounds", "threads"):
        if getattr(s, key) <= 0:
            out.append(f"search.surrogate.{key}: must be > 0, got {getattr(s, key)}")
    try:
        Centre(s.center)
    except ValueError:
        out.append(f"search.surrogate.center: invalid value {s.center!r}; allowed: {', '.join(c.value for c in Centre)}")
    try:
        GPKernel(s.gp_kernel)
    except ValueError:
        out.append(f"search.surrogate.gp_kernel: invalid value {s.gp_kernel!r}; allowed: {', '.join(k.value for k in GPKernel)}")
    if s.gp_min_points < 2:
        out.append(f"search.surrogate.gp_min_points: must be >= 2 (a GP needs points to fit), got {s.gp_min_points}")
    out += out_of_bounds(s, "search.surrogate.", positive=("learning_rate",), nonnegative=("min_child_weight",
                                                                                          "clip_margin"))
    if not 0 < s.subsample <= 1:
        out.append(f"search.surrogate.subsample: must be in (0, 1], got {s.subsample}")
    for key, chosen in (("expected", cfg.expected), ("per_clock", cfg.per_clock), ("hand_over", cfg.hand_over)):
        bad = [p.value for p in chosen if p.value not in HVI_PASSES]
        if bad:
            out.append(f"search.{key}: {bad} score no hypervolume; allowed: {', '.join(HVI_PASSES)}")
    for key in ("final_local", "coverage_share"):
        if not 0 <= getattr(cfg, key) <= 1:
            out.append(f"search.{key}: must be in [0, 1], got {getattr(cfg, key)}")
    if cfg.min_per_slot < 0:
        out.append(f"search.min_per_slot: must be >= 0, got {cfg.min_per_slot}")
    out += out_of_bounds(cfg, "search.", nonnegative=("kappa", "stop_gain", "ref_margin", "remeasure_stake"))
    if len(cfg.noise_prior) != 2 or not all(math.isfinite(x) and x > 0 for x in cfg.noise_prior):
        out.append(f"search.noise_prior: must be two relative sds > 0 (time, energy), got {list(cfg.noise_prior)}")
    try:
        FrontReport(cfg.report)
    except ValueError:
        out.append(f"search.report: invalid value {cfg.report!r}; allowed: {', '.join(r.value for r in FrontReport)}")
    if not 0 <= cfg.remeasure < 1:
        out.append(f"search.remeasure: must be in [0, 1) (a share of the budget), got {cfg.remeasure}")
    if not 0 <= cfg.remeasure_handed <= 1:
        out.append(f"search.remeasure_handed: must be in [0, 1], got {cfg.remeasure_handed}")
    return out


problems = config_problems


def surrogate_name_problems(name: str) -> list[str]:
    """A surrogate the registry lacks would otherwise fail the first guided batch, mid-run."""
    import kareus.search.surrogate  # noqa: F401  (registers the shipped surrogates)
    from kareus.registry import SURROGATES, UnknownComponentError

    try:
        SURROGATES.get(str(name))
    except UnknownComponentError as exc:
        return [f"search.surrogate.name: {exc}"]
    return []


def pass_shares(cfg: MBOConfig, batch: int) -> list[tuple[str, int]]:
    """Split a batch over the chosen passes by their shares."""
    return split_batch([(p.value, cfg.shares.get(p.value, 0.0)) for p in cfg.passes], batch)


def split_batch(shares: list[tuple[str, float]], batch: int) -> list[tuple[str, int]]:
    """Counts per pass that add up to ``batch``, by largest remainder (order kept, ties to the earlier
    pass): rounding each share alone gives a batch of one to no pass at all, or to the smallest."""
    w = [max(x, 0.0) for _, x in shares]
    tot = sum(w) or 1.0
    raw = [batch * x / tot for x in w]
    counts = [int(math.floor(r)) for r in raw]
    rest = batch - sum(counts)
    for i in sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))[:rest]:
        counts[i] += 1
    return [(name, n) for (name, _), n in zip(shares, counts)]
