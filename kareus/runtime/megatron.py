"""Hook an ExecutionPlan into megatron-core's pipeline schedules: a clock switch before each instruction.

megatron-core's schedules (``forward_backward_no_pipelining``, ``..._pipelining_without_interleaving``)
call the module-level ``forward_step`` and ``backward_step`` of
``megatron.core.pipeline_parallel.schedules`` once per instruction. ``plan_hooks`` wraps both for the
duration of a ``with`` block, so each forward calls ``executor.begin(microbatch, "fwd")`` and each
backward ``executor.begin(microbatch, "bwd")`` first. Forwards carry ``current_microbatch``;
backwards do not, and run in the order of their forwards (first in, first out), which is how the
non-interleaved schedules pair them. Interleaved (virtual pipeline) schedules are not covered.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator

from kareus.runtime.executor import PlanExecutor
from kareus.types import Direction


class MicrobatchTracker:
    """Pairs backwards with forwards: each backward belongs to the oldest forward still waiting for one."""

    def __init__(self) -> None:
        self._waiting: deque[int] = deque()
        self._forwards = 0

    def forward(self, microbatch: int | None) -> int:
        mb = self._forwards if microbatch is None else int(microbatch)
        if mb == 0:  # a new iteration (or an eval pass that ran no backwards): forget the last one
            self._waiting.clear()
            self._forwards = 0
        self._waiting.append(mb)
        self._forwards += 1
        return mb

    def backward(self) -> int:
        if not self._waiting:
            raise RuntimeError("a backward step ran with no forward step waiting for it")
        return self._waiting.popleft()


def _schedules() -> Any:
    from megatron.core.pipeline_parallel import schedules

    return schedules


@contextmanager
def plan_hooks(executor: PlanExecutor, schedules: Any = None) -> Iterator[MicrobatchTracker]:
    """Wrap megatron-core's forward/backward steps to switch the clock per instruction; restores them after."""
    mod = schedules if schedules is not None else _schedules()
    orig_forward, orig_backward = mod.forward_step, mod.backward_step
    tracker = MicrobatchTracker()

    def forward_step(*args: Any, **kwargs: Any) -> Any:
        mb = tracker.forward(kwargs.get("current_microbatch"))
        executor.begin(mb, Direction.FWD)
        return orig_forward(*args, **kwargs)

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        executor.begin(tracker.backward(), Direction.BWD)
        return orig_backward(*args, **kwargs)

    forward_step.__wrapped__ = orig_forward  # type: ignore[attr-defined]
    backward_step.__wrapped__ = orig_backward  # type: ignore[attr-defined]
    mod.forward_step, mod.backward_step = forward_step, backward_step
    try:
        yield tracker
    finally:
        mod.forward_step, mod.backward_step = orig_forward, orig_backward
