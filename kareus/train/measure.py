"""Per-iteration measurements on every rank, gathered on all: wall time (CUDA events on a GPU), GPU
energy (the NVML counter or a Zeus window, as ``hardware.energy`` says; None where unmeasured, never
invented), and the saving of one layout over another with a confidence interval over paired blocks."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Iteration:
    iteration: int
    layout: str  # "plan" | "megatron"
    block: int  # which block of a comparison (0 outside one)
    loss: float
    time_s: float  # the slowest rank's
    energy_j: float | None  # summed over every rank's GPU; None where any is unmeasured
    clock_switches: int  # the busiest rank's


class Meter:
    """One rank's iteration window: CUDA events and an energy window on a GPU, wall clock on the CPU."""

    def __init__(self, device: Any, energy: str, nvml_index: int = -1) -> None:
        import torch

        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.device = device
        self.meter: Any = None
        self.unmetered = "the CPU has no GPU energy counter"
        if self.cuda:
            from kareus.runtime.telemetry import NVMLDevice, NoEnergy, energy_meter, nvml_index as to_nvml

            index = device.index if device.index is not None else torch.cuda.current_device()
            try:
                nvml = NVMLDevice(to_nvml(index, nvml_index)) if energy == "nvml" else None
            except Exception as e:  # noqa: BLE001  (no NVML: time is still measured)
                nvml, self.unmetered = None, f"NVML unavailable ({type(e).__name__}: {e})"
            meter = energy_meter(energy, nvml, index, nvml_index)
            self.meter = None if isinstance(meter, NoEnergy) else meter
            if isinstance(meter, NoEnergy):
                self.unmetered = meter.reason
        self._t0 = 0.0
        self._events: Any = None

    def begin(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = start
        if self.meter is not None:
            self.meter.begin()
        self._t0 = time.perf_counter()

    def end(self) -> tuple[float, float | None]:
        import torch

        if self.cuda:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            torch.cuda.synchronize(self.device)
            elapsed = self._events.elapsed_time(stop) / 1000.0
        else:
            elapsed = time.perf_counter() - self._t0
        energy = self.meter.end() if self.meter is not None else None
        return elapsed, energy


def gather(values: Sequence[float | None]) -> list[list[float | None]]:
    """Every rank's ``values`` (None travels as NaN), in rank order."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [[None if math.isnan(x) else x for x in mine.tolist()]]
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [[None if math.isnan(x) else x for x in p.cpu().tolist()] for p in parts]


@dataclass(frozen=True)
class Saving:
    mean: float
    low: float
    high: float


def paired_saving(candidate: Sequence[Sequence[float]], baseline: Sequence[Sequence[float]],
                  level: float = 0.95) -> Saving | None:
    """The saving ``1 - candidate / baseline`` of the means over all iterations, with a t interval over the
    per-block savings (blocks alternate, so drift and heat hit both alike). None with fewer than 2 blocks."""
    from scipy import stats

    pairs = [(statistics.fmean(a), statistics.fmean(b)) for a, b in zip(candidate, baseline) if a and b]
    if len(pairs) < 2:
        return None
    per_block = [1.0 - a / b for a, b in pairs]
    mean = 1.0 - statistics.fmean(x for blk in candidate for x in blk) / statistics.fmean(x for blk in baseline for x in blk)
    half = stats.t.ppf(0.5 + level / 2, len(per_block) - 1) * statistics.stdev(per_block) / math.sqrt(len(per_block))
    return Saving(mean, mean - half, mean + half)
