"""Multi-pass multi-objective Bayesian optimisation (``search=mbo``).

Each batch: fit the surrogate ensemble to log time and log dynamic energy of the measured candidates,
derive static (static power x time) and total energy per member, then let every acquisition pass fill
its share of the batch from the unmeasured candidates without duplicates. The total-energy pass, the
one users pick plans by, scores the HVI of the slightly optimistic point mean - kappa x spread, the
mean being the surrogate's centre (exploitation); the passes named in
``search.expected`` (default: dynamic and static) score the mean HVI over the members (Monte-Carlo
EHVI), which pulls in candidates that only some members put on the frontier (exploration). The
passes named in ``search.per_clock`` (default: dynamic) score each candidate against the measured
front at its own clock: the microbatch composer adds the partitions' (time, dynamic energy) options
clock by clock, so each clock's front is what it combines, not the global one. The passes named
in ``search.hand_over`` (default: total) stop once no candidate is predicted to improve the
measured front (as the batch's picks extend it) and hand the rest of their share to the other
passes: a tight budget goes to the predicted frontier, a loose one explores too. The
surrogate's ridge baseline picks its basis per fit by leave-one-out error: main effects while a
handful of points are measured, slot interactions once the data carries them.

Three batch policies sit beside the chosen passes (``search.passes`` stays the ablation knob):
- coverage (``min_per_slot``): a launch slot with fewer than that many measurements gets one guided
  pick per batch (its best predicted HVI), capped at ``coverage_share`` of the batch; a slot the
  initial design touched once is otherwise judged by a single, possibly unlucky, point;
- corners (``corners``): right after the initial design, each launch slot's largest comm-SM setting at
  the top clock, unless measured. A compute kernel beside the comm loses SMs in whole waves, so its
  time and energy can step at SM counts no smooth model foresees, and a Latin hypercube of a handful of
  points leaves most slots' upper SM range, where the fastest settings lie, unbracketed. Skipped when
  fewer than ``CORNER_GUIDED`` profiles would remain for the guided batches;
- final exploitation (``final_local``): the last batch first measures the best predicted grid
  neighbours (same slot, one SM or clock step) of the measured Pareto points, where measurement
  noise and smooth clock/SM responses put the remaining frontier points.

Measurement noise (``kareus.search.noise``; every option off by default: re-measurement raised no
held-out tuning score under noise, and ``report=posterior``, which did, read lower on the real table;
docs/search.md): ``remeasure`` keeps a share of the budget to read again, before
the last batch, the settings most at stake of sitting on the wrong side of the front;
``remeasure_handed`` does so with picks the total-energy pass hands over; a setting read again counts
at the mean of its readings. ``report=posterior`` picks the reported front by the surrogate's centre
at the measured settings instead of their readings.
"""
from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import numpy as np

from kareus.frontier import pareto_mask
from kareus.registry import ACQUISITIONS, SEARCHERS, SURROGATES
from kareus.search.acquisition import WHOLE_FRONT, Context
from kareus.search.base import SearchProblem, SearchResult
from kareus.search.common import SearchRun, Timer
from kareus.search.config import (FrontReport, MBOConfig, PassName, SurrogateConfig, initial_size, pass_shares,
                                  round_batch)
from kareus.search.design import latin_hypercube
from kareus.search.hv import hypervolume, nondominated
from kareus.search.noise import log_objectives, pooled_noise, remeasure_pick
from kareus.search.warm import Prior, design, fit_rows


def start(run: SearchRun, cfg: Any, label: str = "initial") -> None:
    """Measure the shared initial design (``problem.initial``) or a seeded Latin hypercube."""
    p = run.problem
    if p.initial:
        init = run.indices(p.initial)
    else:
        init = run.indices(latin_hypercube(run.space, p.partition, initial_size(cfg, run.budget), p.seed))
    run.evaluate(init, [{"pass": label} for _ in init])
    run.finish_batch()


def warm_start(run: SearchRun, cfg: Any, prior: Prior) -> None:
    """Measure the prior's Pareto settings (``kareus.search.warm.design``) as the initial design, a Latin
    hypercube filling what they leave of its size only where the prior has fewer than ``MIN_FIT_POINTS``."""
    n = initial_size(cfg, run.budget)
    init = design(prior, n)
    if len(init) < MIN_FIT_POINTS:
        lhs = run.indices(latin_hypercube(run.space, run.problem.partition, n, run.problem.seed))
        init += [i for i in lhs if i not in init][: n - len(init)]
    run.evaluate(init, [{"pass": "warm"} for _ in init])
    run.finish_batch()


