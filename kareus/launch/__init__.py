"""Running partition searches: the picklable task, the worker function and the launchers.

Importing this package registers the ``local``, ``process`` and ``ray`` launchers (Ray itself is
imported only when the ``ray`` launcher runs).
"""
from __future__ import annotations

from kareus.launch import launchers  # noqa: F401  (registration)
from kareus.launch.task import PartitionSearchTask, gpus_needed, run_search_task, task_from_dict, task_to_dict
from kareus.profiler.journal import journal_path_for

__all__ = ["PartitionSearchTask", "gpus_needed", "journal_path_for", "run_search_task",
           "task_from_dict", "task_to_dict"]
