"""The drift test: did a partition's re-measured settings move beyond the noise of its readings?

Each sampled setting has the run's reading (one occasion: the profiler's aggregate, taken after other
settings heated the GPU as they did) and ``n_new`` fresh readings taken the same way, in rounds. Noise is
estimated from the fresh readings themselves: the pooled standard deviation of their logs around their
setting's mean, over every sampled setting of the check (relative noise is a property of the GPU and
the protocol, not of a partition, so pooling gives the estimate enough degrees of freedom). A
partition's shift is the mean over its settings of ``log(fresh mean / run's reading)``; under no drift
it is zero-mean with standard error ``s * sqrt((1/n_new + 1/n_old) / m)``, so ``shift / se`` follows
Student's t with the pooled degrees of freedom. A partition is flagged when, for time or energy, that two-sided test rejects at
``alpha`` Bonferroni-corrected over every (partition, metric) pair tested, *and* the shift exceeds
``min_shift`` (a change too small to matter to a plan is not worth a re-search). Under no drift the
chance that anything is flagged is thus at most ``alpha``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

METRICS = ("time", "energy")


@dataclass(frozen=True)
class Sample:
    """One re-measured setting: the run's reading and the fresh ones, per metric."""

    old: dict[str, float]  # metric -> the run's reading
    n_old: int  # occasions behind it (1: one measurement, whatever its windows)
    new: dict[str, list[float]]  # metric -> each fresh reading (their spread is the noise)
    new_value: dict[str, float]  # metric -> the fresh readings' mean


@dataclass(frozen=True)
class Shift:
    """A partition's verdict on one metric."""

    metric: str
    shift: float  # relative: exp(mean log ratio) - 1
    t: float
    p_value: float
    drifted: bool


def pooled_log_sd(samples: Sequence[Sample], metric: str) -> tuple[float, int]:
    """(standard deviation of log readings within a setting, degrees of freedom), pooled over samples."""
    ss, dof = 0.0, 0
    for s in samples:
        logs = [math.log(v) for v in s.new[metric] if v > 0 and math.isfinite(v)]
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        ss += sum((x - mean) ** 2 for x in logs)
        dof += len(logs) - 1
    return (math.sqrt(ss / dof) if dof else math.nan), dof


def log_shift(s: Sample, metric: str) -> float:
    """log(the fresh aggregate / the run's value): both by the same protocol (heat correction included)."""
    return math.log(s.new_value[metric] / s.old[metric])


def partition_shift(samples: Sequence[Sample], metric: str, sd: float, dof: int, alpha: float,
                   min_shift: float) -> Shift:
    """The two-sided t-test of a partition's mean log shift (``alpha`` already corrected by the caller)."""
    from scipy import stats

    shifts = [log_shift(s, metric) for s in samples]
    m = len(shifts)
    mean = sum(shifts) / m
    n_new = sum(len(s.new[metric]) for s in samples) / m
    n_old = sum(s.n_old for s in samples) / m
    se = sd * math.sqrt((1.0 / n_new + 1.0 / max(n_old, 1.0)) / m) if sd > 0 else math.nan
    if not (math.isfinite(se) and se > 0 and dof > 0):
        return Shift(metric, math.expm1(mean), math.nan, math.nan, False)
    t = mean / se
    p = float(2.0 * stats.t.sf(abs(t), dof))
    drifted = p < alpha and abs(math.expm1(mean)) > min_shift
    return Shift(metric, math.expm1(mean), t, p, drifted)


def verdicts(by_partition: dict[str, list[Sample]], alpha: float, min_shift: float) -> dict[str, list[Shift]]:
    """Each partition's shifts in time and energy, the level Bonferroni-corrected over all tests."""
    everything = [s for group in by_partition.values() for s in group]
    noise = {metric: pooled_log_sd(everything, metric) for metric in METRICS}
    tests = sum(1 for group in by_partition.values() if group) * len(METRICS)
    level = alpha / max(tests, 1)
    return {key: [partition_shift(group, metric, *noise[metric], level, min_shift) for metric in METRICS]
            for key, group in by_partition.items() if group}


def noise_levels(by_partition: dict[str, list[Sample]]) -> dict[str, float]:
    """The pooled relative noise of one window per metric (for the report)."""
    everything = [s for group in by_partition.values() for s in group]
    return {metric: math.expm1(pooled_log_sd(everything, metric)[0]) for metric in METRICS}
