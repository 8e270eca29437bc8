"""Acquisition passes: each fills its share of a batch from the unmeasured candidates.

HVI passes score the predicted (time, objective) point of every candidate by its hypervolume
improvement over the measured (time, objective) frontier, in objectives scaled by the observed
ranges. ``greedy`` passes add each pick to the front as predicted before scoring the next, so a batch
spreads along the frontier instead of piling onto one knee. Candidates with no predicted improvement
are ranked by how far they are from becoming non-dominated (additive epsilon), so a pass returns its
share, unless it is named in ``hand_over``: then it stops there and the other passes fill the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kareus.registry import ACQUISITIONS
from kareus.search.hv import hvi, nondominated


@dataclass
class Context:
    """Predictions for the pool and what is measured, in one place for every pass."""

    pool: np.ndarray  # candidate indices that may be picked
    samples: dict[str, np.ndarray]  # objective -> (members, len(pool)) predictions (time, total, dynamic, static)
    measured: dict[str, np.ndarray]  # objective -> measured values of the ok points (aligned)
    kappa: float = 1.0
    greedy: bool = True
    ref_margin: float = 0.1
    ref_factor: float | None = None  # if set: ref = factor x observed maxima (raw units), as the artifact does
    expected: frozenset[str] = frozenset()  # HVI passes that score the mean HVI over ensemble members (Monte-Carlo EHVI)
    per_clock: frozenset[str] = frozenset()  # HVI passes scored against the measured front at the candidate's clock
    hand_over: frozenset[str] = frozenset()  # HVI passes that stop picking once no candidate is predicted to improve
    clock_of: np.ndarray | None = None  # pool: clock of each candidate (needed by per_clock passes);
    # WHOLE_FRONT where only failures were measured at it: scored against the whole front, not an empty one
    measured_clock: np.ndarray | None = None  # clock of each measured point, aligned with ``measured``
    sparse: np.ndarray | None = None  # pool mask: the candidate's slot has too few measurements
    slot_of: np.ndarray | None = None  # pool: slot id of each candidate
    near: np.ndarray | None = None  # pool mask: within one SM/clock step of a measured Pareto point, same slot
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def mean(self, obj: str) -> np.ndarray:
        return self.samples[obj].mean(axis=0)

    def std(self, obj: str) -> np.ndarray:
        return self.samples[obj].std(axis=0)


def _frame(ctx: Context, obj: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lowest, highest, span) of the measured (time, ``obj``): the frame where measured ranges are 1."""
    mt, mo = ctx.measured["time"], ctx.measured[obj]
    lo = np.array([mt.min(), mo.min()])
    hi = np.array([mt.max(), mo.max()])
    return lo, hi, np.where(hi - lo > 0, hi - lo, np.maximum(np.abs(hi), 1e-12))


