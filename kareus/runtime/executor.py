"""Runs an ExecutionPlan on one pipeline stage: the clock per instruction, slot and SMs per partition.

The training loop (or the megatron-core hook in ``kareus.runtime.megatron``) calls
``begin(microbatch, direction)`` before each pipeline instruction; the executor locks that
instruction's clock through the frequency controller (skipping a switch to the clock already
locked: switches cost milliseconds) and makes the instruction's partition settings current. Before a
switch it synchronises the device: kernels are queued ahead of the host, so a clock set at once would
land on the previous instruction's queued kernels (Zeus's pipeline frequency optimizer syncs too). The
code that runs a layer asks ``setting(key)`` (or ``slot``/``sms``) for each partition, or hands the
partition to ``run_partition`` on a backend that executes partitions. Leaving the executor (``with``)
resets the clocks, also after an exception.

The controller is any object with ``set(mhz)`` and ``reset()``: a ``FREQUENCY_CONTROLLERS`` entry
(``nvml``, ``zeus``) on real GPUs, a fake in tests.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kareus.plan.model import ExecutionPlan, InstructionPlan, PartitionSetting
from kareus.types import Direction, PartitionType


class ClockController(Protocol):
    def set(self, mhz: int) -> None: ...
    def reset(self) -> None: ...


def default_sync() -> Callable[[], None]:
    """``torch.cuda.synchronize`` where torch sees a GPU, else a no-op (CPU runs, planner-only installs)."""
    try:
        import torch
    except ImportError:
        return _no_sync
    return torch.cuda.synchronize if torch.cuda.is_available() else _no_sync


def _no_sync() -> None:
    pass


class PlanCoverageError(KeyError):
    """The plan has no entry for an instruction or partition the training loop runs."""

    def __str__(self) -> str:
        return str(self.args[0])


SWITCHES_KEPT = 1024  # clock switches an executor remembers (a list of every one grew by the iteration)


@dataclass(frozen=True)
class Switch:
    """One clock change the executor made (for logs and tests)."""

    microbatch: int
    direction: str
    mhz: int


class PlanExecutor:
    """Applies one stage's part of an execution plan, instruction by instruction."""

    def __init__(self, plan: ExecutionPlan, controller: ClockController, stage: int,
                 backend: Any = None, sync: Callable[[], None] | None = None) -> None:
        if not 0 <= stage < plan.num_stages:
            raise ValueError(f"stage {stage} is outside the plan's {plan.num_stages} stages")
        clocks = sorted({i.freq_mhz for i in plan.stages[stage].instructions})
        if getattr(controller, "locks_gpu", True) is None and len(clocks) > 1:
            # a controller that leaves the clock to the GPU cannot run a plan of several clocks
            raise ValueError(f"plan {plan.id} runs stage {stage} at {len(clocks)} clocks ({clocks[0]}..{clocks[-1]} "
                             "MHz), but its controller leaves the clock to the GPU; run it with "
                             "profiler/frequency=nvml or zeus, or pick a plan made with profiler/frequency=unlocked")
        self.plan = plan
        self.controller = controller
        self.sync = sync if sync is not None else default_sync()
        self.stage = stage
        self.backend = backend
        self.current: InstructionPlan | None = None
        self._settings: dict[str, PartitionSetting] = {}
        self._locked: int | None = None
        self.switches: deque[Switch] = deque(maxlen=SWITCHES_KEPT)  # the latest; a run lasts many iterations
        self.switch_count = 0
        self.instructions = 0

    @classmethod
    def from_file(cls, path: str, controller: ClockController, stage: int, backend: Any = None,
                  sync: Callable[[], None] | None = None) -> "PlanExecutor":
        """An executor for a plan saved by ``python -m kareus`` (validated YAML/JSON, never eval or pickle)."""
        from kareus.plan.io import load_plan

        return cls(load_plan(path), controller, stage, backend, sync)

    # -- instruction boundaries ----------------------------------------------------------------------
    def begin(self, microbatch: int, direction: Direction | str) -> InstructionPlan:
        """Lock the clock of (this stage, microbatch, direction) and make its partition settings current."""
        d = Direction(direction).value
        try:
            ins = self.plan.instruction(self.stage, microbatch, d)
        except (KeyError, IndexError):
            raise PlanCoverageError(f"plan {self.plan.id} has no {d} instruction for microbatch {microbatch} "
                                    f"on stage {self.stage} (it covers {self.plan.num_microbatches} "
                                    "microbatches)") from None
        if ins.freq_mhz != self._locked:
            # the previous instruction's settings end here: a failed sync or lock leaves none current
            self.current, self._settings = None, {}
            self.sync()  # the previous instruction's queued kernels finish at their own clock
            self.controller.set(int(ins.freq_mhz))
            self._locked = int(ins.freq_mhz)
            self.switches.append(Switch(microbatch, d, int(ins.freq_mhz)))
            self.switch_count += 1
        self.current = ins
        self._settings = {p.partition: p for p in ins.partitions}
        self.instructions += 1
        return ins

    def reset(self) -> None:
        """Give the clocks back (unlocked) once the last instruction's queued kernels ran at its clock;
        the next ``begin`` locks again. The clocks are given back even if the sync fails: after a sticky
        CUDA error every sync raises, and the GPU would stay locked."""
        try:
            if self._locked is not None:
                self.sync()
        finally:
            self._locked = None
            self.current = None
            self._settings = {}
            self.controller.reset()

    def __enter__(self) -> "PlanExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Reset; a reset that fails while the training step's own error unwinds is logged, not raised over it."""
        from kareus.profiler.frequency import reset_while_unwinding

        reset_while_unwinding(self.reset, exc[0])

    # -- what the layer code asks --------------------------------------------------------------------
    def setting(self, partition: str) -> PartitionSetting:
        if self.current is None:
            raise RuntimeError("no instruction is running: call begin(microbatch, direction) first")
        try:
            return self._settings[partition]
        except KeyError:
            known = ", ".join(sorted(self._settings)) or "(none)"
            raise PlanCoverageError(f"the plan's {self.current.direction} instruction on stage {self.stage} has "
                                    f"no setting for partition {partition!r}; it has: {known}") from None

    def megatron_layout(self) -> bool:
        """Whether the current instruction runs Megatron's own layout (the microbatch unsplit, only
        megatron-core's own overlap): its partitions carry the ``megatron:`` prefix, and layer code
        must not split it."""
        from kareus.partition.sequential import MEGATRON_PREFIX

        if self.current is None:
            raise RuntimeError("no instruction is running: call begin(microbatch, direction) first")
        return bool(self._settings) and all(k.startswith(MEGATRON_PREFIX) for k in self._settings)

    def slot(self, partition: str) -> str:
        return self.setting(partition).slot

    def sms(self, partition: str) -> int:
        return int(self.setting(partition).sms)

    def run_partition(self, partition: PartitionType) -> None:
        """Execute one occurrence of the partition on the backend with the current instruction's knobs."""
        if self.backend is None:
            raise RuntimeError("this executor has no backend to run partitions on")
        s = self.setting(partition.key)
        self.backend.run_partition(partition, s.slot, int(s.sms))
