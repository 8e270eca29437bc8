"""Measurement noise in a search: which settings to read again, and the front a search reports.

A front picked from single readings keeps the settings noise made look good, and a lucky reading
pushes a setting of the true front off it. Two remedies, both options of ``search=mbo`` (off by
default: see docs/search.md, "Measurement noise"):

- re-measurement (``search.remeasure``, ``search.remeasure_handed``): budget goes to reading again
  the setting most at stake: the chance that its mean reading puts it on the wrong side of the front
  (drawing each setting's true log time and energy about its mean reading), times the share of the
  front's hypervolume it holds there; of it and the setting that decides its side, the one with fewer
  readings. A setting's value becomes the mean of its readings. The noise is the pooled spread of the
  repeated readings in log time and log energy, with ``noise_prior`` as a prior worth ``PRIOR_DOF``
  repeats; once repeated readings came back identical (a lookup, a deterministic backend) nothing is
  read again;
- the posterior front (``search.report=posterior``): the front is picked by the surrogate's centre
  at the measured settings, which weighs each reading against its neighbours.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kareus.frontier import pareto_mask
from kareus.search.hv import hypervolume, nondominated

PRIOR_DOF = 2.0  # the prior's weight in repeats' degrees of freedom


def log_objectives(obj: np.ndarray) -> np.ndarray:
    """(time, total energy) of ``SearchRun.objectives`` rows in logs: noise is relative."""
    return np.log(np.maximum(obj[:, :2], 1e-300))


def pooled_noise(groups: Sequence[np.ndarray], prior: float) -> tuple[np.ndarray, bool]:
    """Per objective, the sd of one reading in log units: the repeats' pooled spread, shrunk towards
    ``prior``; and whether every repeat so far read exactly what its setting read before (no noise
    to average away). ``groups``: each setting's (readings, 2) log (time, energy), one or more rows."""
    ss, dof = np.zeros(2), 0
    for g in groups:
        if len(g) > 1:
            ss += ((g - g.mean(axis=0)) ** 2).sum(axis=0)
            dof += len(g) - 1
    sd = np.sqrt((PRIOR_DOF * prior**2 + ss) / (PRIOR_DOF + dof))
    return sd, dof > 0 and not ss.any()


def margins(points: np.ndarray, counts: np.ndarray, sd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per setting, how far its mean reading is from changing sides of the front, in standard deviations
    of the difference from the setting that decides it, and that setting. A front setting's distance is
    to the nearest other setting dominating it, a dominated one's to escaping its last dominator.
    ``points``: (n, 2) log (time, energy); ``counts``: readings per setting; ``sd``: one reading's sd."""
    n = len(points)
    front = pareto_mask(points[:, 0], points[:, 1])
    scale = sd[None, None, :] * np.sqrt(1.0 / counts[:, None, None] + 1.0 / counts[None, :, None])  # (i, j, obj)
    diff = (points[None, :, :] - points[:, None, :]) / scale  # j - i, per objective
    out, partner = np.full(n, np.inf), np.full(n, -1)
    for i in range(n):
        others = np.arange(n) != i
        if front[i]:  # j dominates i once it is better in both: the larger of the two gaps
            need = np.where(others, diff[i].max(axis=1), np.inf)
            j = int(np.argmin(need))
        else:  # i escapes j once it is better in one: the smaller gap, for the hardest dominator
            dom = others & np.all(diff[i] <= 0, axis=1)
            need = np.where(dom, (-diff[i]).min(axis=1), -np.inf)
            j = int(np.argmax(need))
        out[i], partner[i] = abs(float(need[j])), j
    return out, partner


def contributions(points: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Each point's exclusive hypervolume (what the front loses without it; 0 off the front)."""
    out = np.zeros(len(points))
    idx = np.flatnonzero(pareto_mask(points[:, 0], points[:, 1]))
    idx = idx[np.argsort(points[idx, 0])]
    t = np.append(points[idx, 0], ref[0])
    e = np.concatenate([[ref[1]], points[idx, 1]])
    out[idx] = np.clip(t[1:] - t[:-1], 0, None) * np.clip(e[:-1] - e[1:], 0, None)
    return out


def at_stake(points: np.ndarray, counts: np.ndarray, sd: np.ndarray, draws: int = 64,
             seed: int = 0) -> np.ndarray:
    """Per setting, the chance its mean reading puts it on the wrong side of the front times the
    hypervolume share it holds when on the front, by drawing each setting's true (log) values about its
    mean reading (sd / sqrt(readings)); in the frame where the measured front spans [0, 1]."""
    front = points[pareto_mask(points[:, 0], points[:, 1])]
    lo, span = front.min(axis=0), np.maximum(np.ptp(front, axis=0), 1e-12)
    ref = np.full(2, 1.1)
    rng = np.random.default_rng(seed)
    on, held = np.zeros(len(points)), np.zeros(len(points))
    for _ in range(draws):
        drawn = points + rng.standard_normal(points.shape) * sd[None, :] / np.sqrt(counts[:, None])
        c = contributions((drawn - lo) / span, ref)
        on += c > 0
        held += c
    p = on / draws
    whole = hypervolume(nondominated((front - lo) / span), ref)
    return np.minimum(p, 1 - p) * np.where(on > 0, held / np.maximum(on, 1), 0.0) / max(whole, 1e-12)


def remeasure_pick(points: np.ndarray, counts: np.ndarray, sd: np.ndarray, least: float) -> int | None:
    """Position of the setting to read again: of the setting most at stake (``at_stake``, at least
    ``least``) and the one that decides its side (``margins``), the one with fewer readings (the front
    side on a tie: a lucky front reading hides the settings it seems to dominate); None when no
    setting is that much at stake."""
    if len(points) < 2:
        return None
    stake = at_stake(points, counts, sd)
    i = int(np.argmax(stake))
    _dist, partner = margins(points, counts, sd)
    if not stake[i] >= least or partner[i] < 0:
        return None
    j = int(partner[i])
    front = pareto_mask(points[:, 0], points[:, 1])
    if counts[i] != counts[j]:
        return i if counts[i] < counts[j] else j
    return i if front[i] else j
