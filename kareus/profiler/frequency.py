"""Frequency controllers: lock the SM clock a candidate asks for, and always give it back.

Registered in ``FREQUENCY_CONTROLLERS``; built with ``FREQUENCY_CONTROLLERS.build(name, backend,
config=section)``. A controller is a context manager: leaving it (normally or by an exception)
resets the clocks, so a crashed search never leaves a GPU locked at a low clock; while a real
controller holds a lock, SIGTERM raises SystemExit so that reset runs then too.
NVML and Zeus are imported lazily: the planner runs without them.
"""
from __future__ import annotations

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


class SigtermGuard:
    """Turns SIGTERM into SystemExit while clocks are locked, so ``finally``/``with`` resets them.

    A scheduler's SIGTERM (job cancelled, preempted) would otherwise kill the process without unwinding,
    leaving the GPU locked at a low clock for whoever runs next. Python lets only the main thread
    install handlers; elsewhere this does nothing. The previous handler comes back on ``restore``.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self.installed = False

    def install(self) -> None:
        import signal

        if self.installed or _not_main_thread():
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _raise_system_exit)
        self.installed = True

    def restore(self) -> None:
        import signal

        if not self.installed or _not_main_thread():
            return
        previous = self._previous if self._previous is not None else signal.SIG_DFL  # None: set outside Python
        signal.signal(signal.SIGTERM, previous)
        self.installed = False
        self._previous = None


def _not_main_thread() -> bool:
    import threading

    return threading.current_thread() is not threading.main_thread()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _release(backend: HardwareBackend | None) -> None:
    """Tell a backend that checks its clock against NVML that no clock is locked any more."""
    release = getattr(backend, "release_clock", None)
    if callable(release):
        release()


@dataclass
class NVMLFrequencyConfig:
    name: str = "nvml"
    devices: list[int] = field(default_factory=list)  # NVML indices to lock; [] = this process's own GPU


@FREQUENCY_CONTROLLERS.register("nvml", NVMLFrequencyConfig)
class NVMLFrequencyController(FrequencyController):
    """Locks GPUs with ``nvmlDeviceSetGpuLockedClocks`` (needs admin rights).

    Without ``devices`` it locks only this process's GPU (the current CUDA device, matched to NVML by
    UUID): one process runs per GPU of the group, and each must lock the GPU whose energy it reads,
    not its neighbours'.
    """

    locks_gpu = True

    def __init__(self, cfg: NVMLFrequencyConfig, backend: HardwareBackend | None = None) -> None:
        import pynvml  # provided by nvidia-ml-py

        from kareus.runtime.telemetry import nvml_handle, own_cuda_index

        self.cfg = cfg
        self.backend = backend
        self._nvml = pynvml
        pynvml.nvmlInit()
        self._open = True
        self._guard = SigtermGuard()
        if cfg.devices:
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(int(i)) for i in cfg.devices]
        else:
            self._handles = [nvml_handle(pynvml, own_cuda_index())]

    def set(self, mhz: int) -> None:
        if self.locked == mhz:
            return
        self._guard.install()
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
        _release(self.backend)
        self._guard.restore()
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._guard.restore()
        if self._open:
            self._open = False
            self._nvml.nvmlShutdown()


@dataclass
class ZeusFrequencyConfig:
    name: str = "zeus"
    devices: list[int] = field(default_factory=list)  # indices among Zeus's GPUs; [] = this process's own GPU


@FREQUENCY_CONTROLLERS.register("zeus", ZeusFrequencyConfig)
class ZeusFrequencyController(FrequencyController):
    """Locks clocks through Zeus's device layer (which also works through the ``zeusd`` daemon).

    Without ``devices`` it locks only this process's GPU (see :class:`NVMLFrequencyController`).
    """

    locks_gpu = True

    def __init__(self, cfg: ZeusFrequencyConfig, backend: HardwareBackend | None = None) -> None:
        from zeus.device import get_gpus

        from kareus.runtime.telemetry import own_cuda_index, zeus_index

        self.cfg = cfg
        self.backend = backend
        self._gpus = get_gpus()
        self._guard = SigtermGuard()
        self._indices = list(cfg.devices) if cfg.devices else [zeus_index(self._gpus, own_cuda_index())]

    def _call(self, method: str, index: int, *args: int) -> None:
        gpus = self._gpus
        if hasattr(gpus, "gpus"):  # per-device objects: gpus.gpus[i].set_gpu_locked_clocks(lo, hi)
            getattr(gpus.gpus[index], method)(*args)
        else:  # older collection API: gpus.set_gpu_locked_clocks(i, lo, hi)
            getattr(gpus, method)(index, *args)

    def set(self, mhz: int) -> None:
        if self.locked == mhz:
            return
        self._guard.install()
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
        _release(self.backend)
        self._guard.restore()
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._guard.restore()
