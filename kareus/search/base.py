"""The contract between searchers and the rest: a problem in, measured candidates and a frontier out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from kareus.frontier import Frontier
from kareus.types import Candidate, Measurement, PartitionType

# evaluate(batch, annotations) -> measurements, in batch order. ``annotations[i]`` may hold
# {"predicted": {...}, "pass": "total"} for logging. Already-measured candidates are answered from
# the journal without charge, so searchers may ask again safely. ``{"reading": k}`` (k >= 1) asks for a
# setting's k-th re-measurement instead: a new reading, charged like any profile (or, on resume, that
# reading's journal row).
Evaluate = Callable[[Sequence[Candidate], Sequence[dict[str, Any]] | None], list[Measurement]]


@dataclass
class SearchProblem:
    partition: PartitionType
    space: list[Candidate]
    evaluate: Evaluate
    budget: int  # profiles allowed, the initial design included
    seed: int
    static_power_w: float
    initial: list[Candidate] = field(default_factory=list)  # shared initial design, if given
    emit: Callable[[Any], None] = lambda event: None  # an EventBus.emit
    # a related run's measurements of this partition (``search.warm_start``): prior knowledge for the
    # searcher, never this run's measurements (not journaled, not charged, never on the front)
    prior: list[Measurement] = field(default_factory=list)


@dataclass
class SearchResult:
    partition: str
    measurements: list[Measurement]
    frontier: Frontier  # (time, total energy) Pareto set of measured, non-failed candidates
    dynamic_frontier: Frontier  # (time, dynamic energy) Pareto set: what composition uses
    predictions: list[list[dict[str, Any]]] = field(default_factory=list)  # per batch, kept for the record
    gpu_seconds: float = 0.0  # profiling GPU-time this search spent (simulated on the simulated GPU)
    # of those: measured by this run (the rest were answered from a resumed run's journal)
    measured_now: int = 0
    measured_now_gpu_seconds: float = 0.0
    # every reported hypervolume of this search, live and final, is against this (time_s, energy_j)
    reference: tuple[float, float] | None = None
    # one measurement per setting (the mean of its readings where it was read again), in the order first
    # measured: what plans are composed from; empty: ``measurements`` (a searcher that reads each once)
    settings: list[Measurement] = field(default_factory=list)

    def per_setting(self) -> list[Measurement]:
        """One measurement per setting: a setting read several times counts once, at its mean."""
        return self.settings or self.measurements


class Searcher(Protocol):
    def run(self, problem: SearchProblem) -> SearchResult: ...
