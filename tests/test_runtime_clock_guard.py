"""ClockGuard: a controller's clocks are reset once at every exit: normal, exception, SIGTERM, SIGHUP,
Ctrl-C and interpreter exit; the handlers found are put back, and a signal still ends the process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kareus.runtime.clock_guard import ClockGuard

ROOT = Path(__file__).resolve().parents[1]
GUARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class FakeController:
    """Counts resets; ``locked`` as a real controller keeps it (None once reset)."""

    def __init__(self, fail: bool = False) -> None:
        self.resets = 0
        self.locked: int | None = None
        self.fail = fail

    def set(self, mhz: int) -> None:
        self.locked = mhz

    def reset(self) -> None:
        self.resets += 1
        self.locked = None
        if self.fail:
            raise RuntimeError("NVMLError_Unknown")


@pytest.fixture
def handlers():
    """The guarded signals at known handlers for the test (SIGINT as an interactive shell has it)."""
    before = {s: signal.getsignal(s) for s in GUARDED}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def test_a_normal_exit_resets_once_and_restores_the_handlers(handlers):
    ctl = FakeController()
    with ClockGuard(ctl) as got:
        assert got is ctl
        ctl.set(1005)
        assert all(signal.getsignal(s) not in (signal.SIG_DFL, signal.default_int_handler) for s in GUARDED)
    assert ctl.resets == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_exception_resets_and_propagates(handlers):
    ctl = FakeController()
    with pytest.raises(ValueError):
        with ClockGuard(ctl):
            ctl.set(1005)
            raise ValueError("search died")
    assert ctl.resets == 1


def test_a_reset_that_fails_while_an_error_unwinds_does_not_hide_that_error(handlers):
    ctl = FakeController(fail=True)
    with pytest.raises(ValueError, match="search died"):
        with ClockGuard(ctl):
            raise ValueError("search died")
    with pytest.raises(RuntimeError, match="NVMLError_Unknown"):  # with nothing unwinding it is raised
        with ClockGuard(FakeController(fail=True)):
            pass


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_at_its_default_resets_then_exits(handlers, sig, code):
    ctl = FakeController()
    with pytest.raises(SystemExit) as info:
        with ClockGuard(ctl):
            ctl.set(1005)
            signal.getsignal(sig)(sig, None)
    assert info.value.code == code
    assert ctl.resets == 1  # in the handler; the exit that follows does not reset again
    assert signal.getsignal(sig) is signal.SIG_DFL


def test_ctrl_c_resets_then_raises_keyboard_interrupt(handlers):
    ctl = FakeController()
    with pytest.raises(KeyboardInterrupt):
        with ClockGuard(ctl):
            ctl.set(1005)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # the handler runs between bytecodes, soon after the signal
                time.sleep(0.01)
    assert ctl.resets == 1


def test_a_handler_the_program_set_runs_first_and_decides(handlers):
    """cli._terminate prints how to continue and raises SystemExit(143): the clocks are reset on its way
    out. A handler that only sets a flag (Megatron's) lets the run go on at its clock until the exit."""
    from kareus.cli import _terminate

    ctl = FakeController()
    signal.signal(signal.SIGTERM, _terminate)
    with pytest.raises(SystemExit) as info:
        with ClockGuard(ctl):
            ctl.set(1005)
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert info.value.code == 143 and ctl.resets == 1
    assert signal.getsignal(signal.SIGTERM) is _terminate

    flagged: list[int] = []
    megatrons = lambda signum, frame: flagged.append(signum)  # noqa: E731
    signal.signal(signal.SIGTERM, megatrons)
    ctl = FakeController()
    with ClockGuard(ctl):
        ctl.set(1005)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert flagged == [signal.SIGTERM] and ctl.resets == 0 and ctl.locked == 1005
    assert ctl.resets == 1 and signal.getsignal(signal.SIGTERM) is megatrons


def test_an_ignored_signal_stays_ignored(handlers):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with ClockGuard(FakeController()):
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


def test_a_clock_locked_again_after_a_reset_is_reset_again(handlers):
    """Resetting once must not mean leaving a later lock in place (a SystemExit that code swallowed)."""
    ctl = FakeController()
    with ClockGuard(ctl) as c:
        c.set(1005)
        try:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        except SystemExit:
            pass
        assert ctl.resets == 1
        c.set(1200)
    assert ctl.resets == 2 and ctl.locked is None


def test_nested_guards_reset_both(handlers):
    outer, inner = FakeController(), FakeController()
    with pytest.raises(SystemExit):
        with ClockGuard(outer), ClockGuard(inner):
            outer.set(1005)
            inner.set(1005)
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert outer.resets == 1 and inner.resets == 1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_outside_the_main_thread_no_handler_is_installed_but_the_exit_resets(handlers):
    ctl = FakeController()
    seen = {}

    def body() -> None:
        with ClockGuard(ctl):
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["handler"] is signal.SIG_DFL and ctl.resets == 1


# -- a real process, real signals ------------------------------------------------------------------------
CHILD = """
import os, signal, sys, threading, time
from kareus.runtime.clock_guard import ClockGuard

out = sys.argv[1]
class Controller:
    locked = None
    def reset(self):
        self.locked = None
        with open(out, "a") as f:
            f.write("reset\\n")
ctl = Controller()
if sys.argv[2] == "thread":  # a daemon thread holds the guard when the interpreter exits
    threading.Thread(target=lambda: ClockGuard(ctl).__enter__() and time.sleep(60), daemon=True).start()
    time.sleep(0.5)
    print("ready", flush=True)
    sys.exit(3)
with ClockGuard(ctl):
    ctl.locked = 1005
    print("ready", flush=True)
    time.sleep(60)
"""


def _child(tmp_path: Path, how: str, sig: int | None) -> tuple[int, str]:
    out = tmp_path / "resets.txt"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), how], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    if sig is not None:
        proc.send_signal(sig)
    proc.communicate(timeout=60)
    return proc.returncode, out.read_text() if out.exists() else ""


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 128 + 15), (signal.SIGHUP, 128 + 1),
                                      (signal.SIGINT, -signal.SIGINT)])  # an uncaught Ctrl-C: killed by SIGINT
