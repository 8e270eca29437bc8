"""The contract every hardware backend (sim, replay, cuda) fulfils, so profilers stay backend-agnostic."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from kareus.types import Candidate, Op, PartitionType, Reading


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet facts that sizing, validation and search spaces need."""

    name: str
    sms: int
    min_mhz: int
    max_mhz: int
    step_mhz: int
    static_power_w: float  # the published definition: power of a GPU blocked in a pipeline receive
    tdp_w: float
    idle_power_w: float
    memory_gb: float
    hbm_gbps: float
    nvlink_gbps: float
    network_gbps: float
    peak_tflops: float
    gpus_per_node: int = 8
    max_comm_sms: int = 32  # the largest SM count a comm kernel is given in the search space
    default_comm_sms: int = 16  # what the comm library uses untuned: the Megatron reference's SM count
    clock_switch_s: float = 0.0  # GPU idle time per clock change between instructions (device drain + lock)

    def clocks(self, step_mhz: int | None = None, min_mhz: int | None = None, max_mhz: int | None = None) -> list[int]:
        """Supported locked SM clocks, high to low is not implied: ascending order."""
        step = step_mhz or self.step_mhz
        lo = self.min_mhz if min_mhz is None else min_mhz
        hi = self.max_mhz if max_mhz is None else max_mhz
        return [f for f in range(self.max_mhz, lo - 1, -step) if f <= hi][::-1]

    def supports_clock(self, mhz: float) -> bool:
        """Whether ``mhz`` is a clock this GPU can lock: whole, in range, on its step grid (1410.9 is
        not 1410)."""
        if not float(mhz).is_integer():
            return False
        mhz = int(mhz)
        return self.min_mhz <= mhz <= self.max_mhz and (self.max_mhz - mhz) % self.step_mhz == 0

    def check_clock(self, mhz: float) -> None:
        """Raise ValueError, naming the GPU's range and step, unless ``mhz`` is a clock it can lock."""
        if not self.supports_clock(mhz):
            raise ValueError(self.clock_problem(mhz))

    def clock_problem(self, mhz: float) -> str | None:
        """Why ``mhz`` is no clock this GPU can lock (its range and step named), or None."""
        if self.supports_clock(mhz):
            return None
        return (f"{self.name} has no locked clock {mhz} MHz "
                f"({self.min_mhz}..{self.max_mhz} in {self.step_mhz} MHz steps)")


@runtime_checkable
class HardwareBackend(Protocol):
    """Executes partitions under a candidate's knobs and reads time and energy over a window.

    The clock is set through a frequency controller (``set_clock``) before measuring; ``measure``
    runs the partition back to back for about ``window_s`` seconds and returns per-execution values.
    ``now`` is GPU-seconds: virtual on the simulated GPU, wall time on real ones.
    """

    gpu: GPUSpec
    name: str

    def set_clock(self, mhz: int) -> None: ...
    def clock(self) -> int: ...
    def temperature(self) -> float: ...
    def idle_temperature(self) -> float: ...
    def now(self) -> float: ...
    def idle(self, seconds: float) -> None:
        """Leave the GPU idle (a cooldown): sleeps on real GPUs, advances the virtual clock in sim."""
    def run_once(self, partition: PartitionType, candidate: Candidate) -> float:
        """Time of one execution (calibration / warm-up); no energy reading."""
    def measure(self, partition: PartitionType, candidate: Candidate, window_s: float) -> Reading: ...
    def measure_ops(self, ops: Sequence[Op], window_s: float) -> Reading:
        """Time and energy of a plain op sequence at the current clock (non-partition work)."""
    def space(self, partition: PartitionType) -> list[Candidate] | None:
        """The exact candidate set this backend can answer (replay), or None (any candidate)."""


class LockedClock:
    """Clock bookkeeping every backend shares: a frequency controller locks the clock, the backend
    records it (never touching the GPU itself) and refuses to measure a candidate at another clock."""

    gpu: GPUSpec
    _clock: int

    def set_clock(self, mhz: int) -> None:
        self.gpu.check_clock(mhz)
        self._clock = int(mhz)

    def clock(self) -> int:
        return self._clock

    def check_clock(self, candidate: Candidate) -> None:
        if int(candidate.freq_mhz) != self._clock:
            raise ValueError(f"candidate clock {candidate.freq_mhz} MHz differs from the locked clock "
                             f"{self._clock} MHz; lock it with the frequency controller (set_clock) first")
