"""Peer searchers behind the same interface and budget: the baselines MBO is measured against."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from kareus.registry import SEARCHERS
from kareus.search.acquisition import Context
from kareus.search.base import SearchProblem, SearchResult
from kareus.search.common import SearchRun, Timer
from kareus.search.config import (ArtifactConfig, Centre, ExhaustiveConfig, NSGA2Config, OptunaConfig, RandomConfig,
                                  SurrogateConfig, TPEConfig, round_batch, split_batch)
from kareus.search.mbo import annotate, fill_batch, predict, predicted_gain, start, widened_at_random


@SEARCHERS.register("exhaustive", ExhaustiveConfig)
class ExhaustiveSearcher:
    """Profile every candidate (the budget is ignored): the ground truth."""

    def __init__(self, cfg: ExhaustiveConfig) -> None:
        self.cfg = cfg

    def run(self, problem: SearchProblem) -> SearchResult:
        problem = SearchProblem(problem.partition, problem.space, problem.evaluate, len(problem.space), problem.seed,
                                problem.static_power_w, [], problem.emit)
        run = SearchRun(problem)
        for lo in range(0, len(run.space), self.cfg.batch_size):
            idx = list(range(lo, min(lo + self.cfg.batch_size, len(run.space))))
            run.evaluate(idx, [{"pass": "exhaustive"} for _ in idx])
            run.finish_batch()
        return run.result()


@SEARCHERS.register("random", RandomConfig)
class RandomSearcher:
    """The shared initial design, then uniformly random unmeasured candidates."""

    def __init__(self, cfg: RandomConfig) -> None:
        self.cfg = cfg

    def run(self, problem: SearchProblem) -> SearchResult:
        run = SearchRun(problem)
        rng = np.random.default_rng(problem.seed + 1)
        start(run, self.cfg)
        batch = round_batch(self.cfg, run.remaining)
        for pool, k in run.batch_pools(batch):
            picks = rng.choice(pool, size=k, replace=False)
            run.evaluate(picks, [{"pass": "random"} for _ in picks])
            run.finish_batch()
        return run.result()


@SEARCHERS.register("artifact", ArtifactConfig)
class ArtifactSearcher:
    """The published artifact's batch policy: 40% total-energy HVI and 20% dynamic-energy HVI on mean
    predictions (each candidate scored alone), 20% lowest predicted time, the rest highest uncertainty;
    5 bootstrap XGBoost members; reference point 1.1 x the observed maxima."""

    def __init__(self, cfg: ArtifactConfig) -> None:
        self.cfg = cfg
        self.timings: list[dict[str, float]] = []

    def run(self, problem: SearchProblem) -> SearchResult:
        cfg = self.cfg
        run = SearchRun(problem)
        start(run, cfg)
        surrogate = SurrogateConfig(members=cfg.members, linear_base=False, clip_margin=1.0,
                                    center=Centre.none)  # the policy as first benchmarked: wide clip
        batch = round_batch(cfg, run.remaining)
        rng = np.random.default_rng(problem.seed)
        for pool, k in run.batch_pools(batch):
            if widened_at_random(run, pool, k, rng):  # nothing to model yet
                continue
            timer = Timer()
            samples, measured = predict(run, surrogate, pool, problem.seed + 7919 * run.batches)
            fit_s = timer.lap()
            ctx = Context(pool, samples, measured, kappa=0.0, greedy=False, ref_factor=1.1)
            rest = max(1.0 - cfg.shares_total - cfg.shares_dynamic - cfg.shares_fastest, 0.0)
            plan = split_batch([("total", cfg.shares_total), ("dynamic", cfg.shares_dynamic),
                                ("fastest", cfg.shares_fastest), ("spread", rest)], k)
            local, names = fill_batch(ctx, plan, k)
            acq_s = timer.lap()
            notes = [annotate(ctx, p, n) for p, n in zip(local, names)]
            run.evaluate(pool[local], notes)
            run.finish_batch(predicted_gain(ctx, local), notes, fit_s=fit_s, acq_s=acq_s)
        self.timings = run.timings
        return run.result()


class OptunaSearcher:
    """Optuna ask/tell over the discrete space; repeated suggestions are told the known values free."""

    def __init__(self, cfg: OptunaConfig) -> None:
        self.cfg = cfg
        self.study: Any = None  # the last run's Optuna study (its trials, for inspection)

    def sampler(self, problem: SearchProblem, n_initial: int) -> Any:
        raise NotImplementedError

    def initial_asked(self, study: Any, trial: Any) -> None:
        """A trial of the shared initial design was asked (queued with fixed parameters)."""

    def run(self, problem: SearchProblem) -> SearchResult:
        import optuna
        from optuna.distributions import CategoricalDistribution

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        run = SearchRun(problem)
        rng = np.random.default_rng(problem.seed + 2)
        slots = list(dict.fromkeys(c.slot for c in run.space))
        dists = {"slot": CategoricalDistribution(slots),
                 "sms": _numeric({c.sms for c in run.space}),
                 "freq_mhz": _numeric({c.freq_mhz for c in run.space})}
        key_index = {(c.slot, c.sms, c.freq_mhz): i for i, c in enumerate(run.space)}
        slot_rank = {s: j for j, s in enumerate(slots)}
        coords = np.array([[slot_rank[c.slot], c.sms, c.freq_mhz] for c in run.space], dtype=float)
        scale = np.maximum(coords.max(0) - coords.min(0), 1.0)

        def nearest(params: dict) -> int:
            i = key_index.get((params["slot"], int(params["sms"]), int(params["freq_mhz"])))
            if i is not None:
                return i
            q = np.array([slot_rank[params["slot"]], params["sms"], params["freq_mhz"]], dtype=float)
            d = np.sum(((coords - q) / scale) ** 2, axis=1) + 1e3 * (coords[:, 0] != q[0])
            return int(np.argmin(d))

        init = run.indices(problem.initial) if problem.initial else None
        if init is None:
            from kareus.search.config import initial_size
            from kareus.search.design import latin_hypercube

            init = run.indices(latin_hypercube(run.space, problem.partition, initial_size(self.cfg, run.budget),
                                               problem.seed))
        study = optuna.create_study(directions=["minimize", "minimize"], sampler=self.sampler(problem, len(init)))
        for i in init:
            c = run.space[i]
            study.enqueue_trial({"slot": c.slot, "sms": c.sms, "freq_mhz": c.freq_mhz})
        asks, max_asks = 0, self.cfg.max_asks_factor * max(run.budget, 1)
        stalled = 0  # consecutive batches whose every suggestion was measured already
        first = True
        batch = round_batch(self.cfg, run.budget - len(init))
        while run.remaining > 0:
            n = len(init) if first else min(batch, run.remaining)
            trials = []
            for _ in range(n):
                tr = study.ask(dists)
                asks += 1
                if first:
                    self.initial_asked(study, tr)
                trials.append((tr, nearest(tr.params)))
            new = list(dict.fromkeys(i for _, i in trials if i not in run.measured))
            label = "initial" if first else self.cfg.name
            run.evaluate(new, [{"pass": label} for _ in new])
            for tr, i in trials:
                m = run.measured.get(i)
                worst = run.objectives()[:, :2].max(axis=0) if m is not None and m.failed and run.ok() else None
                if m is None or (m.failed and worst is None):  # over budget in this batch; nothing to penalise with
                    study.tell(tr, state=optuna.trial.TrialState.FAIL)
                elif m.failed:  # infeasible, at the worst measured time and energy: told FAIL, the samplers
                    tr.set_constraint("failed", 1.0)  # would leave it out and keep suggesting its region; feasible,
                    study.tell(tr, [float(v) for v in worst])  # later worse successes would rank below it
                else:
                    tr.set_constraint("failed", -1.0)
                    study.tell(tr, [m.time_s, m.energy_j])
            if new or first:
                run.finish_batch()
            first = False
            stalled = 0 if new else stalled + 1
            # the sampler keeps repeating itself (near a budget the size of the space, each further ask
            # also costs more, and the asks allowed grow with the budget): fill at random
            if (asks >= max_asks or stalled >= STALLED_BATCHES) and run.remaining > 0:
                pool = run.unmeasured
                picks = rng.choice(pool, size=min(run.remaining, len(pool)), replace=False)
                run.evaluate(picks, [{"pass": "random"} for _ in picks])
                run.finish_batch()
        self.study = study
        return run.result()


STALLED_BATCHES = 3  # batches in a row that suggest nothing new before the rest is filled at random


def _numeric(values: set[int]) -> Any:
    """An int distribution when the values form a full arithmetic grid, else categorical."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    v = sorted(values)
    if len(v) == 1:
        return CategoricalDistribution(v)
    step = math.gcd(*[b - a for a, b in zip(v, v[1:])])
    if list(range(v[0], v[-1] + 1, step)) == v:
        return IntDistribution(v[0], v[-1], step=step)
    return CategoricalDistribution(v)


@SEARCHERS.register("nsga2", NSGA2Config)
class NSGA2Searcher(OptunaSearcher):
    """NSGA-II (Optuna) whose first generation is the shared initial design (population: its size
    unless set). Optuna leaves queued trials out of every generation: its parents would otherwise
    come from a random generation of its own, measured on top of the initial design it paid for."""

    def sampler(self, problem: SearchProblem, n_initial: int) -> Any:
        import optuna

        self._sampler = optuna.samplers.NSGAIISampler(population_size=max(self.cfg.population or n_initial, 2),
                                                      seed=problem.seed)
        return self._sampler

    def initial_asked(self, study: Any, trial: Any) -> None:
        self._sampler.get_trial_generation(study, study.get_trials(deepcopy=False)[trial.number])  # tags it


@SEARCHERS.register("tpe", TPEConfig)
class TPESearcher(OptunaSearcher):
    """Multivariate multi-objective TPE (Optuna) with a constant liar for batches."""

    def sampler(self, problem: SearchProblem, n_initial: int) -> Any:
        import optuna

        return optuna.samplers.TPESampler(multivariate=True, constant_liar=True, seed=problem.seed,
                                          n_startup_trials=max(n_initial, 1))
