"""Frequency controllers: lock the SM clock a candidate asks for, and always give it back.

Registered in ``FREQUENCY_CONTROLLERS``; built with ``FREQUENCY_CONTROLLERS.build(name, backend,
config=section)``. A controller is a context manager: leaving it (normally or by an exception)
resets the clocks, so a crashed search never leaves a GPU locked at a low clock; while a real
controller holds a lock, SIGTERM and SIGHUP raise SystemExit so that reset runs then too.
NVML and Zeus are imported lazily: the planner runs without them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kareus.errors import KareusError
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


def reset_while_unwinding(reset: Callable[[], None], unwinding: type[BaseException] | None) -> None:
    """Run ``reset``; while another error unwinds (``unwinding``), a reset that fails is logged instead
    of raised over that error, which is the one the user needs to see."""
    if unwinding is None:
        reset()
        return
    try:
        reset()
    except Exception as e:
        import logging

        logging.getLogger(__name__).error("could not reset the locked GPU clocks after %s (%s: %s); reset them "
                                          "with `nvidia-smi -rgc`", unwinding.__name__, type(e).__name__, e)


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
            self.locked = None  # until the backend holds it: a refused clock is not the one measured at
            self.backend.set_clock(int(mhz))
            self.locked = int(mhz)

    def reset(self) -> None:
        self.backend.set_clock(self.backend.gpu.max_mhz)
        self.locked = None


@dataclass
class UnlockedFrequencyConfig:
    name: str = "unlocked"


@FREQUENCY_CONTROLLERS.register("unlocked", UnlockedFrequencyConfig)
class UnlockedFrequencyController(FrequencyController):
    """Leaves the clock to the GPU (its own boost, power and thermal management) and never touches it.

    For users who may not lock clocks (no admin rights, no zeusd), and for checks on a GPU whose
    clocks must stay as found: the search covers launch slots and comm SMs at one nominal clock, the
    hardware's top clock (``+experiment=no_clock_search``), and each reading carries the clock NVML
    sampled. Plans then keep every instruction at that clock, so they save static energy by overlap
    but no dynamic energy by clock; a clock other than the top is refused.
    """

    locks_gpu = None  # neither locks nor needs a lock: valid on real and simulated backends

    def __init__(self, cfg: UnlockedFrequencyConfig, backend: HardwareBackend | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        # without a backend (a plan executor's controller) the first clock asked for stands for the top
        self._top: int | None = backend.gpu.max_mhz if backend is not None else None

    def set(self, mhz: int) -> None:
        if self.locked == mhz:
            return
        if self._top is None:
            self._top = int(mhz)
        top = self._top
        if int(mhz) != top:
            raise KareusError(f"profiler.frequency=unlocked leaves the clock to the GPU, so it measures at the "
                              f"top clock ({top} MHz) alone, not {mhz} MHz; add +experiment=no_clock_search, "
                              f"or lock clocks with profiler/frequency=nvml or zeus")
        if self.backend is not None:
            from kareus.hardware.base import LockedClock

            LockedClock.set_clock(self.backend, int(mhz))  # bookkeeping only, not a lock to hold windows to
        self.locked = int(mhz)

    def reset(self) -> None:
        self.locked = None  # the clock was never locked; the first clock asked for still stands


class SignalGuard:
    """Turns SIGTERM and SIGHUP into SystemExit while clocks are locked, so ``finally``/``with`` resets them.

    A scheduler's SIGTERM (job cancelled, preempted) or a closed terminal's SIGHUP would otherwise kill
    the process without unwinding, leaving the GPU locked at a low clock for whoever runs next. Python
    lets only the main thread install handlers; elsewhere this does nothing. The previous handlers come
    back on ``restore``. Only a signal left at its default (which kills without unwinding) is guarded:
    one the process ignores (``nohup`` ignores SIGHUP) stays ignored, and one the program handles keeps
    its handler, which decides how the run ends (Megatron's ``--exit-signal-handler`` sets a flag, and the
    training loop saves a checkpoint and exits, through the ``finally`` that resets the clocks). What no
    handler can catch (SIGKILL, an abort in native code) leaves the lock in place: ``nvidia-smi -rgc``
    resets it.
    """

    SIGNALS = ("SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self.installed = False

    def install(self) -> None:
        import signal

        if self.installed or _not_main_thread():
            return
        for name in self.SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None or signal.getsignal(signum) not in (signal.SIG_DFL, None):
                continue  # ignored on purpose (nohup), or the program's own handler: its policy stands
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, _raise_system_exit)
        self.installed = True

    def restore(self) -> None:
        import signal

        if not self.installed or _not_main_thread():
            return
        for signum, previous in self._previous.items():  # None: a handler set outside Python
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self.installed = False
        self._previous = {}


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


# what a clock lock refused with means: this process may not lock clocks on this GPU at all
_DENIED = {"NVMLError_NoPermission": "locking GPU clocks needs admin rights",
           "ZeusGPUNoPermissionError": "locking GPU clocks needs admin rights (or the zeusd daemon)",
           "NVMLError_NotSupported": "this GPU does not support locked clocks",
           "ZeusGPUNotSupportedError": "this GPU does not support locked clocks"}


class DeviceLockController(FrequencyController):
    """What the controllers of real GPUs share: lock every device they hold, after checking the
    clock against the GPU's range; reset the devices they locked, and only those; SIGTERM and SIGHUP unwind
    while a lock is held. A refusal that every candidate would meet alike (no admin rights, no
    locked-clock support) stops the search with one line instead of failing candidate after candidate.
    Every lock and reset is recorded in the node's state file (:mod:`kareus.runtime.clock_state`), so
    ``python -m kareus mode=reset`` can give back what a killed process left locked."""

    locks_gpu = True
    name = ""
    backend: HardwareBackend | None = None

    def __init__(self, devices: list[Any], backend: HardwareBackend | None) -> None:
        self.backend = backend
        self._devices = devices
        self._held: list[int] = []  # positions in ``_devices`` this controller locked: what reset gives back
        self._guard = SignalGuard()
        self._ids: dict[int, tuple[str, int] | None] = {}  # position -> (UUID, NVML index), for the node's record

    def _identity(self, device: Any) -> tuple[str, int] | None:
        """(UUID, NVML index) of a device, for the node's record of locked clocks; None where unknown."""
        return None

    def _note(self, i: int, mhz: int | None) -> None:
        """Record device ``i`` as locked at ``mhz`` (None: reset) in the node's state file, so that
        ``python -m kareus mode=reset`` finds what a killed process left locked. Never raises: the lock
        or reset stands whether or not the record could be kept."""
        if i not in self._ids:
            try:
                self._ids[i] = self._identity(self._devices[i])
            except Exception:  # a device that does not say (no UUID): nothing to key a record by
                self._ids[i] = None
        ident = self._ids[i]
        if ident is None:
            return
        try:
            from kareus.runtime import clock_state

            if mhz is None:
                clock_state.record_reset(ident[0])
            else:
                clock_state.record_locked(ident[0], ident[1], mhz)
        except Exception as e:
            _warn_unrecorded(e)

    def _lock_device(self, device: Any, mhz: int) -> None:
        raise NotImplementedError

    def _unlock_device(self, device: Any) -> None:
        raise NotImplementedError

    def set(self, mhz: int) -> None:
        if self.locked == mhz:
            return
        if self.backend is not None:
            self.backend.gpu.check_clock(mhz)  # before the hardware is touched
        self._guard.install()
        self.locked = None  # until every device holds the new clock: a lock that fails partway leaves
        # some at it, so the next set, even of the old clock, must lock them all again
        for i, device in enumerate(self._devices):
            newly = i not in self._held
            if newly:  # held before the call: a signal handled inside it (SIGTERM) leaves the clock locked
                self._held.append(i)
            try:
                self._lock_device(device, int(mhz))
            except Exception as e:
                if newly:  # an error, not a signal: the device was not locked
                    self._held.remove(i)
                why = next((w for cls in type(e).__mro__ if (w := _DENIED.get(cls.__name__))), None)
                if why is None:
                    raise
                raise KareusError(f"profiler.frequency={self.name}: {why} ({type(e).__name__}: {e}); run "
                                  f"as a user who may lock clocks, or search slots and SMs at the GPU's "
                                  f"own clock with profiler/frequency=unlocked +experiment=no_clock_search") from None
            self._note(i, int(mhz))
        self.locked = int(mhz)
        if self.backend is not None:
            self.backend.set_clock(int(mhz))  # bookkeeping only: the backend records the locked clock

    def reset(self) -> None:
        errors: list[BaseException] = []
        for i in self._held:  # every GPU it locked, even if one fails or a second Ctrl-C lands meanwhile
            try:
                self._unlock_device(self._devices[i])
                self._note(i, None)
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every device is unlocked
                errors.append(e)
        self._held = []
        self.locked = None
        _release(self.backend)
        self._guard.restore()
        if errors:  # an interrupt first: it is what the user asked for
            raise next((e for e in errors if not isinstance(e, Exception)), errors[0])

    def __exit__(self, *exc: Any) -> None:
        """Reset and close; a reset that fails while another error unwinds is logged, not raised over it."""
        reset_while_unwinding(lambda: super(DeviceLockController, self).__exit__(*exc), exc[0])

    def close(self) -> None:
        self._guard.restore()


