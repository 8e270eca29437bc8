"""What a plan costs in money and carbon: the energy its GPUs draw, priced and weighed by the grid.

Per iteration a plan takes ``t`` seconds and ``E`` joules on all the job's ``G`` GPUs, so it draws
``E / t`` watts for ``N x t`` seconds over a job of ``N`` iterations. Its cost is

    energy (kWh) x price per kWh  +  G x job hours x price per GPU-hour  +  carbon (kg) x price per kg,

with carbon = energy (kWh) x grid intensity (g/kWh). Constants, or hourly profiles (CSV: ``hour`` (ISO
8601, the hour's start) and ``energy_per_kwh`` or ``g_per_kwh``), integrated over the hours the job
spans from ``plan.start``; a profile needs the job's length (``plan.iterations``). The runtime runs one
plan for a whole job (it cannot switch plans at iteration boundaries), so one plan is chosen for the
job, the one of least cost over its own span.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

J_PER_KWH = 3.6e6
HOUR = timedelta(hours=1)


@dataclass
class PriceConfig:
    """What money a plan costs: its energy and its GPU time."""

    energy_per_kwh: float = 0.0  # currency per kWh the job's GPUs draw
    gpu_hour: float = 0.0  # currency per GPU-hour (rent, depreciation)
    profile: Optional[str] = None  # CSV of hourly energy prices (hour, energy_per_kwh): replaces energy_per_kwh


@dataclass
class CarbonConfig:
    """What carbon a plan emits, and what it is priced at in the cost (0: reported, not priced)."""

    g_per_kwh: float = 0.0  # grid carbon intensity, g CO2e per kWh
    price_per_kg: float = 0.0  # currency per kg CO2e
    profile: Optional[str] = None  # CSV of hourly intensities (hour, g_per_kwh): replaces g_per_kwh


@dataclass(frozen=True)
class Cost:
    """A plan's cost over ``iterations`` iterations."""

    iterations: int
    energy_kwh: float
    gpu_hours: float
    carbon_g: float
    energy_cost: float
    gpu_cost: float
    carbon_cost: float

    @property
    def total(self) -> float:
        return self.energy_cost + self.gpu_cost + self.carbon_cost


class ProfileError(ValueError):
    """An hourly profile that cannot be read, has gaps, or does not cover the job; one line naming the key."""


@lru_cache(maxsize=8)
def load_profile(path: str, column: str, key: str) -> tuple[datetime, tuple[float, ...]]:
    """(first hour, one value per consecutive hour) of a CSV profile; ProfileError on gaps or bad rows."""
    p = Path(path)
    try:
        with p.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as err:
        raise ProfileError(f"{key}: cannot read {path}: {err.strerror or err}") from None
    if not rows or "hour" not in rows[0] or column not in rows[0]:
        raise ProfileError(f"{key}: {path} needs the columns hour and {column}")
    try:
        points = sorted((_hour(r["hour"]), float(r[column])) for r in rows)
    except (TypeError, ValueError) as err:
        raise ProfileError(f"{key}: {path}: {err}") from None
    first = points[0][0]
    for i, (when, value) in enumerate(points):
        if when != first + i * HOUR:
            missing = first + i * HOUR
            raise ProfileError(f"{key}: {path} has a gap: no value for {missing.isoformat()} (one row per hour)")
        if not (math.isfinite(value) and value >= 0):
            raise ProfileError(f"{key}: {path}: {column} must be >= 0, got {value} at {when.isoformat()}")
    return first, tuple(v for _, v in points)


def _time(text: str) -> datetime:
    """An ISO 8601 time as naive local time (an offset is converted, so profiles and starts compare)."""
    when = datetime.fromisoformat(str(text).strip())
    return when if when.tzinfo is None else when.astimezone().replace(tzinfo=None)


def _hour(text: str) -> datetime:
    when = _time(text)
    if when.minute or when.second or when.microsecond:
        raise ValueError(f"hour {text!r} is not the start of an hour")
    return when


