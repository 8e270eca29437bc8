"""Paths given on the command line (``resume=``, ``check.run=``, ``search.warm_start=``)."""
from __future__ import annotations

import os
from pathlib import Path


def from_start_dir(path: str) -> Path:
    """``path`` against the folder the command was started in (``hydra.job.chdir`` moves the job; outside
    a Hydra job: the current folder), ``~`` expanded."""
    from hydra.utils import to_absolute_path

    return Path(to_absolute_path(os.path.expanduser(path)))
