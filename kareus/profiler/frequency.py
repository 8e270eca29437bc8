"""Frequency controllers: lock the SM clock a candidate asks for, and always give it back.

Registered in ``FREQUENCY_CONTROLLERS``; built with ``FREQUENCY_CONTROLLERS.build(name, backend,
config=section)``. A controller is a context manager: leaving it (normally or by an exception)
resets the clocks, so a crashed search never leaves a GPU locked at a low clock.
NVML and Zeus are imported lazily: the planner runs without them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kareus.hardware.base import HardwareBackend
from kareus.registry import FREQUENCY_CONTROLLERS


class FrequencyController:
    """Base: ``set(mhz)`` locks, ``reset()`` unlocks; ``with controller:`` guarantees the reset."""

    locked: int | None = None

    def set(self, mhz: int) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release handles after the reset (NVML shutdown)."""

    def __enter__(self) -> "FrequencyController":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.reset()
        finally:
            self.close()


@dataclass
class SimFrequencyConfig:
    name: str = "sim"


@FREQUENCY_CONTROLLERS.register("sim", SimFrequencyConfig)
class SimFrequencyController(FrequencyController):
    """Sets the (simulated or replayed) backend's clock; reset returns it to the maximum clock."""

    def __init__(self, cfg: SimFrequencyConfig, backend: HardwareBackend) -> None:
        self.cfg = cfg
        self.backend = backend

    def set(self, mhz: int) -> None:
        if self.locked != mhz:
            self.backend.set_clock(int(mhz))
            self.locked = int(mhz)

    def reset(self) -> None:
        self.backend.set_clock(self.backend.gpu.max_mhz)
        self.locked = None


def _visible_indices(devices: list[int]) -> list[int]:
    """NVML indices of the GPUs to lock: the configured ones, else CUDA_VISIBLE_DEVICES, else GPU 0."""
    if devices:
        return list(devices)
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if vis and all(p.strip().isdigit() for p in vis.split(",")):
        return [int(p) for p in vis.split(",")]
    return [0]


@dataclass
class NVMLFrequencyConfig:
    name: str = "nvml"
    devices: list[int] = field(default_factory=list)  # NVML indices (the TP group); [] = visible GPUs


@FREQUENCY_CONTROLLERS.register("nvml", NVMLFrequencyConfig)
class NVMLFrequencyController(FrequencyController):
    """Locks every GPU of the group with ``nvmlDeviceSetGpuLockedClocks`` (needs admin rights)."""

    def __init__(self, cfg: NVMLFrequencyConfig, backend: HardwareBackend | None = None) -> None:
        import pynvml  # provided by nvidia-ml-py

        self.cfg = cfg
        self.backend = backend
        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible_indices(cfg.devices)]
        self._open = True

    def set(self, mhz: int) -> None:
        if self.locked == mhz:
            return
        for h in self._handles:
            self._nvml.nvmlDeviceSetGpuLockedClocks(h, int(mhz), int(mhz))
        self.locked = int(mhz)
        if self.backend is not None:
            self.backend.set_clock(int(mhz))  # bookkeeping only: the backend records the locked clock

    def reset(self) -> None:
        errors = []
        for h in self._handles:  # reset every GPU even if one fails
            try:
                self._nvml.nvmlDeviceResetGpuLockedClocks(h)
            except Exception as e:  # pragma: no cover - needs a GPU
                errors.append(e)
        self.locked = None
        if errors:
            raise errors[0]

    def close(self) -> None:
        if self._open:
            self._open = False
            self._nvml.nvmlShutdown()


@dataclass
class ZeusFrequencyConfig:
    name: str = "zeus"
    devices: list[int] = field(default_factory=list)  # indices among the visible GPUs; [] = all visible


@FREQUENCY_CONTROLLERS.register("zeus", ZeusFrequencyConfig)
class ZeusFrequencyController(FrequencyController):
    """Locks clocks through Zeus's device layer (which also works through the ``zeusd`` daemon)."""

    def __init__(self, cfg: ZeusFrequencyConfig, backend: HardwareBackend | None = None) -> None:
        from zeus.device import get_gpus

        self.cfg = cfg
        self.backend = backend
        self._gpus = get_gpus()
        n = len(self._gpus)
        self._indices = list(cfg.devices) if cfg.devices else list(range(n))

    def _call(self, method: str, index: int, *args: int) -> None:
        gpus = self._gpus
        if hasattr(gpus, "gpus"):  # per-device objects: gpus.gpus[i].set_gpu_locked_clocks(lo, hi)
            getattr(gpus.gpus[index], method)(*args)
        else:  # older collection API: gpus.set_gpu_locked_clocks(i, lo, hi)
            getattr(gpus, method)(index, *args)

    def set(self, mhz: int) -> None:
        if self.locked == mhz:
            return
        for i in self._indices:
            self._call("set_gpu_locked_clocks", i, int(mhz), int(mhz))
        self.locked = int(mhz)
        if self.backend is not None:
            self.backend.set_clock(int(mhz))

    def reset(self) -> None:
        errors = []
        for i in self._indices:
            try:
                self._call("reset_gpu_locked_clocks", i)
            except Exception as e:  # pragma: no cover - needs a GPU
                errors.append(e)
        self.locked = None
        if errors:
            raise errors[0]
