"""Bookkeeping every searcher shares: budget, measured set, batches, events and the result."""
from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import numpy as np

from kareus.events import BatchFinished
from kareus.frontier import Frontier
from kareus.search.base import SearchProblem, SearchResult
from kareus.search.hv import hypervolume
from kareus.search.space import encode
from kareus.types import Candidate, Measurement


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
    """One searcher's walk over one problem: charges the budget and keeps every measurement."""

    def __init__(self, problem: SearchProblem) -> None:
        self.problem = problem
        self.space = list(problem.space)
        self.index = {c: i for i, c in enumerate(self.space)}
        self.X = encode(problem.partition, self.space)
        self.measured: dict[int, Measurement] = {}
        self.order: list[int] = []
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
        return max(0, self.budget - len(self.measured))

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
            self.order.append(i)
        return list(ms)

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
        self.problem.emit(BatchFinished(self.problem.partition.key, self.batches, len(self.measured),
                                        self.hypervolume(), predicted_gain, preds, reference=self._ref))
        self.batches += 1

    # --- result -------------------------------------------------------------------------------
    def result(self) -> SearchResult:
        ok = self.ok()
        ms = [self.measured[i] for i in self.order]
        good = [self.measured[i] for i in ok]
        return SearchResult(
            partition=self.problem.partition.key,
            measurements=ms,
            frontier=Frontier.from_arrays([m.time_s for m in good], [m.energy_j for m in good], good, "total"),
            dynamic_frontier=Frontier.from_arrays([m.time_s for m in good], [m.dynamic_energy_j for m in good], good,
                                                  "dynamic"),
            predictions=self.predictions,
            reference=self._ref,
        )


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        t = time.perf_counter()
        dt, self.t0 = t - self.t0, t
        return dt
