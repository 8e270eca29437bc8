"""Warm-started search (``search.warm_start=RUN_DIR`` or a list of them): a related run's journal as
prior knowledge.

A re-search after drift, or a search of a changed layout (another sequence length or microbatch
count), meets partitions whose (slot, SMs, clock) responses resemble those an earlier run measured.
Rows of that run's journal with this run's partition key and hardware (the journal's ``backend``
column, e.g. ``sim:a100``: rows of another GPU are skipped) become *prior points*:

- the initial design measures the prior's Pareto settings (time against total energy, then time
  against dynamic energy) instead of a Latin hypercube, so the first batch already lands near the
  front wherever the response only shifted;
- the surrogate is fitted on this run's measurements plus the prior points at settings this run has
  not measured, each prior point moved by a learned offset per objective: the mean log ratio of this
  run's reading to the prior's at settings measured in both, per launch slot, shrunk towards the
  partition-wide offset (and that towards 0) while few pairs are known.

Prior points are never this run's measurements: they are not journaled, not charged to the budget,
never on the reported front and never the measured front an acquisition pass improves on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kareus.types import Candidate, Measurement

SHRINK = 1.0  # pseudo-pairs pulling an offset towards its parent (slot -> partition -> 0)


def warm_start_dirs(value: Any) -> list[str]:
    """``search.warm_start`` as a list of paths: unset -> [], one path -> [it], a list -> the list."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [str(value)]
    return [str(v) for v in value]


def warm_start_problems(value: Any, resolve: Any = None) -> list[str]:
    """One ``search.warm_start: ...`` line per bad entry: not a path, missing, or holding no journal.
    ``resolve`` turns a given path into the one to look at (Hydra's start folder); default: as given."""
    from kareus.profiler.journal import JOURNAL_NAME

    if value is None:
        return []
    if not isinstance(value, (str, os.PathLike, Sequence)):  # a list from the command line is a ListConfig, a Sequence
        return [f"search.warm_start: must be a run directory or a list of them, got {value!r}"]
    dirs = warm_start_dirs(value)
    if not dirs:
        return ["search.warm_start: an empty list; give a run directory (search.warm_start=runs/<date>/<time>), "
                "or leave it unset for a cold search"]
    out = []
    for d in dirs:
        if not d.strip():
            out.append("search.warm_start: an empty path; give a run directory, or leave it unset")
            continue
        p = Path(resolve(d)) if resolve else Path(d)
        if not p.is_dir():
            out.append(f"search.warm_start: {d} is not a directory; give the run directory of a finished search")
        elif not (p / JOURNAL_NAME).is_file():
            out.append(f"search.warm_start: {d} has no {JOURNAL_NAME}: not the directory of a run that measured "
                       f"anything")
    return out


def load_prior(dirs: Sequence[str | os.PathLike[str]], backend: str,
               keys: Sequence[str]) -> dict[str, list[Measurement]]:
    """Prior points per partition key of ``keys``: the successful rows of each run's journal measured on
    ``backend`` (a setting read several times counts at its mean; a later directory's rows win over an
    earlier one's). ValueError, one line, when a journal cannot be read or nothing matches."""
    from kareus.profiler.journal import JOURNAL_NAME, JournalError, read_backend_measurements

    wanted = set(keys)
    found: dict[Candidate, list[Measurement]] = {}
    other_hw: set[str] = set()
    other_keys: set[str] = set()
    for d in dirs:
        try:
            rows = read_backend_measurements(Path(d) / JOURNAL_NAME)
        except JournalError as err:
            raise ValueError(f"search.warm_start: {err}") from None
        mine: dict[Candidate, list[Measurement]] = {}
        for m, hw in rows:
            if m.failed:
                continue
            if hw != backend:
                other_hw.add(hw)
            elif m.candidate.partition not in wanted:
                other_keys.add(m.candidate.partition)
            else:
                mine.setdefault(m.candidate, []).append(m)
        found.update(mine)
    if not found:
        if other_keys:
            why = (f"its partitions ({', '.join(sorted(other_keys))}) are none of this layout's "
                   f"({', '.join(sorted(wanted))})")
        elif other_hw:
            why = f"it was measured on {', '.join(sorted(other_hw))}, this run measures on {backend}"
        else:
            why = "it holds no successful measurement"
        raise ValueError(f"search.warm_start: nothing to start from: {why}")
    out: dict[str, list[Measurement]] = {k: [] for k in keys}
    for cand, ms in found.items():
        out[cand.partition].append(_mean(ms))
    return out


def _mean(ms: list[Measurement]) -> Measurement:
    from kareus.search.common import mean_reading

    return ms[0] if len(ms) == 1 else mean_reading(ms)


