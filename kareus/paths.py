"""Where a run writes: checked before anything starts, so an unwritable place is one line, not a traceback."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def folder_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the folder ``path`` cannot be created and written (None if it can).

    Tries it: a throwaway folder is made, and removed at once, in the deepest part of ``path`` that
    exists. Permission bits alone do not tell (root passes them, and /proc or a read-only mount still
    refuse)."""
    target = Path(os.path.abspath(path))
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot create {target}: {existing} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kareus-probe-", dir=existing))
    except OSError as err:
        return f"cannot create {target}: {existing} is not writable ({err.strerror})"
    return None
