"""Net savings: the energy a run's own measurements burned, and after how many iterations a plan pays it back.

A search costs GPU time, and GPU time costs energy. Each journal row took its GPU-seconds on the GPUs
one measurement occupies (the comm kernel's group: tp x cp; one GPU for residual ops): its windows at
the energy they read, the rest of its time (cooldowns, settling, warm-up and calibration runs) at the
GPU's idle power, a slight undercount of the warm-up runs. Every row of the run's journal counts,
those a resume answered too: the plan rests on all of them. The plan pays that back after
``cost / (saving per iteration)`` iterations, against Megatron (its reference iteration) and against
Megatron + Perseus (its least-energy point within the plan's time, else its fastest point). A plan that
saves nothing never pays back (None).
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from kareus.types import Measurement


def row_energy_j(m: Measurement, gpu_seconds: float, gpus: int, idle_power_w: float) -> float:
    """One journal row's energy on all the GPUs it occupied."""
    windows = [r for r in m.readings if r.executions and math.isfinite(r.energy_j) and math.isfinite(r.time_s)]
    read_j = sum(r.energy_j * r.executions for r in windows)
    read_s = sum(r.time_s * r.executions for r in windows)
    return gpus * (read_j + idle_power_w * max(0.0, gpu_seconds - read_s))


def measurement_energy_j(entries: Iterable[tuple[Measurement, float]], group_sizes: dict[str, int],
                         idle_power_w: float) -> float:
    """The energy every row of a journal burned (``entries``: (measurement, GPU-seconds) per row)."""
    return sum(row_energy_j(m, s, group_sizes.get(m.candidate.partition, 1), idle_power_w) for m, s in entries)


def payback_iterations(cost_j: float, saving_per_iteration_j: float | None) -> int | None:
    """Iterations after which a per-iteration saving has paid back ``cost_j``; None if it saves nothing."""
    if saving_per_iteration_j is None or not saving_per_iteration_j > 0:
        return None
    return max(1, math.ceil(cost_j / saving_per_iteration_j))


def perseus_energy_at(time_s: float, points: Sequence[tuple[float, float]]) -> float | None:
    """Megatron + Perseus' energy per iteration at ``time_s``: its least-energy point within that time, else
    (the plan is faster than all of them) its fastest point; None without points."""
    if not points:
        return None
    within = [e for t, e in points if t <= time_s * (1 + 1e-9)]
    return min(within) if within else min(points)[1]
