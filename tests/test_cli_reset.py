"""``python -m kareus mode=reset`` and the node's record of locked GPU clocks behind it.

Every lock a real controller takes is recorded (``locked_clocks.json`` in ``$KAREUS_STATE_DIR``) and
every reset clears it; ``mode=reset`` resets what the record lists for this node (``reset.all=true``:
every GPU NVML sees), one line per GPU. Without NVML nothing can be reset: one line says so, the record
is kept for a later ``mode=reset``, and the exit status is 0, as when nothing is recorded.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

import kareus.profiler.frequency  # noqa: F401  (registers the controllers)
from kareus.runtime import clock_state
from kareus.runtime.clock_state import LockedGPU, locked, record_locked, record_reset, reset_locked_clocks

ROOT = Path(__file__).resolve().parents[1]

# pynvml of a node whose GPUs, and whether NVML loads or lets resets through, a JSON file says
FAKE_PYNVML = '''
import json, os
_cfg_path = os.environ["FAKE_NVML"]
class NVMLError(Exception): pass
class NVMLError_LibraryNotFound(NVMLError): pass
class NVMLError_NotFound(NVMLError): pass
class NVMLError_NoPermission(NVMLError): pass
def _cfg():
    with open(_cfg_path) as f:
        return json.load(f)
def _log(*args):
    with open(_cfg_path + ".calls", "a") as f:
        f.write(" ".join(map(str, args)) + "\\n")
def nvmlInit():
    if _cfg().get("no_library"):
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return len(_cfg()["gpus"])
def nvmlDeviceGetHandleByIndex(i): return _cfg()["gpus"][i]
def nvmlDeviceGetHandleByUUID(u):
    if u not in _cfg()["gpus"]:
        raise NVMLError_NotFound("Not Found")
    return u
def nvmlDeviceGetUUID(h): return h.encode()
def nvmlDeviceGetIndex(h): return _cfg()["gpus"].index(h)
def nvmlDeviceSetGpuLockedClocks(h, lo, hi):
    if _cfg().get("deny"):
        raise NVMLError_NoPermission("Insufficient Permissions")
    _log("lock", h, lo)
def nvmlDeviceResetGpuLockedClocks(h):
    if _cfg().get("deny"):
        raise NVMLError_NoPermission("Insufficient Permissions")
    _log("reset", h)
'''

GPUS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """A state folder of the test's own."""
    folder = tmp_path / "state"
    monkeypatch.setenv("KAREUS_STATE_DIR", str(folder))
    return folder


@pytest.fixture
def nvml(tmp_path, monkeypatch):
    """The fake pynvml, in this process and (through PYTHONPATH) in children; returns its config setter."""
    folder = tmp_path / "fake_nvml"
    folder.mkdir()
    (folder / "pynvml.py").write_text(FAKE_PYNVML)
    cfg = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML", str(cfg))
    spec = importlib.util.spec_from_file_location("pynvml", folder / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pynvml", module)

    def configure(**kw) -> types.SimpleNamespace:
        cfg.write_text(json.dumps({"gpus": GPUS, **kw}))
        spec.loader.exec_module(module)
        return types.SimpleNamespace(path=folder, calls=lambda: _calls(cfg))

    return configure


def _calls(cfg: Path) -> list[str]:
    log = Path(f"{cfg}.calls")
    return log.read_text().splitlines() if log.exists() else []


def _write_state(folder: Path, *entries: LockedGPU) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "locked_clocks.json"
    path.write_text(json.dumps({"version": 1, "gpus": [e.__dict__ for e in entries]}))
    return path


def _entry(uuid: str, index: int, mhz: int, alive: bool) -> LockedGPU:
    """An entry of a process that still runs (this test's parent) or of one gone (a pid whose start
    time is not the recorded one: the pid was reused)."""
    pid = os.getppid() if alive else os.getpid()
    started = clock_state._start_time(pid) if alive else -1
    return LockedGPU(uuid=uuid, index=index, mhz=mhz, pid=pid, host=socket.gethostname(), started=started)


# -- the state file -------------------------------------------------------------------------------------
def test_state_dir_prefers_kareus_then_xdg_then_tmp(monkeypatch, tmp_path):
    monkeypatch.setenv("KAREUS_STATE_DIR", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "x"))
    assert clock_state.state_path() == tmp_path / "k" / "locked_clocks.json"
    monkeypatch.delenv("KAREUS_STATE_DIR")
    assert clock_state.state_dir() == tmp_path / "x" / "kareus"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert clock_state.state_dir() == Path(f"/tmp/kareus-{os.getuid()}")