def _mean_over(profile: tuple[datetime, tuple[float, ...]], start: datetime, seconds: float, key: str) -> float:
    """The profile's time-weighted mean over [start, start + seconds]; ProfileError if not covered."""
    first, values = profile
    end = start + timedelta(seconds=seconds)
    last = first + len(values) * HOUR
    if start < first or end > last:
        raise ProfileError(f"{key}: covers {first.isoformat()} to {last.isoformat()}, the job runs "
                           f"{start.isoformat()} to {end.isoformat()}")
    if seconds <= 0:
        return values[int((start - first) / HOUR)]
    total, t = 0.0, start
    while t < end:
        i = int((t - first) / HOUR)
        stop = min(end, first + (i + 1) * HOUR)
        total += values[i] * (stop - t).total_seconds()
        t = stop
    return total / seconds


def plan_cost(time_s: float, energy_j: float, gpus: int, cfg: Any) -> Cost:
    """A plan's cost over the job (``cfg.iterations``) or one iteration, from its predicted time and energy;
    ``cfg`` is the plan section (``price``, ``carbon``, ``iterations``, ``start``)."""
    n = int(cfg.iterations or 1)
    seconds = n * time_s
    kwh = n * energy_j / J_PER_KWH
    start = _time(cfg.start) if cfg.start else None
    price = _value(cfg.price.profile, "energy_per_kwh", "plan.price.profile", cfg.price.energy_per_kwh, start, seconds)
    grid = _value(cfg.carbon.profile, "g_per_kwh", "plan.carbon.profile", cfg.carbon.g_per_kwh, start, seconds)
    carbon_g = kwh * grid
    gpu_hours = gpus * seconds / 3600.0
    return Cost(n, kwh, gpu_hours, carbon_g, kwh * price, gpu_hours * cfg.price.gpu_hour,
                carbon_g / 1000.0 * cfg.carbon.price_per_kg)


def _value(profile: Optional[str], column: str, key: str, constant: float, start: Optional[datetime],
           seconds: float) -> float:
    if not profile:
        return float(constant)
    assert start is not None  # validated: a profile comes with plan.start
    return _mean_over(load_profile(str(profile), column, key), start, seconds, key)


def cost_problems(cfg: Any) -> list[str]:
    """Config-time rules of the cost section, one line each (the profiles' contents are read too)."""
    out = []
    for key, value in (("plan.price.energy_per_kwh", cfg.price.energy_per_kwh), ("plan.price.gpu_hour", cfg.price.gpu_hour),
                       ("plan.carbon.g_per_kwh", cfg.carbon.g_per_kwh),
                       ("plan.carbon.price_per_kg", cfg.carbon.price_per_kg)):
        if not (math.isfinite(value) and value >= 0):
            out.append(f"{key}: must be a price or intensity >= 0, got {value}")
    if cfg.iterations is not None and cfg.iterations < 1:
        out.append(f"plan.iterations: must be >= 1, got {cfg.iterations}")
    profiles = [(k, p, c) for k, p, c in (("plan.price.profile", cfg.price.profile, "energy_per_kwh"),
                                          ("plan.carbon.profile", cfg.carbon.profile, "g_per_kwh")) if p]
    if profiles and cfg.iterations is None:
        out.append(f"plan.iterations: {profiles[0][0]} prices hours, so the job's length is needed: set "
                   "plan.iterations")
    if profiles and not cfg.start:
        out.append(f"plan.start: {profiles[0][0]} is hourly, so the job's start is needed (ISO 8601, e.g. "
                   "plan.start=2026-12-08T09:00)")
    if cfg.start:
        try:
            _time(cfg.start)
        except ValueError as err:
            out.append(f"plan.start: not an ISO 8601 time ({err})")
    for key, path, column in profiles:
        try:
            load_profile(str(path), column, key)
        except ProfileError as err:
            out.append(str(err))
    return out


def describe(cost: Cost, cfg: Any) -> dict[str, Any]:
    """The cost as plain numbers for summary.json and the terminal."""
    return {"iterations": cost.iterations, "total": cost.total, "energy_cost": cost.energy_cost,
            "gpu_cost": cost.gpu_cost, "carbon_cost": cost.carbon_cost, "energy_kwh": cost.energy_kwh,
            "gpu_hours": cost.gpu_hours, "carbon_kg": cost.carbon_g / 1000.0,
            "per": "job" if cfg.iterations else "iteration"}