MIN_FIT_POINTS = 3  # successful measurements a surrogate needs before it guides a batch
CORNER_GUIDED = 4  # profiles that must remain for the guided batches after the corners


def corners(run: SearchRun) -> list[int]:
    """Each slot's largest SM count at the space's top clock, in space order, not yet measured."""
    top = max(c.freq_mhz for c in run.space)
    best: dict[str, int] = {}
    for i, c in enumerate(run.space):
        if c.freq_mhz == top and (c.slot not in best or c.sms > run.space[best[c.slot]].sms):
            best[c.slot] = i
    done = set(run.order)
    return [i for i in best.values() if i not in done]


def measure_corners(run: SearchRun) -> None:
    """Measure ``corners`` as a batch of their own while ``CORNER_GUIDED`` profiles remain after them."""
    todo = corners(run)
    if todo and run.remaining - len(todo) >= CORNER_GUIDED:
        run.evaluate(todo, [{"pass": "corner"} for _ in todo])
        run.finish_batch()


def widened_at_random(run: SearchRun, pool: np.ndarray, k: int, rng: np.random.Generator) -> bool:
    """Measure ``k`` random candidates of ``pool`` while too few measurements succeeded to fit a
    model (say, every initial point failed); True if it did, and the batch is done."""
    if len(run.ok()) >= MIN_FIT_POINTS:
        return False
    picks = rng.choice(pool, size=min(k, len(pool)), replace=False)
    run.evaluate(picks, [{"pass": "random"} for _ in picks])
    run.finish_batch()
    return True


def predict(run: SearchRun, surrogate_cfg: SurrogateConfig, pool: np.ndarray, seed: int) -> tuple[dict, dict]:
    """Fit the surrogate on the measured points; member samples of every objective for ``pool``.

    Failed measurements enter the fit at the worst measured time and dynamic energy: left out, a
    region where every setting fails (a slot that crashes, a clock the GPU cannot hold) would stay
    predicted attractive and draw picks batch after batch.
    """
    ok, failed = run.ok(), run.failed()
    obj = run.objectives(ok)
    prior = Prior.of(run.index, run.problem.prior) if run.problem.prior else None
    shift = dynamic_shift(obj[:, 2] if prior is None else np.concatenate([obj[:, 2], prior.obj[:, 2]]))
    Y = np.column_stack([np.log(obj[:, 0]), np.log(obj[:, 2] + shift)])
    X = run.X[ok]
    if prior is not None:  # the related run's points at settings not measured here, offset to this run's level
        idx, Yp = fit_rows(prior, ok, obj, grid_ranks(run)[:, 0], shift)
        X, Y = np.vstack([X, run.X[idx]]), np.vstack([Y, Yp])
    if failed:
        Y = np.vstack([Y, np.tile(Y.max(axis=0), (len(failed), 1))])
        X = np.vstack([X, run.X[failed]])
    model = SURROGATES.build(surrogate_cfg.name, config=surrogate_cfg)
    stand_ins = np.arange(len(X)) >= len(X) - len(failed)
    if "failed" in inspect.signature(model.fit).parameters:
        model = model.fit(X, Y, seed, failed=stand_ins)
    else:  # a plugin surrogate written before fits were told which rows failed
        model = model.fit(X, Y, seed)
    s = model.sample(run.X[pool])
    t, dyn = np.exp(s[:, :, 0]), np.exp(s[:, :, 1]) - shift
    P = run.problem.static_power_w
    samples = {"time": t, "dynamic": dyn, "static": P * t, "total": dyn + P * t}
    measured = {"time": obj[:, 0], "total": obj[:, 1], "dynamic": obj[:, 2], "static": obj[:, 1] - obj[:, 2]}
    return samples, measured


def dynamic_shift(dynamic_j: np.ndarray) -> float:
    """What to add to dynamic energies before taking logs: 0 while all are positive, else enough to
    put the lowest a tenth of the measured range above zero. Dynamic energy is measured energy minus
    the nominal static power x time, so a GPU drawing less than that (host-bound, at a low clock)
    reads slightly negative; a log floor would turn those points into extreme outliers."""
    lo = float(dynamic_j.min())
    if lo > 0:
        return 0.0
    span = float(dynamic_j.max()) - lo
    return -lo + 0.1 * (span if span > 0 else max(abs(lo), 1e-12))


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


