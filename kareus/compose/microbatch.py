"""Partition frontiers -> one instruction's (time, dynamic energy) options, one clock per instruction.

At each clock, every partition type of the instruction contributes its Pareto set at that clock times
its count (all occurrences of a type share one configuration); the sets are combined pairwise with a
Minkowski sum that is pruned after every step, so the full cross product is never formed. The
non-partition work of the instruction (profiled by the caller per clock) is added, and the options of
all clocks are merged and pruned again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from kareus.frontier import pareto_mask
from kareus.types import Candidate, InstructionWork, Measurement


@dataclass(frozen=True)
class InstructionOption:
    """One way to run a whole instruction: its clock and each partition type's configuration."""

    time_s: float
    dynamic_energy_j: float
    freq_mhz: int
    choices: Mapping[str, Candidate] = field(default_factory=dict, compare=False)


def pareto_indices(times: Sequence[float], energies: Sequence[float]) -> np.ndarray:
    """Indices of the non-dominated points, sorted by time ascending (energy then falls)."""
    t = np.asarray(times, dtype=float)
    e = np.asarray(energies, dtype=float)
    idx = np.flatnonzero(pareto_mask(t, e))
    return idx[np.lexsort((e[idx], t[idx]))]


def minkowski_pareto(a_t: np.ndarray, a_e: np.ndarray, b_t: np.ndarray, b_e: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pareto set of {a + b}: returns (times, energies, index into a, index into b), sorted by time.

    Both inputs should already be Pareto sets (small); only their pairwise sums are formed.
    """
    t = (np.asarray(a_t, float)[:, None] + np.asarray(b_t, float)[None, :]).ravel()
    e = (np.asarray(a_e, float)[:, None] + np.asarray(b_e, float)[None, :]).ravel()
    keep = pareto_indices(t, e)
    ia, ib = np.divmod(keep, len(b_t))
    return t[keep], e[keep], ia, ib


def _type_points(ms: Sequence[Measurement], clock: int, count: int
                 ) -> tuple[np.ndarray, np.ndarray, list[Candidate]]:
    """Pareto set of one partition type's usable measurements at ``clock``, scaled by its count."""
    ok = [m for m in ms if not m.failed and m.candidate.freq_mhz == clock
          and np.isfinite(m.time_s) and np.isfinite(m.dynamic_energy_j)]
    t = np.array([m.time_s for m in ok], dtype=float) * count
    e = np.array([m.dynamic_energy_j for m in ok], dtype=float) * count
    keep = pareto_indices(t, e)
    return t[keep], e[keep], [ok[i].candidate for i in keep]


def compose_clock(work: InstructionWork, measurements: Mapping[str, Sequence[Measurement]], clock: int,
                  residual: tuple[float, float]) -> list[InstructionOption]:
    """The Pareto options of one instruction at one clock ([] when a partition type has no data there)."""
    t = np.array([residual[0]], dtype=float)
    e = np.array([residual[1]], dtype=float)
    picks: list[dict[str, Candidate]] = [{}]
    for key, count in work.partitions:
        if count <= 0:
            continue
        pt, pe, cands = _type_points(measurements.get(key, ()), clock, count)
        if len(pt) == 0:
            return []
        t, e, ia, ib = minkowski_pareto(t, e, pt, pe)
        picks = [{**picks[i], key: cands[j]} for i, j in zip(ia, ib)]
    return [InstructionOption(float(ti), float(ei), int(clock), p) for ti, ei, p in zip(t, e, picks)]


def compose_instruction(work: InstructionWork, measurements: Mapping[str, Sequence[Measurement]],
                        residual: Mapping[int, tuple[float, float]],
                        per_clock: bool = False) -> list[InstructionOption]:
    """Pareto options (time, dynamic energy) of one instruction over all clocks, sorted by time.

    ``residual[clock] = (time_s, dynamic_energy_j)`` is the measured non-partition work at that clock.
    A clock is skipped when some partition type has no measurement there, or when the instruction has
    residual ops but no residual measurement at that clock (nothing is guessed).
    ``per_clock``: keep each clock's Pareto options, not only those of the whole set. Where clock
    switches cost time, an option beaten at another clock can still be the best one: it lets a stage
    stay at one clock.
    """
    clocks: set[int] = set(int(c) for c in residual)
    for key, count in work.partitions:
        if count > 0:
            clocks.update(int(m.candidate.freq_mhz) for m in measurements.get(key, ()) if not m.failed)
    options: list[InstructionOption] = []
    for clock in sorted(clocks):
        if clock in residual:
            res = residual[clock]
        elif work.residual:
            continue
        else:
            res = (0.0, 0.0)
        options.extend(compose_clock(work, measurements, clock, (float(res[0]), float(res[1]))))
    if not options:
        have = {k: sorted({m.candidate.freq_mhz for m in measurements.get(k, ()) if not m.failed})
                for k, _ in work.partitions}
        raise ValueError(f"instruction (stage {work.stage}, {work.direction.value}) has no clock at which every "
                         f"partition type (and the residual work) was measured; measured clocks: {have}, "
                         f"residual clocks: {sorted(residual)}")
    if per_clock:
        return sorted(options, key=lambda o: (o.time_s, o.dynamic_energy_j))
    keep = pareto_indices([o.time_s for o in options], [o.dynamic_energy_j for o in options])
    return [options[i] for i in keep]
