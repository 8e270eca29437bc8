"""``ClockGuard``: locked GPU clocks are reset at every exit the process sees.

``with controller, ClockGuard(controller):`` (any object with ``reset()``) resets the clocks once on
leaving normally or by an exception, and also when SIGTERM, SIGHUP or SIGINT (Ctrl-C) arrives, or at
interpreter exit (``atexit``) while the guard is still active, as when a daemon thread holds it.

While active, the guard handles those three signals (main thread only: Python lets no other thread
install handlers, so elsewhere only the ``with`` exit and ``atexit`` apply). A signal then ends the
process as it would have without the guard, after the reset:

* at its default, SIGTERM raises ``SystemExit(143)``, SIGHUP ``SystemExit(129)`` and SIGINT
  ``KeyboardInterrupt`` (the default of SIGTERM and SIGHUP kills without unwinding, so no ``finally``
  would run);
* a handler the program set (``python -m kareus`` turns SIGTERM into ``SystemExit(143)`` with a line
  that says how to continue) runs first; if it raises, the clocks are reset before its exception
  unwinds; if it returns (Megatron's ``--exit-signal-handler`` only sets a flag, and the loop saves a
  checkpoint and exits), the run goes on at its locked clock and the ``with`` exit resets it;
* a signal the process ignores (``nohup`` ignores SIGHUP) stays ignored.

A signal that arrives while the guard resets waits for the reset to finish. Leaving the guard puts the
previous handlers back, where the guard's own are still in place (a handler set meanwhile stays).
What no handler can catch (SIGKILL, an abort in native code) leaves the lock in place; the node's
record of locked clocks (:mod:`kareus.runtime.clock_state`) lets ``python -m kareus mode=reset`` give
it back.
"""
from __future__ import annotations

import atexit
import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)

GUARDED_SIGNALS = ("SIGTERM", "SIGHUP", "SIGINT")


class ClockGuard:
    """Context manager: ``controller.reset()`` once at every exit the process sees (see the module)."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller
        self._previous: dict[int, Any] = {}  # signal -> the handler found on entry
        self._active = False
        self._done = False  # reset once: a signal's reset is not repeated by the exit that follows
        self._resetting = False
        self._pending: int | None = None  # a signal that arrived during the reset

    # -- the reset --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Reset the controller unless this guard already did and nothing was locked since."""
        if self._resetting:
            return
        if self._done and getattr(self.controller, "locked", None) is None:
            return
        self._resetting = True
        try:
            self._done = True
            self.controller.reset()
        finally:
            self._resetting = False

    def _reset_quietly(self, why: str) -> None:
        """Reset on the way out of the process: a failure is logged, so the exit under way still happens."""
        try:
            self.reset()
        except Exception as e:
            log.error("could not reset the locked GPU clocks on %s (%s: %s); reset them with "
                      "`python -m kareus mode=reset` or `nvidia-smi -rgc`", why, type(e).__name__, e)

    # -- signals ----------------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        if self._resetting:  # the reset under way finishes first; the exit then is this signal's
            self._pending = self._pending or signum
            return
        name = signal.Signals(signum).name
        previous = self._previous.get(signum)
        if callable(previous):  # the program's handler (or Python's Ctrl-C) decides how the run ends
            try:
                previous(signum, frame)
            except BaseException:
                self._reset_quietly(name)
                raise
            return
        self._reset_quietly(name)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in GUARDED_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            current = signal.getsignal(signum)
            if current is signal.SIG_IGN:
                continue  # ignored on purpose: not an exit
            self._previous[signum] = current  # None: set outside Python, which kills as the default does
            signal.signal(signum, self._handle)

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) != self._handle:  # replaced meanwhile (a controller's own guard
                continue  # put back what it found): that handler stands
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    # -- context manager --------------------------------------------------------------------------------
    def __enter__(self) -> Any:
        """Returns the controller."""
        self._done = False
        self._pending = None
        self._active = True
        atexit.register(self._at_exit)
        self._install()
        return self.controller

    def _at_exit(self) -> None:
        if self._active:
            self._reset_quietly("exit")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        from kareus.profiler.frequency import reset_while_unwinding

        try:
            reset_while_unwinding(self.reset, exc_type)
        finally:
            self._active = False
            atexit.unregister(self._at_exit)
            self._restore()
            pending, self._pending = self._pending, None
            # a signal held off by the reset: delivered now to the handler it would have met, unless an
            # exit (a signal's, Ctrl-C's) is already under way
            if pending is not None and not (exc_type and issubclass(exc_type, (SystemExit, KeyboardInterrupt))):
                signal.raise_signal(pending)