_unrecorded_warned = False


def _warn_unrecorded(err: Exception) -> None:
    """Log, once per process, that the node's record of locked clocks could not be kept."""
    global _unrecorded_warned
    if _unrecorded_warned:
        return
    _unrecorded_warned = True
    import logging

    logging.getLogger(__name__).warning("could not record the locked GPU clocks for `python -m kareus mode=reset` "
                                        "(%s: %s); the clocks are locked and reset all the same",
                                        type(err).__name__, err)


def _nvml_identity(nvml: Any, handle: Any) -> tuple[str, int]:
    """(UUID, NVML index) of an NVML handle."""
    uuid = nvml.nvmlDeviceGetUUID(handle)
    return (uuid.decode() if isinstance(uuid, bytes) else str(uuid)), int(nvml.nvmlDeviceGetIndex(handle))


def _measured_nvml_index(backend: HardwareBackend | None) -> int:
    """The backend's ``hardware.nvml_index`` (the GPU it reads energy from), or -1: its own CUDA device."""
    return int(getattr(getattr(backend, "cfg", None), "nvml_index", -1))


@dataclass
class NVMLFrequencyConfig:
    name: str = "nvml"
    devices: list[int] = field(default_factory=list)  # NVML indices to lock; [] = this process's own GPU


@FREQUENCY_CONTROLLERS.register("nvml", NVMLFrequencyConfig)
class NVMLFrequencyController(DeviceLockController):
    """Locks GPUs with ``nvmlDeviceSetGpuLockedClocks`` (needs admin rights).

    Without ``devices`` it locks only this process's GPU (the current CUDA device, matched to NVML by
    UUID): one process runs per GPU of the group, and each must lock the GPU whose energy it reads,
    not its neighbours'.
    """

    name = "nvml"

    def __init__(self, cfg: NVMLFrequencyConfig, backend: HardwareBackend | None = None) -> None:
        import pynvml  # provided by nvidia-ml-py

        from kareus.runtime.telemetry import nvml_handle, own_cuda_index

        self.cfg = cfg
        self._nvml = pynvml
        pynvml.nvmlInit()
        self._open = True
        try:
            if cfg.devices:
                handles = [pynvml.nvmlDeviceGetHandleByIndex(int(i)) for i in cfg.devices]
            else:  # the GPU the backend measures
                handles = [nvml_handle(pynvml, own_cuda_index(), _measured_nvml_index(backend))]
            super().__init__(handles, backend)
        except Exception:  # no such GPU: NVML is not left initialised by an object nobody can close
            self._open = False
            pynvml.nvmlShutdown()
            raise

    def _lock_device(self, device: Any, mhz: int) -> None:
        self._nvml.nvmlDeviceSetGpuLockedClocks(device, mhz, mhz)

    def _unlock_device(self, device: Any) -> None:
        self._nvml.nvmlDeviceResetGpuLockedClocks(device)

    def _identity(self, device: Any) -> tuple[str, int] | None:
        return _nvml_identity(self._nvml, device)

    def close(self) -> None:
        super().close()
        if self._open:
            self._open = False
            self._nvml.nvmlShutdown()


