"""Events that the searcher and profiler publish; tracking, progress and the journal subscribe.

This keeps search code free of MLflow, rich and file formats: it only calls ``bus.emit(event)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kareus.frontier import Frontier, hypervolume_ratio
from kareus.types import Measurement


@dataclass(frozen=True)
class SearchStarted:
    partition: str
    space_size: int
    budget: int
    searcher: str


@dataclass(frozen=True)
class CandidateMeasured:
    """One profiled candidate, emitted the moment it is measured. ``index`` counts profiles from 0."""

    partition: str
    index: int
    measurement: Measurement
    predicted: dict[str, float] | None = None  # surrogate predictions (time_s, energy_j, ...) if any
    pass_name: str | None = None  # acquisition pass (or initial design) that chose it
    gpu_seconds: float = 0.0  # profiling GPU-time spent so far on this partition
    cached: bool = False  # answered from the journal, not re-measured


@dataclass(frozen=True)
class BatchFinished:
    """``hypervolume`` (s x J) of the measured front against ``reference``, which one search holds fixed
    from its first batch with numbers to its end (so live values never jump)."""

    partition: str
    batch: int
    profiled: int
    hypervolume: float
    predicted_gain: float | None = None
    predictions: list[dict[str, Any]] = field(default_factory=list, compare=False)
    reference: tuple[float, float] | None = None

    @property
    def hypervolume_ratio(self) -> float | None:
        """The share of the rectangle (0 s, 0 J)-``reference`` the front dominates (0..1)."""
        return hypervolume_ratio(self.hypervolume, self.reference)


@dataclass(frozen=True)
class SearchFinished:
    partition: str
    frontier: Frontier
    profiled: int
    failed: int
    gpu_seconds: float
    hypervolume: float
    reference: tuple[float, float] | None = None  # the same one as the search's BatchFinished events

    @property
    def hypervolume_ratio(self) -> float | None:
        """The share of the rectangle (0 s, 0 J)-``reference`` the front dominates (0..1)."""
        return hypervolume_ratio(self.hypervolume, self.reference)


Event = SearchStarted | CandidateMeasured | BatchFinished | SearchFinished
Listener = Callable[[Any], None]


class EventBus:
    """Synchronous fan-out to listeners, in subscription order."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Listener:
        self._listeners.append(listener)
        return listener

    def emit(self, event: Any) -> None:
        for listener in self._listeners:
            listener(event)
