"""Time-energy Pareto frontiers and their exact 2-D hypervolume (both objectives minimised)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from kareus.types import FrontierPoint

LIMIT_TOL = 1e-9  # relative slack on a time or energy limit: a plan at the limit meets it, float noise aside


def within_limit(value: float, limit: float) -> bool:
    """Whether ``value`` meets a time or energy ``limit`` (a deadline, a budget, a time compared at)."""
    return value <= limit * (1 + LIMIT_TOL)


def pareto_mask(times: Sequence[float], energies: Sequence[float]) -> np.ndarray:
    """Boolean mask of the non-dominated finite points (of equal points the first is kept). O(n log n)."""
    t = np.asarray(times, dtype=float)
    e = np.asarray(energies, dtype=float)
    mask = np.zeros(len(t), dtype=bool)
    finite = np.flatnonzero(np.isfinite(t) & np.isfinite(e))
    if len(finite) == 0:
        return mask
    order = finite[np.lexsort((e[finite], t[finite]))]  # by time, then energy; stable for ties
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], e[order][:-1]]))
    mask[order[e[order] < best_before]] = True
    return mask


def hypervolume_2d(times: Sequence[float], energies: Sequence[float], ref: tuple[float, float]) -> float:
    """Area dominated by the points inside the box bounded by ``ref`` (moocore, the vetted base);
    points at or beyond ref, or not finite, contribute nothing."""
    import moocore

    p = np.column_stack([np.asarray(times, dtype=float), np.asarray(energies, dtype=float)])
    r = np.asarray(ref, dtype=float)
    p = p[np.all(np.isfinite(p), axis=1) & np.all(p < r, axis=1)]
    return float(moocore.hypervolume(p, ref=r)) if len(p) else 0.0


def hypervolume_ratio(hypervolume: float, ref: tuple[float, float] | None) -> float | None:
    """``hypervolume`` as the share of the rectangle from (0 s, 0 J) to ``ref`` that a front dominates.

    Unitless and within 0..1 (1 only for a zero-time, zero-energy point), so a person can read it
    without knowing the reference's scale; values are comparable only under the same ``ref``.
    None without a positive, finite reference.
    """
    if ref is None:
        return None
    area = float(ref[0]) * float(ref[1])
    if not (np.isfinite(area) and area > 0 and ref[0] > 0):
        return None
    return float(hypervolume) / area


@dataclass(frozen=True)
class Frontier:
    """Pareto points sorted by time (energy strictly falls along it). ``objective`` names the energy."""

    points: tuple[FrontierPoint, ...]
    objective: str = "total"

    @classmethod
    def from_points(cls, points: Iterable[FrontierPoint], objective: str = "total") -> "Frontier":
        pts = list(points)
        mask = pareto_mask([p.time_s for p in pts], [p.energy_j for p in pts])
        kept = sorted((p for p, m in zip(pts, mask) if m), key=lambda p: (p.time_s, p.energy_j))
        return cls(tuple(kept), objective)

    @classmethod
    def from_arrays(cls, times: Sequence[float], energies: Sequence[float], payloads: Sequence[Any] | None = None,
                    objective: str = "total") -> "Frontier":
        payloads = payloads if payloads is not None else [None] * len(times)
        return cls.from_points((FrontierPoint(float(t), float(e), p) for t, e, p in zip(times, energies, payloads)),
                               objective)

    def __len__(self) -> int:
        return len(self.points)

    def __iter__(self):
        return iter(self.points)

    @property
    def times(self) -> np.ndarray:
        return np.array([p.time_s for p in self.points])

    @property
    def energies(self) -> np.ndarray:
        return np.array([p.energy_j for p in self.points])

    def hypervolume(self, ref: tuple[float, float]) -> float:
        return hypervolume_2d(self.times, self.energies, ref)

    def fastest(self) -> FrontierPoint:
        return self.points[0]

    def cheapest(self) -> FrontierPoint:
        return self.points[-1]
