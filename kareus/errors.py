"""What the CLI turns into a clean stop: a one-line message (or none) and a non-zero exit."""
from __future__ import annotations

import errno
import os
import sqlite3

# a machine that cannot hold the run's files (a full disk, a quota, a folder it may not write, a
# read-only or failing file system, no file handles left): not a fault of the run or of Kareus
_MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO,
                             errno.EMFILE, errno.ENFILE})
_MACHINE_SQLITE = ("database or disk is full", "disk i/o error", "readonly database", "unable to open database file",
                   "database is locked")  # another process holds the file past the busy timeout


class KareusError(RuntimeError):
    """A user-facing failure (bad table, infeasible plan request, refused resume): one clear line."""


class RefusedWithOutputs(KareusError):
    """Refused once the run's outputs are on disk (no plan meets the request): the run folder keeps
    the config Hydra saved for them, even where it held an earlier run."""


class JobRefused:
    """What a sweep job refused at run time returns (it printed its one line): the sweep goes on, the
    sweep's MLflow run counts the job as failed, and the command exits 2 once every job has run."""

    def __init__(self, job: str, reason: str = "") -> None:
        self.job = job
        self.reason = reason  # the refusal's line, for the table the sweep ends with


class OutputClosed(BrokenPipeError):
    """The reader of the results (``| head``) left: the run stops as a shell tool does. Raised by the
    run's console only, so a broken socket elsewhere (an MLflow server, a Ray peer) is not taken for it."""


def not_text(err: UnicodeDecodeError) -> str:
    """How a file that is not UTF-8 text is named in an error line: where its first bad byte sits."""
    return f"not UTF-8 text (byte 0x{err.object[err.start]:02x} at {err.start})"


def machine_failure(err: BaseException) -> str | None:
    """One line for a failure of the machine rather than of the run (a full disk, a folder it may not
    write, a read-only file system), naming the file where known; None for anything else, whose
    traceback is what a bug report needs. Looks through the exceptions a library raised it from (MLflow
    wraps SQLAlchemy, which wraps SQLite)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _MACHINE_ERRNOS:
            why = err.strerror or os.strerror(err.errno)
            return f"{err.filename}: {why}" if err.filename else why
        if isinstance(err, sqlite3.OperationalError) and any(s in str(err).lower() for s in _MACHINE_SQLITE):
            return str(err)
        err = err.__cause__  # raised from it (not merely while handling it: that may be a bug of its own)
    return None


def a_noun(noun: str) -> str:
    """``noun`` with its indefinite article, as error lines name a type: 'an int', 'a str'."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
