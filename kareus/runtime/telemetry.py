"""Reading a real GPU: energy over a window (NVML counter or Zeus), SM clock, temperature, power.

Only reads: nothing here changes clocks or power limits (the frequency controllers do that).
NVML comes from nvidia-ml-py (module ``pynvml``) and Zeus are imported lazily.
"""
from __future__ import annotations

import os
from typing import Any, Protocol


class EnergyUnavailable(RuntimeError):
    """No energy meter on this device (CPU runs, a GPU without the NVML energy counter)."""


def _torch_cuda() -> Any:
    """``torch.cuda`` where a CUDA build of torch sees a GPU, else None (the planner runs without torch)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def own_cuda_index() -> int:
    """This process's CUDA device: torch's current device once CUDA is initialised, else LOCAL_RANK.

    Under torchrun each rank drives the GPU numbered LOCAL_RANK; reading ``current_device()`` before
    anything selected a device would initialise CUDA on device 0, so LOCAL_RANK is used then.
    """
    cuda = _torch_cuda()
    if cuda is not None and cuda.is_initialized():
        return int(cuda.current_device())
    return int(os.environ.get("LOCAL_RANK", "0"))


def _visible_entry(cuda_index: int) -> str | None:
    """The CUDA_VISIBLE_DEVICES entry of a CUDA device (an NVML index or a UUID), None when unset."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    parts = [p.strip() for p in vis.split(",")] if vis else []
    return parts[cuda_index] if 0 <= cuda_index < len(parts) and parts[cuda_index] else None


def cuda_uuid(cuda_index: int) -> str | None:
    """NVML's UUID (``GPU-...``) of a CUDA device, or None where neither torch nor the environment says.

    torch reports the UUID CUDA itself uses, which is the only safe key: NVML numbers GPUs by PCI bus,
    CUDA fastest-first by default, and CUDA_VISIBLE_DEVICES renumbers (and may hold UUIDs).
    """
    cuda = _torch_cuda()
    if cuda is not None:
        uuid = str(cuda.get_device_properties(cuda_index).uuid)
    else:
        uuid = _visible_entry(cuda_index) or ""
        if uuid.isdigit():
            return None
    if not uuid:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def nvml_handle(nvml: Any, cuda_index: int, override: int = -1) -> Any:
    """NVML handle of a CUDA device (``nvml`` is the initialised pynvml module): by UUID where known.

    ``override`` >= 0 names the NVML index outright. Without torch or a UUID, a numeric
    CUDA_VISIBLE_DEVICES entry is the NVML index, else the CUDA index is taken as it.
    """
    if override >= 0:
        return nvml.nvmlDeviceGetHandleByIndex(int(override))
    uuid = cuda_uuid(cuda_index)
    if uuid is not None:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    entry = _visible_entry(cuda_index)
    return nvml.nvmlDeviceGetHandleByIndex(int(entry) if entry is not None else int(cuda_index))


