"""The one way config classes report numbers outside their bounds: ``<prefix><name>: must be ..., got <value>``."""
from __future__ import annotations

import math
from typing import Any, Iterable


MAX_SEED = 2**32 - 1  # numpy's RandomState and Optuna's samplers take 32-bit seeds; xgboost fails past 64 bits


def out_of_bounds(cfg: Any, prefix: str = "", *, positive: Iterable[str] = (), nonnegative: Iterable[str] = (),
                  at_least_one: Iterable[str] = ()) -> list[str]:
    """One problem line per field outside its bound (None means unset and passes), fields in order.
    Infinity is outside every bound: a window, wait or rate of ``inf`` is no setting (a window of
    inf executions overflows, a timeout of inf never ends)."""
    rules = [(n, lambda v: v > 0, "> 0") for n in positive]
    rules += [(n, lambda v: v >= 0, ">= 0") for n in nonnegative]
    rules += [(n, lambda v: v >= 1, ">= 1") for n in at_least_one]
    out = []
    for name, ok, text in rules:
        value = getattr(cfg, name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            out.append(f"{prefix}{name}: must be a finite number {text}, got {value}")
        elif not ok(value):
            out.append(f"{prefix}{name}: must be {text}, got {value}")
    return out
