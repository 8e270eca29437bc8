"""This node's record of the GPU clocks Kareus processes locked, and ``mode=reset``, which gives them back.

Every lock a real frequency controller takes is written to ``locked_clocks.json`` (NVML index, UUID,
clock, the process that locked it) and every reset removes it, so a process that died without
unwinding (SIGKILL, an abort in native code, a node's OOM killer) leaves a record of what it left
locked: ``python -m kareus mode=reset`` resets those GPUs, and ``reset.all=true`` every GPU NVML sees.

The file lives in ``$KAREUS_STATE_DIR``, else ``$XDG_RUNTIME_DIR/kareus``, else ``/tmp/kareus-<uid>``:
a per-user, per-node folder (locking clocks usually needs root, so ``mode=reset`` runs as the user
who locked them). Writes replace the file atomically, under an ``fcntl`` lock shared with every
other process on the node. Keeping the record never fails a lock or a reset: a folder that cannot be
written is logged once and the clocks are locked all the same.

NVML comes from nvidia-ml-py (module ``pynvml``), imported only by :func:`reset_locked_clocks`.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

STATE_FILE = "locked_clocks.json"
_LOCK_TIMEOUT_S = 5.0  # another process holds the file lock for a few ms; one stuck longer is not waited for


@dataclass(frozen=True)
class LockedGPU:
    """One GPU whose SM clock a Kareus process locked, as recorded in the state file."""

    uuid: str  # NVML's ``GPU-...``: the key (NVML indices change with the driver's PCI ordering)
    index: int  # NVML index when it was locked
    mhz: int  # the clock it was locked at
    pid: int  # the process that locked it
    host: str  # the node, where KAREUS_STATE_DIR is a folder several nodes share
    started: int | None = None  # that process's start time (/proc/<pid>/stat), to tell a reused pid apart
    since: float = 0.0  # time.time() of the lock

    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})"


def state_dir() -> Path:
    """``$KAREUS_STATE_DIR``, else ``$XDG_RUNTIME_DIR/kareus``, else ``/tmp/kareus-<uid>``."""
    if os.environ.get("KAREUS_STATE_DIR"):
        return Path(os.environ["KAREUS_STATE_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kareus"
    return Path("/tmp") / f"kareus-{os.getuid()}"


def state_path() -> Path:
    return state_dir() / STATE_FILE


def _made_dir() -> Path:
    """The state folder, created private; in the shared /tmp, refused unless this user owns it (another
    user could have made it first, to read or plant records)."""
    folder = state_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not os.environ.get("KAREUS_STATE_DIR") and not os.environ.get("XDG_RUNTIME_DIR"):
        st = os.lstat(folder)
        if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.getuid():
            raise PermissionError(f"{folder} is not a folder of this user's; set KAREUS_STATE_DIR")
    return folder


def _host() -> str:
    return socket.gethostname()


def _start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (Linux), None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; the name in () may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def owner_running(entry: LockedGPU) -> bool:
    """Whether the process that locked ``entry`` still runs on this node (a reused pid is not it)."""
    if entry.host != _host():
        return False
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with that pid
        pass
    except OSError:
        return False
    started = _start_time(entry.pid)
    return entry.started is None or started is None or started == entry.started


def _read(path: Path) -> list[LockedGPU]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable record of locked GPU clocks %s (%s: %s)", path, type(e).__name__, e)
        return []
    out = []
    for item in data.get("gpus", []) if isinstance(data, dict) else []:
        try:
            out.append(LockedGPU(**item))
        except TypeError:  # a field this version does not know, or one missing: skipped, not fatal
            log.warning("ignoring a malformed entry of %s: %r", path, item)
    return out


def _write(path: Path, entries: list[LockedGPU]) -> None:
    """Replace the file atomically: a reader sees the old list or the new, never half of one."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "gpus": [asdict(e) for e in entries]}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_mutex = threading.RLock()  # the threads of this process, one at a time
_depth = threading.local()  # a signal handler's reset inside an update of the same thread


