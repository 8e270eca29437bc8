"""Bookkeeping every searcher shares: budget, measured set, batches, events and the result."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Iterator, Sequence

import numpy as np

from kareus.events import BatchFinished
from kareus.frontier import Frontier
from kareus.search.base import SearchProblem, SearchResult
from kareus.search.hv import hypervolume
from kareus.search.space import encode
from kareus.types import REREAD, Candidate, Measurement


def reference_point(times: Sequence[float], energies: Sequence[float], factor: float = 1.1) -> tuple[float, float]:
    """The stated reference for reported hypervolumes: ``factor`` x the observed maxima."""
    return (factor * float(np.max(times)), factor * float(np.max(energies)))


def result_reference(result: SearchResult) -> tuple[float, float] | None:
    """The reference a finished search reported against: the one its first batch fixed, else (no batch
    with numbers was reported) 1.1 x the maxima of its non-failed measurements; None if it has none."""
    if result.reference is not None:
        return result.reference
    ok = [m for m in result.measurements if not m.failed]
    return reference_point([m.time_s for m in ok], [m.energy_j for m in ok]) if ok else None


class SearchRun:
    """One searcher's walk over one problem: charges the budget and keeps every measurement; a setting
    read again (``remeasure``) counts at the mean of its readings, each reading charged."""

    def __init__(self, problem: SearchProblem) -> None:
        self.problem = problem
        self.space = list(problem.space)
        self.index = {c: i for i, c in enumerate(self.space)}
        self.X = encode(problem.partition, self.space)
        self.measured: dict[int, Measurement] = {}  # per setting: its reading, or the mean of its readings
        self.readings: dict[int, list[Measurement]] = {}  # per setting: every reading, in order
        self.log: list[Measurement] = []  # every reading, in order: what the budget paid for
        self.order: list[int] = []
        self.held = 0  # readings kept back from ``remaining`` (a searcher's reserve for later)
        self.batches = 0
        self.predictions: list[list[dict[str, Any]]] = []
        self.timings: list[dict[str, float]] = []
        self._ref: tuple[float, float] | None = None

    # --- budget -------------------------------------------------------------------------------
    @property
    def budget(self) -> int:
        return min(self.problem.budget, len(self.space))

    @property
    def remaining(self) -> int:
        """Readings left: a re-measurement costs a profile like a new setting."""
        return max(0, self.budget - len(self.log) - self.held)

    @property
    def unmeasured(self) -> np.ndarray:
        mask = np.ones(len(self.space), dtype=bool)
        mask[list(self.measured)] = False
        return np.flatnonzero(mask)

    def batch_pools(self, size: int) -> Iterator[tuple[np.ndarray, int]]:
        """(unmeasured pool, batch size) for each batch while budget and unmeasured candidates remain."""
        while self.remaining > 0:
            pool = self.unmeasured
            k = min(size, self.remaining, len(pool))
            if k <= 0:
                return
            yield pool, k

    def indices(self, candidates: Sequence[Candidate]) -> list[int]:
        out = []
        for c in candidates:
            if c not in self.index:
                raise ValueError(f"initial candidate {c} is not in the search space of {self.problem.partition.key!r}")
            out.append(self.index[c])
        return out

    # --- measuring ----------------------------------------------------------------------------
    def evaluate(self, idxs: Sequence[int], annotations: Sequence[dict[str, Any]] | None = None) -> list[Measurement]:
        """Measure the not-yet-measured ``idxs`` (duplicates dropped, cut to the remaining budget)."""
        seen: set[int] = set()
        todo, notes = [], []
        for j, i in enumerate(idxs):
            i = int(i)
            if i in self.measured or i in seen:
                continue
            seen.add(i)
            todo.append(i)
            notes.append(annotations[j] if annotations is not None else {})
        todo, notes = todo[: self.remaining], notes[: self.remaining]
        if not todo:
            return []
        ms = self.problem.evaluate([self.space[i] for i in todo], notes)
        for i, m in zip(todo, ms):
            self.measured[i] = m
            self.readings[i] = [m]
            self.log.append(m)
            self.order.append(i)
        return list(ms)

    def remeasure(self, idxs: Sequence[int], annotations: Sequence[dict[str, Any]] | None = None) -> list[Measurement]:
        """Read measured settings ``idxs`` again (cut to the remaining budget): each reading is asked for
        by its index (``reading``: 1 for the second), so a resumed run is answered from the journal's
        row of that reading, and the setting's value becomes the mean of its readings."""
        picked = {int(i): (annotations[j] if annotations is not None else {}) for j, i in enumerate(idxs)
                  if int(i) in self.measured}
        todo = list(picked)[: self.remaining]  # one reading of a setting per call: its index is fixed
        if not todo:
            return []
        notes = [{**picked[i], "reading": len(self.readings[i])} for i in todo]
        ms = self.problem.evaluate([self.space[i] for i in todo], notes)
        for i, m in zip(todo, ms):
            self.readings[i].append(m)
            self.log.append(m)
            self.measured[i] = mean_reading(self.readings[i])
        return list(ms)

    def counts(self, idxs: Sequence[int]) -> np.ndarray:
        """Successful readings of each setting of ``idxs``."""
        return np.array([sum(not m.failed for m in self.readings[i]) for i in idxs], dtype=int)

    def failed(self) -> list[int]:
        """Measured indices without numbers (a crash, a read that failed after its retries)."""
        return [i for i in self.order if self.measured[i].failed]

    def ok(self) -> list[int]:
        """Measured indices with numbers (failed measurements count against the budget only)."""
        return [i for i in self.order if not self.measured[i].failed]

    def objectives(self, idxs: Sequence[int] | None = None) -> np.ndarray:
        """(n, 3) array of measured time, total energy, dynamic energy."""
        idxs = self.ok() if idxs is None else idxs
        return np.array([[self.measured[i].time_s, self.measured[i].energy_j, self.measured[i].dynamic_energy_j]
                         for i in idxs], dtype=float).reshape(-1, 3)

    def hypervolume(self) -> float:
        """Measured (time, total energy) hypervolume against the reference fixed by the first batch."""
        obj = self.objectives()
        if len(obj) == 0:
            return 0.0
        if self._ref is None:
            self._ref = reference_point(obj[:, 0], obj[:, 1])
        return hypervolume(obj[:, :2], self._ref)

    def finish_batch(self, predicted_gain: float | None = None, predictions: list[dict[str, Any]] | None = None,
                     **timing: float) -> None:
        preds = predictions or []
        self.predictions.append(preds)
        if timing:
            self.timings.append(dict(timing))
        self.problem.emit(BatchFinished(self.problem.partition.key, self.batches, len(self.log),
                                        self.hypervolume(), predicted_gain, preds, reference=self._ref))
        self.batches += 1

    # --- result -------------------------------------------------------------------------------
    def result(self, estimates: np.ndarray | None = None) -> SearchResult:
        """Every reading, and the fronts of each setting's mean reading; ``estimates`` ((time, total,
        dynamic) per ``ok()`` setting, e.g. a model's posterior means) pick and place the front points
        instead, each point's payload still the setting's mean reading."""
        ok = self.ok()
        good = [self.measured[i] for i in ok]
        est = self.objectives(ok) if estimates is None else np.asarray(estimates, dtype=float).reshape(-1, 3)
        return SearchResult(
            partition=self.problem.partition.key,
            measurements=list(self.log),
            frontier=Frontier.from_arrays(est[:, 0], est[:, 1], good, "total"),
            dynamic_frontier=Frontier.from_arrays(est[:, 0], est[:, 2], good, "dynamic"),
            predictions=self.predictions,
            reference=self._ref,
            settings=[self.measured[i] for i in self.order],
        )


def mean_reading(readings: Sequence[Measurement]) -> Measurement:
    """One setting's readings as one measurement: the mean of the successful ones (failed only if
    every reading failed), its windows and repeats those of all of them, flagged ``readings:<n>``."""
    ok = [m for m in readings if not m.failed]
    if not ok:
        return readings[-1]
    mean = lambda key: float(np.mean([getattr(m, key) for m in ok]))  # noqa: E731
    flags = tuple(f for f in ok[0].flags if not f.startswith(REREAD)) + (f"readings:{len(ok)}",)
    return replace(ok[0], time_s=mean("time_s"), energy_j=mean("energy_j"), dynamic_energy_j=mean("dynamic_energy_j"),
                   temperature_c=mean("temperature_c"), freq_mhz=mean("freq_mhz"),
                   repeats=sum(m.repeats for m in ok), flags=flags, readings=tuple(r for m in ok for r in m.readings))


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        t = time.perf_counter()
        dt, self.t0 = t - self.t0, t
        return dt
