"""Profiling: the measurement protocol, cooldown policies, frequency controllers and the journal.

Importing this package registers the built-in ``COOLDOWNS`` and ``FREQUENCY_CONTROLLERS``.
"""
from __future__ import annotations

from kareus.profiler import cooldown, frequency  # noqa: F401  (registration)
from kareus.profiler.config import ProfilerConfig
from kareus.profiler.journal import Journal, JournalMismatchError, journal_path_for
from kareus.profiler.profiler import Profiler, ReadError

__all__ = ["Journal", "JournalMismatchError", "Profiler", "ProfilerConfig", "ReadError", "journal_path_for"]
