"""Live progress of partition searches: profiled / budget, hypervolume ratio and GPU time per partition.

The hypervolume ratio is the share of the rectangle from (0 s, 0 J) to the search's reference point
that its measured front dominates (0..1). The reference is fixed by the search's first batch, so the
live value only grows and the final line continues it.

A rich display on an interactive terminal; one plain line per finished search when output goes to a
log (not a TTY); nothing at all with ``progress=false``. Each is an event listener and a context
manager (``with make_progress(cfg.progress) as p: bus.subscribe(p)``).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

from kareus.events import BatchFinished, CandidateMeasured, SearchFinished, SearchStarted

log = logging.getLogger("kareus.progress")


def format_seconds(seconds: float) -> str:
    """``42.0 s``, ``3.5 min``, ``2.10 h``: GPU time at a glance."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_hv(value: float | None) -> str:
    """A hypervolume ratio (0..1) to four decimals: a search's late gains are in the third and fourth."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


class _State:
    """What is known about one partition search."""

    def __init__(self, budget: int = 0) -> None:
        self.budget = budget
        self.profiled = 0
        self.hv: float | None = None  # hypervolume ratio
        self.gpu_seconds = 0.0
        self.done = False


class NullProgress:
    """``progress=false``: ignores every event."""

    def __call__(self, event: Any) -> None:
        pass

    def __enter__(self) -> "NullProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class PlainProgress(NullProgress):
    """Non-interactive output: one line per finished partition search, nothing per candidate."""

    def __init__(self, kind: str, write: Callable[[str], None] | None = None) -> None:
        self.write = write or log.info
        self.gpu_label = f"{kind} GPU time".lstrip()  # kind: "simulated", "replayed" or "" (a real GPU)
        self.states: dict[str, _State] = {}

    def __call__(self, event: Any) -> None:
        key = getattr(event, "partition", None)
        if key is None:
            return
        state = self.states.setdefault(key, _State())
        if isinstance(event, SearchStarted):
            state.budget = event.budget
        elif isinstance(event, CandidateMeasured):
            state.profiled = max(state.profiled, event.index + 1)
            state.gpu_seconds = event.gpu_seconds
        elif isinstance(event, BatchFinished):
            state.hv = event.hypervolume_ratio
        elif isinstance(event, SearchFinished):
            state.profiled, state.hv, state.gpu_seconds, state.done = (event.profiled, event.hypervolume_ratio,
                                                                      event.gpu_seconds, True)
            self.write(f"partition {key}: profiled {event.profiled}/{state.budget or event.profiled}, "
                       f"{event.failed} failed, frontier {len(event.frontier)} points, "
                       f"hypervolume ratio {format_hv(event.hypervolume_ratio)}, "
                       f"{self.gpu_label} {format_seconds(event.gpu_seconds)}")


def _to_log_files(line: str) -> None:
    """``line`` into the run's log file (``kareus.log``) alone: on the terminal the bars already show it."""
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


class ProgressListener(PlainProgress):
    """A rich progress bar per partition: profiled / budget, current hypervolume ratio, GPU time."""

    def __init__(self, kind: str, console: Any = None, transient: bool = False) -> None:
        super().__init__(kind, write=_to_log_files)  # the bars show them; the run's log keeps them
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        gpu = {"simulated": "sim GPU", "replayed": "replayed GPU"}.get(kind, "GPU")
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
            TextColumn("HV ratio [cyan]{task.fields[hv]}"), TextColumn(gpu + " [magenta]{task.fields[gpu]}"),
            TimeElapsedColumn(), TextColumn("[green]{task.fields[status]}"), console=console, transient=transient)
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> "ProgressListener":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def __call__(self, event: Any) -> None:
        super().__call__(event)
        key = getattr(event, "partition", None)
        if key is None:
            return
        state = self.states[key]
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(key, total=state.budget or None, hv="-", gpu="-", status="")
        self.progress.update(self.tasks[key], total=state.budget or None, completed=state.profiled,
                             hv=format_hv(state.hv), gpu=format_seconds(state.gpu_seconds),
                             status="done" if state.done else "")


def make_progress(kind: str, enabled: bool = True, console: Any = None,
                  interactive: bool | None = None) -> NullProgress:
    """Rich on a terminal, plain lines in logs, silent when disabled (``interactive`` forces a mode);
    ``kind`` names the GPU time the searches cost: ``simulated``, ``replayed`` or ``""`` (a real GPU)."""
    if not enabled:
        return NullProgress()
    if interactive is None:
        from rich.console import Console

        interactive = live_terminal(console or Console())
    if interactive:
        return ProgressListener(kind, console=console)
    return PlainProgress(kind)


def live_terminal(console: Any) -> bool:
    """Whether the console writes to a terminal. rich's ``is_terminal`` also says so under FORCE_COLOR
    (set by many CI systems) for a pipe or a file, where a live bar leaves cursor codes in the results."""
    try:
        return bool(console.is_terminal and console.file.isatty())
    except (AttributeError, ValueError, OSError):  # a closed or file-less stream
        return False
