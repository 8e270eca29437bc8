"""Hook an ExecutionPlan into megatron-core's pipeline schedules: a clock switch before each instruction.

megatron-core's schedules (``forward_backward_no_pipelining``, ``..._pipelining_without_interleaving``)
call the module-level ``forward_step`` and ``backward_step`` of
``megatron.core.pipeline_parallel.schedules`` once per instruction. ``plan_hooks`` wraps both for the
duration of a ``with`` block, so each forward calls ``executor.begin(microbatch, "fwd")`` and each
backward ``executor.begin(microbatch, "bwd")`` first. Forwards carry ``current_microbatch``;
backwards do not, and run in the order of their forwards (first in, first out), which is how the
non-interleaved schedules pair them.

Schedules these hooks cannot follow raise ``UnsupportedScheduleError`` instead of switching clocks
wrongly: the interleaved (virtual pipeline) schedule (its forwards carry a ``vp_stage`` and
backwards no longer follow forwards first in, first out), ``overlap_moe_expert_parallel_comm``
(training runs forward and backward together in ``combined_1f1b``, never calling these functions)
and ``hybrid_context_parallel`` (``current_microbatch`` counts sub-samples, not the plan's
microbatches). Pass the model's config to ``plan_hooks`` to be told when the hooks are installed;
without it, the first forward step that sees such a config or a ``vp_stage`` raises.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator

from kareus.runtime.executor import PlanExecutor
from kareus.types import Direction

# megatron-core config flags (ModelParallelConfig) whose schedules bypass or miscount these hooks
UNSUPPORTED_FLAGS = {
    "overlap_moe_expert_parallel_comm": "training then runs forward and backward together (combined_1f1b) "
                                        "without calling forward_step/backward_step, so no clock would switch",
    "hybrid_context_parallel": "its forward steps count sub-samples, not the plan's microbatches",
}
_FORWARD_CONFIG, _FORWARD_MICROBATCH, _FORWARD_VP_STAGE = 6, 11, 12  # positions in schedules.forward_step


class UnsupportedScheduleError(RuntimeError):
    """The training loop uses a megatron-core schedule the plan hooks cannot follow."""


def check_schedule(config: Any) -> None:
    """Raise UnsupportedScheduleError if the model config selects a schedule the hooks cannot follow."""
    for flag, why in UNSUPPORTED_FLAGS.items():
        if getattr(config, flag, False):
            raise UnsupportedScheduleError(f"plan_hooks do not support {flag}=True: {why}; turn it off to run a plan")
    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vp is not None and int(vp) > 1:
        raise UnsupportedScheduleError(_interleaved(f"virtual_pipeline_model_parallel_size={vp}"))


def _interleaved(what: str) -> str:
    return (f"plan_hooks do not support the interleaved (virtual pipeline) schedule ({what}): its backwards "
            "do not follow the forwards first in, first out, so they would run at another instruction's clock")


def _arg(args: tuple, kwargs: dict, name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


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
def plan_hooks(executor: PlanExecutor, schedules: Any = None, config: Any = None) -> Iterator[MicrobatchTracker]:
    """Wrap megatron-core's forward/backward steps to switch the clock per instruction; restores them after.

    ``config`` (the model's ModelParallelConfig / TransformerConfig) is checked here, before training
    starts, for schedules the hooks cannot follow.
    """
    if config is not None:
        check_schedule(config)
    mod = schedules if schedules is not None else _schedules()
    orig_forward, orig_backward = mod.forward_step, mod.backward_step
    tracker = MicrobatchTracker()

    def forward_step(*args: Any, **kwargs: Any) -> Any:
        vp_stage = _arg(args, kwargs, "vp_stage", _FORWARD_VP_STAGE)
        if vp_stage is not None:
            raise UnsupportedScheduleError(_interleaved(f"forward_step got vp_stage={vp_stage}"))
        step_config = _arg(args, kwargs, "config", _FORWARD_CONFIG)
        if step_config is not None:
            check_schedule(step_config)
        mb = tracker.forward(_arg(args, kwargs, "current_microbatch", _FORWARD_MICROBATCH))
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