def to_rows(prior: Sequence[Measurement]) -> list[list[Any]]:
    """Prior points as plain JSON rows (a search task carries them to its worker)."""
    return [[m.candidate.slot, int(m.candidate.sms), int(m.candidate.freq_mhz), float(m.time_s), float(m.energy_j),
             float(m.dynamic_energy_j), float(m.static_power_w)] for m in prior]


def from_rows(partition: str, rows: Sequence[Sequence[Any]]) -> list[Measurement]:
    """``to_rows``' rows back as measurements of ``partition`` (flagged ``prior``)."""
    return [Measurement(Candidate(partition, str(s), int(sm), int(f)), float(t), float(e), float(d), float(p), 0.0,
                        float(f), 1, flags=("prior",)) for s, sm, f, t, e, d, p in rows]


@dataclass
class Prior:
    """Prior points inside one search space: their indices and (time, total, dynamic) values."""

    idx: np.ndarray
    obj: np.ndarray

    @classmethod
    def of(cls, index: dict[Candidate, int], prior: Sequence[Measurement]) -> "Prior":
        """The prior points whose setting is in the space (``index``: candidate -> position)."""
        keep = [(index[m.candidate], m) for m in prior if m.candidate in index and not m.failed]
        idx = np.array([i for i, _ in keep], dtype=int)
        obj = np.array([[m.time_s, m.energy_j, m.dynamic_energy_j] for _, m in keep], dtype=float).reshape(-1, 3)
        return cls(idx, obj)

    def __len__(self) -> int:
        return len(self.idx)


def design(prior: Prior, n: int) -> list[int]:
    """The warm initial design: up to ``n`` prior Pareto settings, (time, total energy) front first,
    spread evenly along it by time when it holds more, then the (time, dynamic energy) front's rest."""
    from kareus.frontier import pareto_mask

    if n <= 0 or not len(prior):
        return []
    picks: list[int] = []
    for col in (1, 2):
        on = np.flatnonzero(pareto_mask(prior.obj[:, 0], prior.obj[:, col]))
        on = on[np.argsort(prior.obj[on, 0], kind="stable")]
        fresh = [int(prior.idx[j]) for j in on if int(prior.idx[j]) not in picks]
        room = n - len(picks)
        if len(fresh) > room:
            fresh = [fresh[int(round(k))] for k in np.linspace(0, len(fresh) - 1, room)] if room > 0 else []
        picks += fresh
    return picks[:n]


def offsets(prior_y: np.ndarray, own_y: np.ndarray, slot_prior: np.ndarray, slot_own: np.ndarray) -> np.ndarray:
    """Per prior row, what to add to its targets: the shrunk mean difference (own - prior) over the pairs
    (rows at the same setting), per slot, shrunk towards the partition's, that towards 0 (``SHRINK``)."""
    diff = own_y - prior_y
    n = len(diff)
    overall = diff.sum(axis=0) / (n + SHRINK) if n else np.zeros(prior_y.shape[1] if prior_y.ndim == 2 else 2)
    out = np.tile(overall, (len(slot_prior), 1))
    for s in np.unique(slot_prior):
        at = slot_own == s
        k = int(at.sum())
        out[slot_prior == s] = (diff[at].sum(axis=0) + SHRINK * overall) / (k + SHRINK)
    return out


def fit_rows(prior: Prior, own_idx: Sequence[int], own_obj: np.ndarray, slot_of: np.ndarray,
             shift: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices, targets) of the prior points to add to a fit: those at settings not measured here, in the
    fit's targets (log time, log(dynamic + ``shift``)) moved by ``offsets``. Rows whose dynamic energy
    the shift leaves non-positive are dropped (they have no log)."""
    def targets(obj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        good = obj[:, 2] + shift > 0
        y = np.column_stack([np.log(obj[:, 0]), np.log(np.where(good, obj[:, 2] + shift, 1.0))])
        return y, good

    if not len(prior):
        return np.zeros(0, dtype=int), np.zeros((0, 2))
    py, pgood = targets(prior.obj)
    own_pos = {int(i): j for j, i in enumerate(own_idx)}
    paired = [(j, own_pos[int(i)]) for j, i in enumerate(prior.idx) if int(i) in own_pos and pgood[j]]
    oy, ogood = targets(own_obj) if len(own_obj) else (np.zeros((0, 2)), np.zeros(0, dtype=bool))
    paired = [(a, b) for a, b in paired if ogood[b]]
    pa, pb = np.array([a for a, _ in paired], dtype=int), np.array([b for _, b in paired], dtype=int)
    own_slots = slot_of[np.asarray(own_idx, dtype=int)[pb]] if len(pb) else np.zeros(0, dtype=int)
    keep = np.array([pgood[j] and int(i) not in own_pos for j, i in enumerate(prior.idx)], dtype=bool)
    if not keep.any():
        return np.zeros(0, dtype=int), np.zeros((0, 2))
    off = offsets(py[pa], oy[pb], slot_of[prior.idx[keep]], own_slots)
    return prior.idx[keep], py[keep] + off