def _scaled(ctx: Context, obj: str, kappa: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate points, measured front and reference in the frame of ``_frame``."""
    mt, mo = ctx.measured["time"], ctx.measured[obj]
    ct = ctx.mean("time") - kappa * ctx.std("time")
    co = ctx.mean(obj) - kappa * ctx.std(obj)
    lo, hi, span = _frame(ctx, obj)
    cand = (np.column_stack([ct, co]) - lo) / span
    front = (np.column_stack([mt, mo]) - lo) / span
    if ctx.ref_factor is not None:
        ref = (ctx.ref_factor * hi - lo) / span
    else:
        ref = np.ones(2) + ctx.ref_margin
    return cand, front, ref


def _member_points(ctx: Context, obj: str) -> np.ndarray:
    """Every ensemble member's (time, objective) prediction in the frame of ``_frame``: (members, n, 2)."""
    lo, _hi, span = _frame(ctx, obj)
    pts = np.stack([ctx.samples["time"], ctx.samples[obj]], axis=2)
    return (pts - lo) / span


def _epsilon(cand: np.ndarray, front: np.ndarray) -> np.ndarray:
    """Each candidate's additive-epsilon distance to the front: the smallest equal shift in both
    objectives after which it weakly dominates some front point (0 if it already does). Ranks
    candidates by closeness to the front where none has hypervolume improvement."""
    f = nondominated(front)
    if len(f) == 0:
        return np.zeros(len(cand))
    d = np.max(cand[:, None, :] - f[None, :, :], axis=2)  # shift needed to escape each front point
    return np.clip(np.min(d, axis=1), 0.0, None)


WHOLE_FRONT = -1  # a candidate clock scored against the whole front (see ``Context.clock_of``)


def _by_clock(fn, cand: np.ndarray, cand_clock: np.ndarray | None, front: np.ndarray,
              front_clock: np.ndarray | None) -> np.ndarray:
    """``fn(candidates, front)`` of each candidate against the front of its own clock (all of it if
    no clocks are given, or for a candidate clock of ``WHOLE_FRONT``)."""
    if cand_clock is None or front_clock is None:
        return fn(cand, front)
    out = np.zeros(len(cand))
    for clock in np.unique(cand_clock):
        m = cand_clock == clock
        out[m] = fn(cand[m], front if clock == WHOLE_FRONT else front[front_clock == clock])
    return out


def _rank_pick(score: np.ndarray, tie: np.ndarray, k: int, free: np.ndarray) -> list[int]:
    """Top ``k`` positions by score (desc), ties by ``tie`` (asc), among ``free``."""
    pos = np.flatnonzero(free)
    order = np.lexsort((tie[pos], -score[pos]))
    return [int(p) for p in pos[order[:k]]]


class HVIPass:
    """Hypervolume improvement of the predicted (time, ``objective``) point; a pass named in
    ``ctx.expected`` scores the expected improvement over the ensemble members instead (members that
    place a candidate on the frontier pull it in: exploration), the others the improvement of the mean."""

    name = "total"
    objective = "total"

    def select(self, ctx: Context, k: int, free: np.ndarray) -> list[tuple[int, float]]:
        cand, front, ref = _scaled(ctx, self.objective, ctx.kappa)
        members = _member_points(ctx, self.objective) if self.name in ctx.expected else None
        per_clock = self.name in ctx.per_clock and ctx.clock_of is not None and ctx.measured_clock is not None
        cclk = ctx.clock_of if per_clock else None
        fclk = ctx.measured_clock if per_clock else None

        def improvement(pts: np.ndarray, fr: np.ndarray, fr_clk: np.ndarray | None) -> np.ndarray:
            return _by_clock(lambda c, f: hvi(c, f, ref), pts, cclk, fr, fr_clk)

        def score(fr: np.ndarray, fr_clk: np.ndarray | None) -> np.ndarray:
            if members is None:
                return improvement(cand, fr, fr_clk)
            return np.mean([improvement(m, fr, fr_clk) for m in members], axis=0)

        free = free.copy()
        hand_over = self.name in ctx.hand_over
        if not ctx.greedy:
            h = score(front, fclk)
            picks = _rank_pick(h, _by_clock(_epsilon, cand, cclk, front, fclk), k, free & (h > 0) if hand_over else free)
            return [(p, float(h[p])) for p in picks]
        out: list[tuple[int, float]] = []
        if not per_clock:
            front = nondominated(front)
        for _ in range(min(k, int(free.sum()))):
            h = score(front, fclk)
            h[~free] = -1.0
            if h.max() > 0:
                p = int(np.argmax(h))
            elif hand_over:  # nothing left to exploit: the batch's rest goes to the other passes
                break
            else:
                eps = _by_clock(_epsilon, cand, cclk, front, fclk)
                eps[~free] = np.inf
                p = int(np.argmin(eps))
            out.append((p, float(max(h[p], 0.0))))
            free[p] = False
            if per_clock:  # the pick joins its own clock's front (kept whole: hvi reduces it)
                front, fclk = np.vstack([front, cand[p]]), np.append(fclk, cclk[p])
            else:
                front = nondominated(np.vstack([front, cand[p]]))
        return out


@ACQUISITIONS.register("total")
class TotalHVI(HVIPass):
    """HVI in (time, total energy): the objective users pick plans by."""

    name = "total"
    objective = "total"


@ACQUISITIONS.register("dynamic")
class DynamicHVI(HVIPass):
    """HVI in (time, dynamic energy): what composition adds up across partitions."""

    name = "dynamic"
    objective = "dynamic"


@ACQUISITIONS.register("static")
class StaticHVI(HVIPass):
    """HVI in (time, static energy = static power x time): pulls toward the fastest settings."""

    name = "static"
    objective = "static"


def _spread(ctx: Context) -> np.ndarray:
    """Relative predictive spread of time and total energy."""
    out = np.zeros(len(ctx.pool))
    for obj in ("time", "total"):
        out += ctx.std(obj) / max(float(np.abs(ctx.measured[obj]).mean()), 1e-12)
    return out


@ACQUISITIONS.register("uncertainty")
class Uncertainty:
    """Largest spread among candidates whose optimistic (2 sigma) point could join the total frontier."""

    def select(self, ctx: Context, k: int, free: np.ndarray) -> list[tuple[int, float]]:
        cand, front, ref = _scaled(ctx, "total", 2.0)
        s = _spread(ctx)
        plausible = free & (hvi(cand, front, ref) > 0)
        picks = _rank_pick(s, -s, k, plausible)
        if len(picks) < k:
            rest = free.copy()
            rest[picks] = False
            picks += _rank_pick(s, -s, k - len(picks), rest)
        return [(p, float(s[p])) for p in picks]


@ACQUISITIONS.register("spread")
class Spread:
    """Largest predictive spread anywhere (the published artifact's exploration pass)."""

    def select(self, ctx: Context, k: int, free: np.ndarray) -> list[tuple[int, float]]:
        s = _spread(ctx)
        return [(p, float(s[p])) for p in _rank_pick(s, -s, k, free)]


@ACQUISITIONS.register("fastest")
class Fastest:
    """Lowest predicted time (the published artifact's third pass)."""

    def select(self, ctx: Context, k: int, free: np.ndarray) -> list[tuple[int, float]]:
        t = ctx.mean("time")
        return [(p, float(-t[p])) for p in _rank_pick(-t, t, k, free)]


@ACQUISITIONS.register("local")
class Local(HVIPass):
    """Exploitation: greedy total-energy HVI among the grid neighbours (same slot, one SM or clock
    step) of measured Pareto points; measured fronts are noisy and their neighbours are near-ties."""

    name = "local"
    objective = "total"

    def select(self, ctx: Context, k: int, free: np.ndarray) -> list[tuple[int, float]]:
        if ctx.near is None:
            return []
        return super().select(ctx, min(k, int((free & ctx.near).sum())), free & ctx.near)


@ACQUISITIONS.register("coverage")
class Coverage(HVIPass):
    """One candidate per under-measured slot (its best predicted total-energy HVI): a slot seen once
    or twice is judged by the model's guess of its level, so it gets a few guided looks first."""

    name = "coverage"
    objective = "total"

    def select(self, ctx: Context, k: int, free: np.ndarray) -> list[tuple[int, float]]:
        if ctx.sparse is None or ctx.slot_of is None:
            return []
        cand, front, ref = _scaled(ctx, self.objective, ctx.kappa)
        h = hvi(cand, nondominated(front), ref)
        eps = _epsilon(cand, front)
        mask = free & ctx.sparse
        out: list[tuple[int, float]] = []
        for slot in np.unique(ctx.slot_of[mask]):
            m = mask & (ctx.slot_of == slot)
            picks = _rank_pick(h, eps, 1, m)
            out += [(p, float(h[p])) for p in picks]
        out.sort(key=lambda x: (-x[1], eps[x[0]]))
        return out[:k]