def grid_ranks(run: SearchRun) -> np.ndarray:
    """(slot, SM level, clock level) of every candidate as integers, for grid neighbourhoods."""
    cols = [[c.slot for c in run.space], [c.sms for c in run.space], [c.freq_mhz for c in run.space]]
    out = np.zeros((len(run.space), 3), dtype=int)
    for j, col in enumerate(cols):
        levels = sorted(set(col))
        pos = {v: i for i, v in enumerate(levels)}
        out[:, j] = [pos[v] for v in col]
    return out


def pool_clocks(grid: np.ndarray, run: SearchRun, pool: np.ndarray) -> np.ndarray:
    """Clock level of each pool candidate for the per-clock passes; ``WHOLE_FRONT`` at a clock where
    every measurement failed (one the GPU cannot hold): against an empty front any prediction, even the
    worst measured, would improve it, and the pass would keep drawing picks there."""
    clocks = grid[pool, 2].copy()
    tried = set(grid[run.failed(), 2].tolist()) - set(grid[run.ok(), 2].tolist())
    if tried:
        clocks[np.isin(clocks, list(tried))] = WHOLE_FRONT
    return clocks


def near_front(run: SearchRun, grid: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Pool mask: same slot and at most one SM and one clock step from a measured (time, total) Pareto point."""
    ok = np.array(run.ok())
    obj = run.objectives(list(ok))
    f = grid[ok[pareto_mask(obj[:, 0], obj[:, 1])]]
    g = grid[pool]
    close = (g[:, None, 0] == f[None, :, 0]) & (np.abs(g[:, None, 1:] - f[None, :, 1:]).max(axis=2) <= 1)
    return close.any(axis=1)


def fill_batch(ctx: Context, plan: list[tuple[str, int]], k: int) -> tuple[list[int], list[str]]:
    """Run the passes for their counts; if some return fewer, the passes that still had picks to give
    fill the rest in turn (a pass that ran dry, e.g. ``local`` with no neighbours left, or one in
    ``hand_over`` with nothing predicted to improve, is skipped while another can pick)."""
    free = np.ones(len(ctx.pool), dtype=bool)
    picks: list[int] = []
    names: list[str] = []
    passes = {name: ACQUISITIONS.build(name) for name, _ in plan}
    dry: set[str] = set()
    queue = [(n, c) for n, c in plan if c > 0]
    for _round in range(3):
        for name, count in queue:
            if count <= 0 or not free.any():
                continue
            got = 0
            for p, _score in passes[name].select(ctx, count, free):
                if free[p]:
                    free[p] = False
                    picks.append(p)
                    names.append(name)
                    got += 1
            if got < count:
                dry.add(name)
        short = k - len(picks)
        live = [n for n, _ in plan if n not in dry]
        if not live and ctx.hand_over:  # no other pass takes the picks handed over: their passes fill the rest
            live = [n for n, _ in plan if n in ctx.hand_over]
            ctx = replace(ctx, hand_over=frozenset())
        if short <= 0 or not free.any() or not live:
            break
        queue = [(live[i % len(live)], 1) for i in range(short)]
    return picks[:k], names[:k]


def remeasure_near_ties(run: SearchRun, cfg: MBOConfig, budget: int) -> int:
    """Read again, one at a time, the setting ``remeasure_pick`` names, up to ``budget`` readings; stops
    once no setting is at stake by ``remeasure_stake``, or repeats read back exactly what they read
    before (no noise). Returns the readings taken."""
    taken = 0
    while taken < budget and run.remaining > 0:
        ok = run.ok()
        groups = [log_objectives(np.array([[m.time_s, m.energy_j] for m in run.readings[i] if not m.failed]))
                  for i in ok]
        sd, exact = pooled_noise(groups, np.asarray(cfg.noise_prior, dtype=float))
        pick = None if exact else remeasure_pick(log_objectives(run.objectives(ok)), run.counts(ok), sd,
                                                 cfg.remeasure_stake)
        if pick is None:
            break
        run.remeasure([ok[pick]], [{"pass": "remeasure"}])
        taken += 1
    return taken


EXPLORING = ("dynamic", "static", "uncertainty", "fastest", "spread")  # passes a handed-over pick may go to


def remeasure_handed_over(run: SearchRun, cfg: MBOConfig, plan: list[tuple[str, int]], picks: list[int],
                          names: list[str], notes: list[dict]) -> tuple[list[int], list[dict]]:
    """Re-measure near-ties in place of ``remeasure_handed`` of the picks the total-energy pass handed
    over (nothing left it predicts to improve the front): the last exploring picks are dropped for
    the readings taken. A tight budget never hands over, so it never re-measures this way."""
    handed = max(0, sum(c for n, c in plan if n == "total") - names.count("total"))
    want = int(round(cfg.remeasure_handed * handed))
    taken = remeasure_near_ties(run, cfg, want) if want > 0 else 0
    drop: set[int] = set()
    for j in reversed(range(len(picks))):
        if len(drop) < taken and names[j] in EXPLORING:
            drop.add(j)
    keep = [j for j in range(len(picks)) if j not in drop]
    return [picks[j] for j in keep], [notes[j] for j in keep]


def posterior_estimates(run: SearchRun, cfg: MBOConfig, seed: int) -> np.ndarray | None:
    """(time, total, dynamic) of every successful setting by the surrogate's centre fitted on all of
    them (``search.report=posterior``); None for ``readings`` or too few settings to fit."""
    ok = run.ok()
    if FrontReport(cfg.report) is not FrontReport.posterior or len(ok) < MIN_FIT_POINTS:
        return None
    samples, _ = predict(run, cfg.surrogate, np.array(ok), seed)
    return np.column_stack([samples[k].mean(axis=0) for k in ("time", "total", "dynamic")])


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
        prior = Prior.of(run.index, problem.prior) if problem.prior else None
        if prior is not None and len(prior) and not problem.initial:
            warm_start(run, cfg, prior)
        else:
            start(run, cfg)
        if cfg.corners and not (prior is not None and len(prior)):  # a prior brackets the slots already
            measure_corners(run)
        held = int(round(cfg.remeasure * run.budget))  # kept for re-measurements before the last batch
        run.held = held
        batch = round_batch(cfg, run.remaining)
        grid = grid_ranks(run)
        for pool, k in run.batch_pools(batch):
            if run.held and k >= run.remaining:  # the last batch is next: re-measure first, then release
                run.held = 0
                remeasure_near_ties(run, cfg, held)
                k = min(batch, run.remaining, len(pool))
                if k <= 0:
                    break
            if widened_at_random(run, pool, k, rng):  # nothing to model yet
                continue
            timer = Timer()
            samples, measured = predict(run, cfg.surrogate, pool, problem.seed + 7919 * run.batches)
            fit_s = timer.lap()
            counts = np.bincount(grid[run.order, 0], minlength=int(grid[:, 0].max()) + 1)  # failed ones too
            ctx = Context(pool, samples, measured, kappa=cfg.kappa, greedy=cfg.greedy, ref_margin=cfg.ref_margin,
                          expected=frozenset(PassName(p).value for p in cfg.expected),
                          per_clock=frozenset(PassName(p).value for p in cfg.per_clock),
                          hand_over=frozenset(PassName(p).value for p in cfg.hand_over),
                          clock_of=pool_clocks(grid, run, pool), measured_clock=grid[run.ok(), 2],
                          near=near_front(run, grid, pool), slot_of=grid[pool, 0],
                          sparse=counts[grid[pool, 0]] < cfg.min_per_slot, rng=rng)
            n_local = int(round(cfg.final_local * k)) if k >= run.remaining else 0  # last batch: exploit
            n_cov = 0
            if cfg.min_per_slot > 0 and ctx.sparse.any():
                n_cov = min(len(np.unique(ctx.slot_of[ctx.sparse])), int(np.floor(cfg.coverage_share * k)),
                            k - n_local)
            rest = k - n_local - n_cov
            plan = [(n, c) for n, c in (("local", n_local), ("coverage", n_cov)) if c > 0]
            plan += pass_shares(cfg, rest) if rest > 0 else []
            local, names = fill_batch(ctx, plan, k)
            if not local:  # the batch policies found nothing to pick: the chosen passes fill it
                local, names = fill_batch(ctx, pass_shares(cfg, k), k)
            if not local:  # nothing left that any pass would pick (e.g. search.passes=[local] alone)
                break
            acq_s = timer.lap()
            gain = predicted_gain(ctx, local)
            notes = [annotate(ctx, p, n) for p, n in zip(local, names)]
            if cfg.stop_gain > 0 and gain < cfg.stop_gain:  # not worth measuring: record nothing more
                break
            local, notes = remeasure_handed_over(run, cfg, plan, local, names, notes)
            run.evaluate(pool[local], notes)
            run.finish_batch(gain, notes, fit_s=fit_s, acq_s=acq_s)
        if run.held:  # the budget ran out in the corners or the design: re-measure with what is held
            held, run.held = run.held, 0
            remeasure_near_ties(run, cfg, held)
        self.timings = run.timings
        return run.result(posterior_estimates(run, cfg, problem.seed + 7919 * run.batches))