@contextmanager
def _locked_file() -> Iterator[Path]:
    """The state file, held against other processes (``fcntl.flock``) and other threads of this one.

    A signal handler that resets clocks may run while its own thread is inside an update: it then
    goes on under the lock its thread holds (or is taking) instead of waiting on it forever. The outer update, resuming,
    may write back the entry the handler removed; such a stale entry only names a GPU whose clocks are
    already reset, which ``mode=reset`` resets again harmlessly.
    """
    import fcntl

    with _mutex:
        if getattr(_depth, "n", 0):
            _depth.n += 1
            try:
                yield _made_dir() / STATE_FILE
            finally:
                _depth.n -= 1
            return
        _depth.n = 1  # from here on: a handler's update must not wait for the flock this thread takes
        try:
            folder = _made_dir()
            fd = os.open(folder / f"{STATE_FILE}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                deadline = time.monotonic() + _LOCK_TIMEOUT_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{folder / STATE_FILE} stayed locked by another process for "
                                               f"{_LOCK_TIMEOUT_S:g} s") from None
                        time.sleep(0.01)
                yield folder / STATE_FILE
            finally:
                os.close(fd)  # releases the flock
        finally:
            _depth.n = 0


def _update(change: Callable[[list[LockedGPU]], list[LockedGPU]]) -> None:
    with _locked_file() as path:
        before = _read(path)
        after = change(before)
        if after != before:
            _write(path, after)


def record_locked(uuid: str, index: int, mhz: int) -> None:
    """Note that this process locked GPU ``uuid`` (NVML ``index``) at ``mhz``; replaces its earlier entry."""
    pid = os.getpid()
    entry = LockedGPU(uuid=str(uuid), index=int(index), mhz=int(mhz), pid=pid, host=_host(),
                      started=_start_time(pid), since=time.time())
    _update(lambda entries: [e for e in entries if e.uuid != entry.uuid] + [entry])


def record_reset(uuid: str) -> None:
    """Note that GPU ``uuid``'s clocks are reset (whoever locked them: a reset unlocks the GPU)."""
    _update(lambda entries: [e for e in entries if e.uuid != str(uuid)])


def locked() -> list[LockedGPU]:
    """Every GPU the state file lists as locked (on every node that shares the file), oldest first."""
    return _read(state_path())


# -- mode=reset -----------------------------------------------------------------------------------------
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _denied(err: BaseException) -> bool:
    return any("NoPermission" in cls.__name__ for cls in type(err).__mro__)


def _print_line(line: str) -> None:
    """A line on stdout; a reader that left (``| head``) is OutputClosed, which the CLI ends quietly on."""
    from kareus.errors import OutputClosed

    try:
        print(line, flush=True)
    except BrokenPipeError:
        raise OutputClosed from None