def test_a_signal_to_a_guarded_process_resets_its_clocks_once(tmp_path, sig, code):
    rc, resets = _child(tmp_path, "main", sig)
    assert rc == code
    assert resets == "reset\n"


def test_interpreter_exit_resets_what_a_daemon_thread_held(tmp_path):
    rc, resets = _child(tmp_path, "thread", None)
    assert rc == 3
    assert resets == "reset\n"


def test_a_signal_during_the_reset_waits_for_it_then_reaches_its_handler(handlers):
    """A second Ctrl-C or a SIGTERM landing inside the reset would abort it halfway, leaving GPUs locked."""
    got: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append("handler"))

    class Interrupted(FakeController):
        def reset(self) -> None:
            signal.raise_signal(signal.SIGTERM)  # handled at once, inside the reset
            got.append("reset done")
            super().reset()

    with ClockGuard(Interrupted()) as ctl:
        ctl.set(1005)
    assert got == ["reset done", "handler"]


def test_a_controller_that_locked_before_the_guard_leaves_no_stray_handler(handlers, monkeypatch):
    """A real controller's lock puts its own SIGTERM/SIGHUP handler in place and its reset takes it
    away; entered after that lock, the guard must not put the controller's stale handler back."""
    import types

    from kareus.registry import FREQUENCY_CONTROLLERS
    import kareus.profiler.frequency  # noqa: F401  (registers the controllers)

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    fake.nvmlDeviceSetGpuLockedClocks = lambda h, lo, hi: None
    fake.nvmlDeviceResetGpuLockedClocks = lambda h: None
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]}) as ctl:
        ctl.set(1005)
        with pytest.raises(SystemExit):
            with ClockGuard(ctl):
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