def test_a_lock_is_recorded_replaced_and_cleared(state):
    assert locked() == []
    record_locked("GPU-aaaa", 3, 1005)
    record_locked("GPU-bbbb", 4, 1005)
    record_locked("GPU-aaaa", 3, 1410)  # a new clock on the same GPU: one entry, the latest
    entries = locked()
    assert [(e.uuid, e.index, e.mhz) for e in entries] == [("GPU-bbbb", 4, 1005), ("GPU-aaaa", 3, 1410)]
    assert all(e.pid == os.getpid() and e.host == socket.gethostname() for e in entries)
    assert clock_state.owner_running(entries[0])
    record_reset("GPU-aaaa")
    record_reset("GPU-zzzz")  # never recorded: nothing to clear
    assert [e.uuid for e in locked()] == ["GPU-bbbb"]
    assert json.loads((state / "locked_clocks.json").read_text())["gpus"][0]["uuid"] == "GPU-bbbb"
    assert sorted(p.name for p in state.iterdir()) == ["locked_clocks.json", "locked_clocks.json.lock"]  # no temp


def test_an_unreadable_state_file_is_ignored_and_replaced(state):
    state.mkdir()
    (state / "locked_clocks.json").write_text("{not json")
    assert locked() == []
    record_locked("GPU-aaaa", 0, 1005)
    assert [e.uuid for e in locked()] == ["GPU-aaaa"]


def test_a_dead_or_reused_pid_is_not_a_running_owner(state):
    assert not clock_state.owner_running(_entry("GPU-aaaa", 0, 1005, alive=False))
    assert clock_state.owner_running(_entry("GPU-aaaa", 0, 1005, alive=True))
    other_host = LockedGPU("GPU-aaaa", 0, 1005, os.getppid(), "another-node")
    assert not clock_state.owner_running(other_host)


CONCURRENT = """
import sys
from kareus.runtime.clock_state import record_locked, record_reset
k = int(sys.argv[1])
for i in range(20):
    record_locked(f"GPU-{k}-{i}", i, 1005)
    record_locked(f"GPU-{k}-gone-{i}", i, 1005)
    record_reset(f"GPU-{k}-gone-{i}")
"""


def test_processes_recording_at_once_lose_no_entry(state):
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(k)], cwd=ROOT, env=os.environ.copy())
             for k in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    assert sorted(e.uuid for e in locked()) == sorted(f"GPU-{k}-{i}" for k in range(4) for i in range(20))


# -- the controllers keep the record -------------------------------------------------------------------
def test_an_nvml_lock_is_recorded_and_its_reset_clears_it(state, nvml):
    from kareus.registry import FREQUENCY_CONTROLLERS

    nvml()
    with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [1, 2]}) as ctl:
        ctl.set(1005)
        assert [(e.uuid, e.index, e.mhz) for e in locked()] == [("GPU-bbbb", 1, 1005), ("GPU-cccc", 2, 1005)]
        ctl.set(1410)
        assert {e.mhz for e in locked()} == {1410}
    assert locked() == []


def test_a_refused_lock_records_nothing_and_a_failed_reset_keeps_the_record(state, nvml):
    from kareus.errors import KareusError
    from kareus.registry import FREQUENCY_CONTROLLERS

    nvml(deny=True)
    with pytest.raises(KareusError, match="needs admin rights"):
        with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]}) as ctl:
            ctl.set(1005)
    assert locked() == []
    nvml()
    ctl = FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]})
    ctl.set(1005)
    nvml(deny=True)
    with pytest.raises(Exception, match="Insufficient Permissions"):
        ctl.reset()
    ctl.close()
    assert [e.uuid for e in locked()] == ["GPU-aaaa"]  # still locked: mode=reset will find it


def test_a_state_folder_that_cannot_be_written_does_not_stop_the_lock(tmp_path, monkeypatch, nvml, caplog):
    from kareus.registry import FREQUENCY_CONTROLLERS

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KAREUS_STATE_DIR", str(blocker / "state"))
    monkeypatch.setattr("kareus.profiler.frequency._unrecorded_warned", False)
    nvml()
    with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]}) as ctl:
        ctl.set(1005)
    assert nvml().calls() == ["lock GPU-aaaa 1005", "reset GPU-aaaa"]
    assert "could not record the locked GPU clocks" in caplog.text


# -- mode=reset, in this process -------------------------------------------------------------------------
def test_reset_gives_back_what_dead_processes_left_and_leaves_running_ones(state, nvml):
    fake = nvml()
    _write_state(state, _entry("GPU-aaaa", 0, 1410, alive=True), _entry("GPU-bbbb", 1, 1005, alive=False),
                 _entry("GPU-gone", 5, 1005, alive=False))
    lines: list[str] = []
    out = reset_locked_clocks(emit=lines.append)
    pid = os.getppid()
    assert lines == [
        f"left GPU 0 (GPU-aaaa) locked at 1410 MHz: pid {pid}, which locked it, is still running "
        f"(stop it first, or reset.all=true)",
        "forgot GPU 5 (GPU-gone): NVML sees no such GPU on this node",
        f"reset GPU 1 (GPU-bbbb): locked at 1005 MHz by pid {os.getpid()}",
    ]
    assert fake.calls() == ["reset GPU-bbbb"]
    assert [e.uuid for e in locked()] == ["GPU-aaaa"]
    assert out["reset"] == ["GPU-bbbb"] and out["left"] == ["GPU-aaaa"] and out["forgotten"] == ["GPU-gone"]


