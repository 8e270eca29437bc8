"""Reading a real GPU: energy over a window (NVML counter or Zeus), SM clock, temperature, power.

Only reads: nothing here changes clocks or power limits (the frequency controllers do that).
NVML comes from nvidia-ml-py (module ``pynvml``) and Zeus are imported lazily.
"""
from __future__ import annotations

import os
from typing import Any, Protocol


class EnergyUnavailable(RuntimeError):
    """No energy meter on this device (CPU runs, a GPU without the NVML energy counter)."""


def nvml_index(torch_index: int, override: int = -1) -> int:
    """NVML index of a torch CUDA device: the override, else through CUDA_VISIBLE_DEVICES, else the same."""
    if override >= 0:
        return override
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    parts = [p.strip() for p in vis.split(",")] if vis else []
    if parts and all(p.isdigit() for p in parts) and torch_index < len(parts):
        return int(parts[torch_index])
    return torch_index


class NVMLDevice:
    """Read-only NVML telemetry of one GPU."""

    def __init__(self, index: int) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.index = index
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def name(self) -> str:
        n = self._nvml.nvmlDeviceGetName(self.handle)
        return n.decode() if isinstance(n, bytes) else str(n)

    def temperature_c(self) -> float:
        return float(self._nvml.nvmlDeviceGetTemperature(self.handle, self._nvml.NVML_TEMPERATURE_GPU))

    def sm_clock_mhz(self) -> float:
        return float(self._nvml.nvmlDeviceGetClockInfo(self.handle, self._nvml.NVML_CLOCK_SM))

    def max_sm_clock_mhz(self) -> float:
        return float(self._nvml.nvmlDeviceGetMaxClockInfo(self.handle, self._nvml.NVML_CLOCK_SM))

    def power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0

    def power_limit_w(self) -> float:
        return self._nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000.0

    def energy_j(self) -> float:
        """The board's total energy counter (Volta and newer), in joules."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # pragma: no cover - shutdown after a failed init
            pass


class EnergyMeter(Protocol):
    """A measurement window: ``begin()`` then ``end()`` gives the joules in between."""

    name: str

    def begin(self) -> None: ...
    def end(self) -> float: ...


class NoEnergy:
    name = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def begin(self) -> None:
        pass

    def end(self) -> float:
        raise EnergyUnavailable(self.reason)


class NVMLEnergy:
    """Energy from the NVML total-energy counter (it updates every few tens of ms: use windows >= 0.1 s)."""

    name = "nvml"

    def __init__(self, device: NVMLDevice) -> None:
        self.device = device
        self._start: float | None = None

    def begin(self) -> None:
        self._start = self.device.energy_j()

    def end(self) -> float:
        if self._start is None:
            raise RuntimeError("energy window ended before it began")
        e = self.device.energy_j() - self._start
        self._start = None
        return e


class ZeusEnergy:
    """Energy from a ZeusMonitor window (``gpu_index`` among the visible GPUs)."""

    name = "zeus"

    def __init__(self, gpu_index: int) -> None:
        from zeus.monitor import ZeusMonitor

        self.gpu_index = gpu_index
        self.monitor = ZeusMonitor(gpu_indices=[gpu_index], cpu_indices=[], sync_execution_with="torch")
        self._n = 0

    def begin(self) -> None:
        self._n += 1
        self.monitor.begin_window(f"kareus_{self._n}", sync_execution=False)

    def end(self) -> float:
        m = self.monitor.end_window(f"kareus_{self._n}", sync_execution=False)
        return float(m.gpu_energy[self.gpu_index])


def energy_meter(kind: str, device: NVMLDevice | None, gpu_index: int) -> Any:
    """The configured meter, or a NoEnergy that says why none is available."""
    if kind == "none":
        return NoEnergy("energy metering is off (hardware.energy=none)")
    if kind == "zeus":
        return ZeusEnergy(gpu_index)
    if kind == "nvml":
        if device is None:
            return NoEnergy("no NVML device: energy needs an NVIDIA GPU and nvidia-ml-py")
        return NVMLEnergy(device)
    raise ValueError(f"unknown energy meter {kind!r}; use nvml, zeus or none")