def reset_locked_clocks(all_gpus: bool = False, emit: Callable[[str], None] = _print_line) -> dict[str, Any]:
    """Reset the locked clocks of the GPUs the state file lists for this node (``all_gpus``: of every
    GPU NVML sees), one line per GPU through ``emit``, and clear their entries.

    A GPU whose locking process still runs is left locked (its run measures at that clock) unless
    ``all_gpus``. An entry whose GPU NVML no longer sees is dropped. Where NVML cannot be reached, no
    clock can be reset: one line says so and the entries are kept for a later ``mode=reset``. A reset
    that fails raises KareusError once every GPU was tried; its entry is kept.
    """
    from kareus.errors import KareusError

    host = _host()
    path = state_path()
    mine = [e for e in locked() if e.host == host]
    summary: dict[str, Any] = {"mode": "reset", "reset": [], "left": [], "forgotten": [], "failed": []}
    if not mine and not all_gpus:
        emit(f"nothing to reset: no GPU clocks locked by Kareus on this node (state file {path})")
        return summary
    try:
        import pynvml  # provided by nvidia-ml-py

        pynvml.nvmlInit()
    except Exception as e:  # no nvidia-ml-py, no driver, no GPU
        why = f"{type(e).__name__}: {e}"
        if not mine:
            emit(f"nothing to reset: NVML is not available on this node ({why})")
        else:
            listed = "; ".join(f"{g.label()} at {g.mhz} MHz by pid {g.pid}" for g in mine)
            emit(f"nothing reset: cannot reach NVML ({why}); kept {path}, which lists {len(mine)} GPU(s) "
                 f"as locked: {listed}")
        summary["left"] = [g.uuid for g in mine]
        return summary
    failed: list[tuple[str, BaseException]] = []
    try:
        if all_gpus:
            targets = _every_gpu(pynvml, mine, failed, emit)
            if not targets and not failed:
                emit("nothing to reset: NVML sees no GPU on this node")
                return summary
        else:
            targets = _recorded_gpus(pynvml, mine, summary, failed, emit)
        for label, uuid, handle, entry in targets:
            try:
                pynvml.nvmlDeviceResetGpuLockedClocks(handle)
            except Exception as e:
                _failed(label, e, failed, emit)
                continue
            _forget(uuid)
            by = f": locked at {entry.mhz} MHz by pid {entry.pid}" if entry is not None else ""
            emit(f"reset {label}{by}")
            summary["reset"].append(uuid)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # pragma: no cover - shutdown after a lost GPU
            pass
    summary["failed"] = [label for label, _ in failed]
    if failed:
        how = ("resetting GPU clocks needs admin rights: run as root, or `nvidia-smi -rgc`"
               if any(_denied(e) for _, e in failed) else "try `nvidia-smi -rgc`")
        raise KareusError(f"mode=reset: could not reset {', '.join(label for label, _ in failed)}; "
                          f"{path} keeps what it lists of them; {how}")
    return summary


Target = tuple[str, str, Any, "LockedGPU | None"]  # label, UUID, NVML handle, its entry (None: not recorded)


def _failed(label: str, err: BaseException, failed: list[tuple[str, BaseException]],
            emit: Callable[[str], None]) -> None:
    emit(f"could not reset {label}: {type(err).__name__}: {err}")
    failed.append((label, err))


def _every_gpu(nvml: Any, mine: list[LockedGPU], failed: list[tuple[str, BaseException]],
               emit: Callable[[str], None]) -> list[Target]:
    recorded = {e.uuid: e for e in mine}
    out: list[Target] = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except Exception as e:  # a GPU fallen off the bus: the others are still reset
            _failed(f"GPU {i}", e, failed, emit)
            continue
        out.append((f"GPU {i} ({uuid})", uuid, handle, recorded.get(uuid)))
    return out


def _recorded_gpus(nvml: Any, mine: list[LockedGPU], summary: dict[str, Any],
                   failed: list[tuple[str, BaseException]], emit: Callable[[str], None]) -> list[Target]:
    """The entries to reset; a line for each one left locked, forgotten or out of reach."""
    out: list[Target] = []
    for entry in mine:
        if entry.pid != os.getpid() and owner_running(entry):
            emit(f"left {entry.label()} locked at {entry.mhz} MHz: pid {entry.pid}, which locked it, is still "
                 f"running (stop it first, or reset.all=true)")
            summary["left"].append(entry.uuid)
            continue
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(entry.uuid)
        except Exception as e:
            if "NotFound" not in type(e).__name__:
                _failed(entry.label(), e, failed, emit)
                continue
            _forget(entry.uuid)
            emit(f"forgot {entry.label()}: NVML sees no such GPU on this node")
            summary["forgotten"].append(entry.uuid)
            continue
        try:
            index = int(nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            index = entry.index
        out.append((f"GPU {index} ({entry.uuid})", entry.uuid, handle, entry))
    return out


def _forget(uuid: str) -> None:
    try:
        record_reset(uuid)
    except Exception as e:  # the clock is reset all the same; a stale entry is reset again harmlessly
        log.warning("could not update %s (%s: %s)", state_path(), type(e).__name__, e)