def test_reset_all_resets_every_gpu_nvml_sees(state, nvml):
    fake = nvml()
    _write_state(state, _entry("GPU-aaaa", 0, 1410, alive=True))
    lines: list[str] = []
    reset_locked_clocks(all_gpus=True, emit=lines.append)
    assert lines == [f"reset GPU 0 (GPU-aaaa): locked at 1410 MHz by pid {os.getppid()}",
                     "reset GPU 1 (GPU-bbbb)", "reset GPU 2 (GPU-cccc)"]
    assert fake.calls() == ["reset GPU-aaaa", "reset GPU-bbbb", "reset GPU-cccc"]
    assert locked() == []


def test_a_reset_refused_for_rights_is_an_error_and_keeps_the_record(state, nvml):
    from kareus.errors import KareusError

    nvml(deny=True)
    _write_state(state, _entry("GPU-bbbb", 1, 1005, alive=False))
    lines: list[str] = []
    with pytest.raises(KareusError, match=r"^mode=reset: could not reset GPU 1 \(GPU-bbbb\); .*needs admin rights"):
        reset_locked_clocks(emit=lines.append)
    assert lines == ["could not reset GPU 1 (GPU-bbbb): NVMLError_NoPermission: Insufficient Permissions"]
    assert [e.uuid for e in locked()] == ["GPU-bbbb"]


def test_reset_all_without_nvml_or_gpus_has_nothing_to_reset(state, nvml):
    lines: list[str] = []
    nvml(no_library=True)
    reset_locked_clocks(all_gpus=True, emit=lines.append)
    nvml(gpus=[])
    reset_locked_clocks(all_gpus=True, emit=lines.append)
    assert lines == ["nothing to reset: NVML is not available on this node "
                     "(NVMLError_LibraryNotFound: NVML Shared Library Not Found)",
                     "nothing to reset: NVML sees no GPU on this node"]


def test_mode_reset_needs_no_model(compose):
    from kareus.config.validate import validate

    validate(compose("mode=reset"))
    validate(compose("mode=reset", "reset.all=true"))


# -- python -m kareus mode=reset ----------------------------------------------------------------------
def _kareus(cwd: Path, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(COLUMNS="200", NO_COLOR="1", PYTHONWARNINGS="ignore")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "kareus", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_cli_reset_with_nothing_recorded_says_so_and_leaves_no_run_folder(tmp_path, state):
    res = _kareus(tmp_path / "work", "mode=reset")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"nothing to reset: no GPU clocks locked by Kareus on this node "
                                       f"(state file {state / 'locked_clocks.json'})"]
    assert list((tmp_path / "work").iterdir()) == []  # no empty Hydra run folder behind


@pytest.mark.slow
def test_cli_reset_without_nvml_keeps_the_record_and_says_nothing_was_reset(tmp_path, state, nvml):
    fake = nvml(no_library=True)
    path = _write_state(state, _entry("GPU-bbbb", 1, 1005, alive=False))
    res = _kareus(tmp_path / "work", "mode=reset", pythonpath=fake.path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        f"nothing reset: cannot reach NVML (NVMLError_LibraryNotFound: NVML Shared Library Not Found); kept "
        f"{path}, which lists 1 GPU(s) as locked: GPU 1 (GPU-bbbb) at 1005 MHz by pid {os.getpid()}"]
    assert [e.uuid for e in locked()] == ["GPU-bbbb"]
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.slow
def test_cli_reset_resets_the_recorded_gpus(tmp_path, state, nvml):
    fake = nvml()
    _write_state(state, _entry("GPU-bbbb", 1, 1005, alive=False), _entry("GPU-cccc", 2, 1005, alive=False))
    res = _kareus(tmp_path / "work", "mode=reset", pythonpath=fake.path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"reset GPU 1 (GPU-bbbb): locked at 1005 MHz by pid {os.getpid()}",
                                       f"reset GPU 2 (GPU-cccc): locked at 1005 MHz by pid {os.getpid()}"]
    assert fake.calls() == ["reset GPU-bbbb", "reset GPU-cccc"] and locked() == []
    assert list((tmp_path / "work").iterdir()) == []


def test_a_signal_handlers_update_inside_an_update_does_not_wait_for_its_own_thread(state):
    """SIGTERM lands while this thread records a lock; the handler's reset records too: waiting for the
    lock its own thread holds would hang the process instead of ending it."""
    import time

    record_locked("GPU-aaaa", 0, 1005)

    def change(entries):
        record_reset("GPU-aaaa")  # what the handler's reset does, mid-update
        return entries + [LockedGPU("GPU-bbbb", 1, 1005, os.getpid(), socket.gethostname())]

    start = time.monotonic()
    clock_state._update(change)
    assert time.monotonic() - start < clock_state._LOCK_TIMEOUT_S
    assert {e.uuid for e in locked()} >= {"GPU-bbbb"}  # the handler's change may be overwritten: harmless
