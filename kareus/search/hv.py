"""Exact 2-D hypervolume, hypervolume improvement (HVI) and IGD+ for minimised (time, energy) pairs.

``hypervolume`` is the project's one hypervolume (kareus.frontier, on moocore). ``hvi`` is our vectorised sweep:
the improvement of every candidate, each added alone to the front, in one (m x k) array operation.
moocore's ``hv_contributions`` is not a substitute: it scores points *within* a set (and with
``ignore_dominated=True`` a candidate that dominates front points gets its own exclusive part only),
whereas HVI is hv(front + c) - hv(front).
"""
from __future__ import annotations

import numpy as np

from kareus.frontier import hypervolume_2d, pareto_mask


def _as_points(points) -> np.ndarray:
    p = np.asarray(points, dtype=float)
    return p.reshape(-1, 2)


def nondominated(points) -> np.ndarray:
    """The non-dominated, finite rows of ``points`` sorted by the first objective (duplicates once)."""
    p = _as_points(points)
    p = p[pareto_mask(p[:, 0], p[:, 1])]
    return p[np.lexsort((p[:, 1], p[:, 0]))]


def hypervolume(points, ref) -> float:
    """Area dominated by ``points`` (rows of time, energy) inside the box bounded by ``ref``."""
    p = _as_points(points)
    return hypervolume_2d(p[:, 0], p[:, 1], ref)


def hvi(candidates, front, ref) -> np.ndarray:
    """HVI of each candidate row against ``front``: hv(front + c) - hv(front), exact, vectorised.

    The front's attainment surface is a staircase s(x); the candidate adds the integral over
    x in [cx, rx] of max(0, min(s(x), ry) - cy). With the front sorted, s is constant on k+1 segments.
    """
    c = _as_points(candidates)
    r = np.asarray(ref, dtype=float)
    f = nondominated(front)
    f = f[np.all(f < r, axis=1)]
    # segment j spans [b_j, b_{j+1}) with height h_j; before the first front point the height is ry
    bounds = np.concatenate(([-np.inf], f[:, 0], [r[0]]))
    heights = np.concatenate(([r[1]], f[:, 1]))
    cx, cy = c[:, :1], c[:, 1:2]
    lo = np.maximum(bounds[None, :-1], cx)
    hi = bounds[None, 1:]
    width = np.clip(hi - lo, 0.0, None)
    height = np.clip(heights[None, :] - cy, 0.0, None)
    out = np.sum(width * height, axis=1)
    out[~np.all(np.isfinite(c), axis=1)] = 0.0
    return out


def igd_plus(approx, reference) -> float:
    """IGD+ (Ishibuchi et al. 2015): mean over reference points of the dominance-aware distance to
    the nearest approximation point; 0 when the approximation covers the reference front."""
    a = _as_points(approx)
    z = _as_points(reference)
    if len(z) == 0:
        return 0.0
    if len(a) == 0:
        return float("inf")
    d = np.clip(a[None, :, :] - z[:, None, :], 0.0, None)
    return float(np.mean(np.min(np.sqrt(np.sum(d * d, axis=2)), axis=1)))


SPAN_TOL = 1e-9  # a front spanning less than this share of its magnitude spans nothing


def normalise(points, ideal, nadir) -> np.ndarray:
    """Scale so that ``ideal`` maps to 0 and ``nadir`` to 1 in each objective. An objective whose front
    spans nothing (one point, or points a rounding error apart: a host-bound partition's settings all
    take the same time) is scaled by its own magnitude, so a score never depends on its unit, nor on
    which setting rounding made fastest."""
    p = _as_points(points)
    ideal = np.asarray(ideal, dtype=float)
    nadir = np.asarray(nadir, dtype=float)
    span = nadir - ideal
    tiny = span <= SPAN_TOL * np.maximum(np.abs(ideal), np.abs(nadir))
    span = np.where(~tiny, span, np.where(np.abs(ideal) > 0, np.abs(ideal), 1.0))
    return (p - ideal) / span
