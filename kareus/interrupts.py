"""Ctrl-C and SIGTERM held over a few steps that must not be cut in half (a journal write and the
event that reports it; an MLflow write on a pooled SQLite connection)."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


_PENDING: list[int] = []  # signals held by the deferring blocks now open (the outermost's first)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them.

    Their handlers raise (KeyboardInterrupt, SystemExit); raised inside an MLflow write, they can
    leave a SQLite transaction open on a pooled connection, and the exit path's own writes (runs
    marked KILLED) then wait on that lock. Deferred, they land between writes instead. The block
    swaps in handlers that only note the signal: a thread signal mask would not do, since the kernel
    hands a process's signal to any thread that does not block it and Python still runs the handler
    in the main thread. Python handlers exist only in the main thread, so elsewhere this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    start = len(_PENDING)
    held = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not None:  # None: a handler not set from Python, left alone
            held[sig] = signal.signal(sig, lambda signum, frame: _PENDING.append(signum))
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        mine = _PENDING[start:]
        del _PENDING[start:]
        for sig in mine:
            signal.raise_signal(sig)  # now, through the handler the block found


def signal_pending() -> bool:
    """Whether a Ctrl-C or SIGTERM waits for a deferring block to end: a step that would wait longer
    (an MLflow write backing off from a locked store) gives up instead, so the stop is not held for it."""
    return bool(_PENDING)
