"""Multi-pass multi-objective Bayesian optimisation (``search=mbo``).

Each batch: fit the surrogate ensemble to log time and log dynamic energy of the measured candidates,
derive static (static power x time) and total energy per member, then let every acquisition pass fill
its share of the batch from the unmeasured candidates without duplicates.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kareus.registry import ACQUISITIONS, SEARCHERS, SURROGATES
from kareus.search.acquisition import Context
from kareus.search.base import SearchProblem, SearchResult
from kareus.search.common import SearchRun, Timer
from kareus.search.config import MBOConfig, SurrogateConfig, initial_size, pass_shares, round_batch
from kareus.search.design import latin_hypercube
from kareus.search.hv import hypervolume, nondominated


def start(run: SearchRun, cfg: Any, label: str = "initial") -> None:
    """Measure the shared initial design (``problem.initial``) or a seeded Latin hypercube."""
    p = run.problem
    if p.initial:
        init = run.indices(p.initial)
    else:
        init = run.indices(latin_hypercube(run.space, p.partition, initial_size(cfg, run.budget), p.seed))
    run.evaluate(init, [{"pass": label} for _ in init])
    run.finish_batch()


def predict(run: SearchRun, surrogate_cfg: SurrogateConfig, pool: np.ndarray, seed: int) -> tuple[dict, dict]:
    """Fit the surrogate on the measured points; member samples of every objective for ``pool``."""
    ok = run.ok()
    obj = run.objectives(ok)
    floor = 1e-9 * max(float(np.abs(obj[:, 2]).max()), 1e-30)
    Y = np.column_stack([np.log(obj[:, 0]), np.log(np.maximum(obj[:, 2], floor))])
    model = SURROGATES.build(surrogate_cfg.name, config=surrogate_cfg).fit(run.X[ok], Y, seed)
    s = model.sample(run.X[pool])
    t, dyn = np.exp(s[:, :, 0]), np.exp(s[:, :, 1])
    P = run.problem.static_power_w
    samples = {"time": t, "dynamic": dyn, "static": P * t, "total": dyn + P * t}
    measured = {"time": obj[:, 0], "total": obj[:, 1], "dynamic": obj[:, 2], "static": obj[:, 1] - obj[:, 2]}
    return samples, measured


def predicted_gain(ctx: Context, picks: list[int]) -> float:
    """Relative (time, total energy) hypervolume gain if the picks land on their mean predictions."""
    mt, mo = ctx.measured["time"], ctx.measured["total"]
    ref = (mt.max() * 1.1, mo.max() * 1.1)
    front = nondominated(np.column_stack([mt, mo]))
    base = hypervolume(front, ref)
    pts = np.column_stack([ctx.mean("time")[picks], ctx.mean("total")[picks]])
    return (hypervolume(np.vstack([front, pts]), ref) - base) / base if base > 0 else float("inf")


def annotate(ctx: Context, p: int, pass_name: str) -> dict[str, Any]:
    return {"pass": pass_name, "predicted": {
        "time_s": float(ctx.mean("time")[p]), "energy_j": float(ctx.mean("total")[p]),
        "dynamic_energy_j": float(ctx.mean("dynamic")[p]),
        "time_std": float(ctx.std("time")[p]), "energy_std": float(ctx.std("total")[p])}}


def fill_batch(ctx: Context, plan: list[tuple[str, int]], k: int) -> tuple[list[int], list[str]]:
    """Run the passes for their counts; if some return fewer, cycle through them for the rest."""
    free = np.ones(len(ctx.pool), dtype=bool)
    picks: list[int] = []
    names: list[str] = []
    passes = {name: ACQUISITIONS.build(name) for name, _ in plan}
    queue = [(n, c) for n, c in plan if c > 0]
    for _round in range(3):
        for name, count in queue:
            if count <= 0 or not free.any():
                continue
            for p, _score in passes[name].select(ctx, count, free):
                if free[p]:
                    free[p] = False
                    picks.append(p)
                    names.append(name)
        short = k - len(picks)
        if short <= 0 or not free.any():
            break
        queue = [(plan[i % len(plan)][0], 1) for i in range(short)]
    return picks[:k], names[:k]


@SEARCHERS.register("mbo", MBOConfig)
class MBOSearcher:
    """Multi-pass MOBO with an XGBoost bootstrap ensemble and greedy batch HVI."""

    def __init__(self, cfg: MBOConfig) -> None:
        self.cfg = cfg
        self.timings: list[dict[str, float]] = []

    def run(self, problem: SearchProblem) -> SearchResult:
        cfg = self.cfg
        run = SearchRun(problem)
        rng = np.random.default_rng(problem.seed)
        start(run, cfg)
        batch = round_batch(cfg, run.remaining)
        while run.remaining > 0:
            pool = run.unmeasured
            k = min(batch, run.remaining, len(pool))
            if k <= 0:
                break
            if len(run.ok()) < 3:  # nothing to model yet: widen the design at random
                picks = rng.choice(pool, size=k, replace=False)
                run.evaluate(picks, [{"pass": "random"} for _ in picks])
                run.finish_batch()
                continue
            timer = Timer()
            samples, measured = predict(run, cfg.surrogate, pool, problem.seed + 7919 * run.batches)
            fit_s = timer.lap()
            ctx = Context(pool, samples, measured, kappa=cfg.kappa, greedy=cfg.greedy, ref_margin=cfg.ref_margin,
                          rng=rng)
            local, names = fill_batch(ctx, pass_shares(cfg, k), k)
            acq_s = timer.lap()
            gain = predicted_gain(ctx, local)
            notes = [annotate(ctx, p, n) for p, n in zip(local, names)]
            if cfg.stop_gain > 0 and gain < cfg.stop_gain:
                run.finish_batch(gain, notes, fit_s=fit_s, acq_s=acq_s)
                break
            run.evaluate(pool[local], notes)
            run.finish_batch(gain, notes, fit_s=fit_s, acq_s=acq_s)
        self.timings = run.timings
        return run.result()