def nvml_index(cuda_index: int, override: int = -1) -> int:
    """NVML index of a CUDA device (matched by UUID, see :func:`nvml_handle`)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetIndex(nvml_handle(pynvml, cuda_index, override)))
    finally:
        pynvml.nvmlShutdown()


def zeus_index(gpus: Any, cuda_index: int, override: int = -1) -> int:
    """Index of a CUDA device among Zeus's GPUs (``zeus.device.get_gpus()``), matched by UUID.

    Zeus numbers the CUDA_VISIBLE_DEVICES entries (or every NVML GPU) in NVML order; where it exposes
    NVML handles the entry with this device's UUID is taken, else the CUDA index. ``override`` >= 0
    names the GPU by its NVML index (``hardware.nvml_index``), as :func:`nvml_handle` takes it.
    """
    members = getattr(gpus, "gpus", None)
    if override >= 0:
        return _zeus_index_of_nvml(members, int(override))
    uuid = cuda_uuid(cuda_index)
    if uuid is None or members is None:
        return int(cuda_index)
    import pynvml

    for i, gpu in enumerate(members):
        handle = getattr(gpu, "handle", None)
        if handle is None:
            continue
        found = pynvml.nvmlDeviceGetUUID(handle)
        if (found.decode() if isinstance(found, bytes) else str(found)) == uuid:
            return i
    return int(cuda_index)


def _zeus_index_of_nvml(members: Any, nvml_index: int) -> int:
    """Zeus's index of the GPU NVML numbers ``nvml_index``: by its handle where Zeus exposes one, else
    by its place among numeric CUDA_VISIBLE_DEVICES entries (every NVML GPU, in order, when unset)."""
    handles = [getattr(gpu, "handle", None) for gpu in members or ()]
    if handles and all(h is not None for h in handles):
        import pynvml

        for i, handle in enumerate(handles):
            if int(pynvml.nvmlDeviceGetIndex(handle)) == nvml_index:
                return i
    else:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if not vis:
            return nvml_index
        entries = [p.strip() for p in vis.split(",")]
        if str(nvml_index) in entries:
            return entries.index(str(nvml_index))
    raise ValueError(f"hardware.nvml_index: NVML GPU {nvml_index} is not among Zeus's GPUs "
                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}); "
                     f"allowed: an NVML index Zeus sees, or -1 for this process's own GPU")


class NVMLDevice:
    """Read-only NVML telemetry of one GPU."""

    def __init__(self, index: int) -> None:
        import pynvml

        self._nvml = pynvml
        self._temperature_v = hasattr(pynvml, "nvmlDeviceGetTemperatureV")
        pynvml.nvmlInit()
        self.index = index
        try:
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no such GPU: NVML is not left initialised by an object nobody can close
            pynvml.nvmlShutdown()
            raise

    def name(self) -> str:
        n = self._nvml.nvmlDeviceGetName(self.handle)
        return n.decode() if isinstance(n, bytes) else str(n)

    def temperature_c(self) -> float:
        """nvmlDeviceGetTemperatureV where the driver has it: the older call is deprecated and goes with
        CUDA 14, and a failing read would leave the thermal cooldown seeing an idle GPU."""
        nvml = self._nvml
        if self._temperature_v:
            try:
                return float(nvml.nvmlDeviceGetTemperatureV(self.handle, nvml.NVML_TEMPERATURE_GPU))
            except nvml.NVMLError_FunctionNotFound:  # a driver from before it
                self._temperature_v = False
        return float(nvml.nvmlDeviceGetTemperature(self.handle, nvml.NVML_TEMPERATURE_GPU))

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
    """Energy from a ZeusMonitor window over the GPU torch runs on as ``cuda:<cuda_index>``."""

    name = "zeus"

    def __init__(self, cuda_index: int, nvml_override: int = -1) -> None:
        from zeus.device import get_gpus
        from zeus.monitor import ZeusMonitor

        gpu_index = zeus_index(get_gpus(), cuda_index, nvml_override)
        self.gpu_index = gpu_index
        self.monitor = ZeusMonitor(gpu_indices=[gpu_index], cpu_indices=[], sync_execution_with="torch")
        self._n = 0

    def begin(self) -> None:
        self._n += 1
        self.monitor.begin_window(f"kareus_{self._n}", sync_execution=False)

    def end(self) -> float:
        m = self.monitor.end_window(f"kareus_{self._n}", sync_execution=False)
        return float(m.gpu_energy[self.gpu_index])


def energy_meter(kind: str, device: NVMLDevice | None, cuda_index: int, nvml_override: int = -1) -> Any:
    """The configured meter, or a NoEnergy that says why none is available. ``nvml_override`` >= 0 is
    ``hardware.nvml_index``: the GPU to read, by NVML index (``device`` is already that GPU)."""
    if kind == "none":
        return NoEnergy("energy metering is off (hardware.energy=none)")
    if kind == "zeus":
        try:
            return ZeusEnergy(cuda_index, nvml_override)
        except ImportError:
            raise
        except Exception as e:  # e.g. Zeus reads CUDA_VISIBLE_DEVICES as integers: UUIDs and MIG fail
            return NoEnergy(f"Zeus could not open cuda:{cuda_index} ({type(e).__name__}: {e}); "
                            f"try hardware.energy=nvml")
    if kind == "nvml":
        if device is None:
            return NoEnergy("no NVML device: energy needs an NVIDIA GPU and nvidia-ml-py")
        try:  # read once: a GPU without the counter (pre-Volta, some virtual GPUs) would fail every window
            device.energy_j()
        except Exception as e:
            what = ("has no total-energy counter" if "NotSupported" in type(e).__name__
                    else "could not read its total-energy counter")  # no permission, a GPU fallen off the bus
            return NoEnergy(f"this GPU's NVML {what} ({type(e).__name__}: {e})")
        return NVMLEnergy(device)
    raise ValueError(f"unknown energy meter {kind!r}; use nvml, zeus or none")
