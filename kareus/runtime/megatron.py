"""Hook an ExecutionPlan into megatron-core's pipeline schedules: a clock switch before each instruction.

megatron-core's schedules (``forward_backward_no_pipelining``, ``..._pipelining_without_interleaving``)
call the module-level ``forward_step`` and ``backward_step`` of
``megatron.core.pipeline_parallel.schedules`` once per instruction. ``plan_hooks`` wraps both for the
duration of a ``with`` block, so each forward calls ``executor.begin(microbatch, "fwd")`` and each
backward ``executor.begin(microbatch, "bwd")`` first. Forwards carry ``current_microbatch``;
backwards do not, and run in the order of their forwards (first in, first out), which is how the
non-interleaved schedules pair them.

``plan_hooks`` also wraps the schedule functions that ``get_forward_backward_func`` hands out, so a
training call whose microbatch count, pipeline size or model config the plan cannot follow is refused
before its first send or receive (on every rank alike), and an evaluation call (``forward_only=True``)
runs at the clock it finds, with no switches. A loop that fetched the schedule function before
entering ``plan_hooks`` bypasses those wrappers; its forward steps still refuse a microbatch count
other than the plan's. Leaving the block
restores the functions and resets the clocks (``executor.reset()``).

Schedules these hooks cannot follow raise ``UnsupportedScheduleError`` instead of switching clocks
wrongly: the interleaved (virtual pipeline) schedule (its forwards carry a ``vp_stage`` and
backwards no longer follow forwards first in, first out), ``overlap_moe_expert_parallel_comm``
(training runs forward and backward together in ``combined_1f1b``, never calling these functions)
and ``hybrid_context_parallel`` (``current_microbatch`` counts sub-samples, not the plan's
microbatches). Pass the model's config to ``plan_hooks`` to be told when the hooks are installed;
without it, the wrapped schedule call reads its model's config and raises before it runs (a schedule
fetched before the hooks: the first forward step that sees such a config or a ``vp_stage``).
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
_FORWARD_MICROBATCHES, _FORWARD_CONFIG, _FORWARD_MICROBATCH, _FORWARD_VP_STAGE = 3, 6, 11, 12  # in forward_step
SCHEDULE_FUNCTIONS = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                      "forward_backward_pipelining_with_interleaving")
INTERLEAVED = "forward_backward_pipelining_with_interleaving"  # wrapped to refuse training before any receive


class UnsupportedScheduleError(RuntimeError):
    """The training loop uses a megatron-core schedule the plan hooks cannot follow."""


class PlanMismatchError(ValueError):
    """The training call runs another number of microbatches or pipeline stages than the plan covers."""


def check_plan_fits(executor: PlanExecutor, num_microbatches: Any, pipeline_stages: int | None,
                    pipeline_rank: int | None = None) -> None:
    """Refuse a training call the plan was not composed for (its instructions would be another schedule's),
    or one on a rank whose executor follows another stage's instructions."""
    plan = executor.plan
    if num_microbatches is not None and int(num_microbatches) != plan.num_microbatches:
        raise PlanMismatchError(f"plan {plan.id} covers {plan.num_microbatches} microbatches per iteration, "
                                f"but the schedule runs {int(num_microbatches)}; compose a plan with "
                                f"parallel.num_microbatches={int(num_microbatches)}")
    if pipeline_stages is not None and int(pipeline_stages) != plan.num_stages:
        raise PlanMismatchError(f"plan {plan.id} covers {plan.num_stages} pipeline stages, but the schedule "
                                f"runs {int(pipeline_stages)}; compose a plan with parallel.pp={int(pipeline_stages)}")
    if pipeline_rank is not None and int(pipeline_rank) != executor.stage:
        raise PlanMismatchError(f"this rank is pipeline stage {int(pipeline_rank)}, but its PlanExecutor follows "
                                f"stage {executor.stage}'s instructions; build it with stage={int(pipeline_rank)}")


def _pipeline_position(kwargs: dict) -> tuple[int | None, int | None]:
    """(pipeline size, this rank's stage) of a schedule call: its communicator's group, else megatron's
    parallel state; (None, None) where neither tells."""
    try:
        comm = kwargs.get("p2p_communicator")
        group = getattr(comm, "pp_group", None) if comm is not None else None
        if group is not None:
            rank = getattr(group, "rank", None)
            return int(group.size()), (int(rank()) if callable(rank) else None)
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return (int(parallel_state.get_pipeline_model_parallel_world_size()),
                    int(parallel_state.get_pipeline_model_parallel_rank()))
    except Exception:  # no megatron-core state to ask: the microbatch count still checks
        return None, None
    return None, None


def check_schedule(config: Any) -> None:
    """Raise UnsupportedScheduleError if the model config selects a schedule the hooks cannot follow."""
    for flag, why in UNSUPPORTED_FLAGS.items():
        if getattr(config, flag, False):
            raise UnsupportedScheduleError(f"plan_hooks do not support {flag}=True: {why}; turn it off to run a plan")
    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vp is not None and int(vp) > 1:
        raise UnsupportedScheduleError(_interleaved(f"virtual_pipeline_model_parallel_size={vp}"))
    local = getattr(config, "cuda_graph_impl", "none") == "local" or getattr(config, "enable_cuda_graph", False)
    if local and _scopes_full_iteration(config):  # enable_cuda_graph: how releases before cuda_graph_impl said it
        raise UnsupportedScheduleError(
            "plan_hooks do not support a full-iteration CUDA graph (cuda_graph_impl=local, cuda_graph_scope "
            "full_iteration): the captured iteration replays without calling forward_step/backward_step, so no "
            "clock would switch, and a switch's device sync cannot run inside the capture; graph per layer "
            "(cuda_graph_scope attn, mlp) or not at all to run a plan")


def _scopes_full_iteration(config: Any) -> bool:
    """Whether megatron-core's ``cuda_graph_scope`` (a name, an enum or a list of either) holds full_iteration."""
    scope = getattr(config, "cuda_graph_scope", None)
    scopes = scope if isinstance(scope, (list, tuple, set)) else [scope]
    return any(getattr(x, "name", str(x)) == "full_iteration" for x in scopes)


def _interleaved(what: str) -> str:
    return (f"plan_hooks do not support the interleaved (virtual pipeline) schedule ({what}): its backwards "
            "do not follow the forwards first in, first out, so they would run at another instruction's clock")


def _model_config(model: Any) -> Any:
    """The config of a schedule call's model (a module or a list of chunks); None when it has none."""
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    while first is not None and getattr(first, "config", None) is None and hasattr(first, "module"):
        first = first.module  # DDP / Float16Module wrappers, as megatron-core's get_model_config unwraps them
    return getattr(first, "config", None)


def _arg(args: tuple, kwargs: dict, name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


class MicrobatchTracker:
    """Pairs backwards with forwards: each backward belongs to the oldest forward still waiting for one."""

    def __init__(self) -> None:
        self._waiting: deque[int] = deque()
        self._forwards = 0
        self.evaluation = False  # inside a forward_only schedule call: no switches

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
    orig_schedules = {name: getattr(mod, name) for name in SCHEDULE_FUNCTIONS if hasattr(mod, name)}
    tracker = MicrobatchTracker()

    def schedule(name: str, orig: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            evaluation = bool(kwargs.get("forward_only", False))
            if not evaluation:  # before the first send or receive, so every rank refuses alike
                if name == INTERLEAVED:  # ranks past the first would wait in a receive for one that raised
                    raise UnsupportedScheduleError(_interleaved(name))
                model_config = _model_config(kwargs.get("model"))
                if model_config is not None:  # some of them never call forward_step, whose check would tell
                    check_schedule(model_config)
                check_plan_fits(executor, kwargs.get("num_microbatches"), *_pipeline_position(kwargs))
            tracker.evaluation = evaluation
            try:
                return orig(*args, **kwargs)
            finally:
                tracker.evaluation = False

        run.__wrapped__ = orig  # type: ignore[attr-defined]
        return run

    def forward_step(*args: Any, **kwargs: Any) -> Any:
        if tracker.evaluation:  # no plan for evaluation: it runs at the clock it finds
            return orig_forward(*args, **kwargs)
        vp_stage = _arg(args, kwargs, "vp_stage", _FORWARD_VP_STAGE)
        if vp_stage is not None:
            raise UnsupportedScheduleError(_interleaved(f"forward_step got vp_stage={vp_stage}"))
        step_config = _arg(args, kwargs, "config", _FORWARD_CONFIG)
        if step_config is not None:
            check_schedule(step_config)
        check_plan_fits(executor, _arg(args, kwargs, "num_microbatches", _FORWARD_MICROBATCHES), None)
        mb = tracker.forward(_arg(args, kwargs, "current_microbatch", _FORWARD_MICROBATCH))
        executor.begin(mb, Direction.FWD)
        return orig_forward(*args, **kwargs)

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        executor.begin(tracker.backward(), Direction.BWD)
        return orig_backward(*args, **kwargs)

    forward_step.__wrapped__ = orig_forward  # type: ignore[attr-defined]
    backward_step.__wrapped__ = orig_backward  # type: ignore[attr-defined]
    mod.forward_step, mod.backward_step = forward_step, backward_step
    for name, orig in orig_schedules.items():
        setattr(mod, name, schedule(name, orig))
    unwinding: type[BaseException] | None = None  # what the block raised: sys.exc_info() inside an
    try:  # outer except handler names that handler's exception even when the block ends normally
        yield tracker
    except BaseException as err:
        unwinding = type(err)
        raise
    finally:
        mod.forward_step, mod.backward_step = orig_forward, orig_backward
        for name, orig in orig_schedules.items():
            setattr(mod, name, orig)
        # no hook switches clocks any more: give them back, without hiding the training step's own error
        from kareus.profiler.frequency import reset_while_unwinding

        reset_while_unwinding(executor.reset, unwinding)
