"""Robust aggregation of repeated windows: median absolute deviation flags outliers."""
from __future__ import annotations

import math
from typing import Sequence

MAD_SCALE = 1.4826  # makes the MAD a consistent estimate of the standard deviation for normal noise
# With 3 or 4 values the MAD is about the smallest gap to the median, and one in three or four sets of
# normal draws would lose a good value (3 repeats: 29% per metric at 3.5 MADs): fewer are all kept.
MIN_VALUES = 5


def mad_outliers(values: Sequence[float], threshold: float) -> list[bool]:
    """True for values more than ``threshold`` scaled MADs from the median (needs ``MIN_VALUES``).

    With a zero MAD (most values identical) any value that differs from the median is an outlier.
    """
    n = len(values)
    if n < MIN_VALUES:
        return [False] * n
    med = _median(values)
    mad = MAD_SCALE * _median([abs(v - med) for v in values])
    if mad == 0:
        return [abs(v - med) > 1e-12 * max(1.0, abs(med)) for v in values]
    return [abs(v - med) / mad > threshold for v in values]


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        return math.nan
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


median = _median