@dataclass
class ZeusFrequencyConfig:
    name: str = "zeus"
    devices: list[int] = field(default_factory=list)  # indices among Zeus's GPUs; [] = this process's own GPU


@FREQUENCY_CONTROLLERS.register("zeus", ZeusFrequencyConfig)
class ZeusFrequencyController(DeviceLockController):
    """Locks clocks through Zeus's device layer (which also works through the ``zeusd`` daemon).

    Without ``devices`` it locks only this process's GPU (see :class:`NVMLFrequencyController`).
    """

    name = "zeus"

    def __init__(self, cfg: ZeusFrequencyConfig, backend: HardwareBackend | None = None) -> None:
        from zeus.device import get_gpus

        from kareus.runtime.telemetry import own_cuda_index, zeus_index

        self.cfg = cfg
        self._gpus = get_gpus()
        if cfg.devices:
            devices = list(cfg.devices)
        else:  # the GPU the backend measures
            devices = [zeus_index(self._gpus, own_cuda_index(), _measured_nvml_index(backend))]
        super().__init__(devices, backend)

    def _call(self, method: str, index: int, *args: int) -> None:
        gpus = self._gpus
        if hasattr(gpus, "gpus"):  # per-device objects: gpus.gpus[i].set_gpu_locked_clocks(lo, hi)
            getattr(gpus.gpus[index], method)(*args)
        else:  # older collection API: gpus.set_gpu_locked_clocks(i, lo, hi)
            getattr(gpus, method)(index, *args)

    def _lock_device(self, device: Any, mhz: int) -> None:
        self._call("set_gpu_locked_clocks", device, mhz, mhz)

    def _unlock_device(self, device: Any) -> None:
        self._call("reset_gpu_locked_clocks", device)

    def _identity(self, device: Any) -> tuple[str, int] | None:
        """By the NVML handle Zeus keeps for the GPU; None where it keeps none (the zeusd daemon's
        older collection API)."""
        members = getattr(self._gpus, "gpus", None)
        handle = getattr(members[device], "handle", None) if members is not None else None
        if handle is None:
            return None
        import pynvml  # Zeus's NVIDIA GPUs initialised NVML

        return _nvml_identity(pynvml, handle)
