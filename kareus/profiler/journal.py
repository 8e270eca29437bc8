"""The measurement journal: every measurement is on disk the moment it is taken.

SQLite in WAL mode with ``synchronous=FULL``: a committed row survives SIGKILL and power loss, and
several processes (the ``process`` and ``ray`` launchers' workers) can append to one file at once
(writers serialise on SQLite's lock; ``busy_timeout`` makes them wait instead of failing).
Rows are append-only: a candidate measured twice shows up twice, so tests can prove it never is,
except where a search asked to read it again: such a row carries the flag ``reading:<k>``.
The file remembers the config hash it was created with and the measurement revision of the Kareus
that wrote it; opening it with another hash or under another revision is refused.
A resumed run checks the old journal read-only and continues a copy of it in its own run directory,
so every run directory holds every measurement it used and an old run is never written to again.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from kareus.types import Candidate, Measurement, Reading, reading_of

JOURNAL_NAME = "journal.sqlite"
# What a journal's rows mean: partition keys (the workload model and the partitioner), candidates and
# measured values (the profiler's protocol). Bumped whenever one of them changes meaning, so that a
# run resumed after an upgrade never answers a candidate with a number measured for something else.
# A journal written before revisions were recorded reads as revision 0.
MEASUREMENT_REVISION = 4


class JournalError(RuntimeError):
    """A journal that cannot be continued: missing, unreadable, or not a Kareus journal."""


class JournalMismatchError(JournalError):
    """The journal was written under a different config; resuming it would mix incomparable numbers."""


def _revision_mismatch(path: Path, found: str) -> JournalMismatchError:
    return JournalMismatchError(
        f"journal {path} was measured under measurement revision {found}, this Kareus measures under "
        f"revision {MEASUREMENT_REVISION} (partition keys or measured values changed meaning): its numbers "
        f"cannot answer this run's candidates; start a new run directory")


def _revision(conn: sqlite3.Connection) -> str:
    """The measurement revision a journal was written under ("0": before revisions were recorded)."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'measurement_revision'").fetchone()
    return "0" if row is None else str(row[0])


def _refuse_other(path: Path, revision: str, found: str | None, config_hash: str) -> None:
    """Raise if the journal was measured under another revision, or (``found``) another config hash."""
    if revision != str(MEASUREMENT_REVISION):
        raise _revision_mismatch(path, revision)
    if found is not None and found != config_hash:
        raise _mismatch(path, found, config_hash)


def _mismatch(path: Path, found: str, config_hash: str) -> JournalMismatchError:
    return JournalMismatchError(
        f"journal {path} was written with config hash {found}, this run has {config_hash}: "
        f"resume only with the same config, or start a new run directory")


def journal_path_for(run_dir: str | os.PathLike[str], partition: str | None = None) -> Path:
    """Where a run keeps its journal: ``<run_dir>/journal.sqlite`` (one file for all partitions).

    ``partition`` is accepted for callers that want a per-partition name; the default shares one
    file, which WAL mode makes safe for concurrent workers on one machine.
    """
    base = Path(run_dir)
    if partition is None:
        return base / JOURNAL_NAME
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in partition)
    return base / "journal" / f"{safe}.sqlite"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    partition TEXT NOT NULL, slot TEXT NOT NULL, sms INTEGER NOT NULL, freq_mhz INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    time_s REAL, energy_j REAL, dynamic_energy_j REAL, static_power_w REAL,
    temperature_c REAL, measured_freq_mhz REAL, repeats INTEGER NOT NULL,
    flags TEXT NOT NULL, readings TEXT NOT NULL,
    backend TEXT NOT NULL, clock_mhz INTEGER, gpu_temperature_c REAL,
    gpu_seconds REAL NOT NULL, config_hash TEXT NOT NULL, worker TEXT NOT NULL, wall_time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS measurements_key ON measurements (partition, slot, sms, freq_mhz);
"""
# every column of a measurement row but its id, in table order
ROW_COLUMNS = ("partition", "slot", "sms", "freq_mhz", "failed", "time_s", "energy_j", "dynamic_energy_j",
               "static_power_w", "temperature_c", "measured_freq_mhz", "repeats", "flags", "readings", "backend",
               "clock_mhz", "gpu_temperature_c", "gpu_seconds", "config_hash", "worker", "wall_time")


def row_reading(flags: str) -> int:
    """``reread`` of a stored row, from its ``flags`` column (JSON)."""
    return reading_of(json.loads(flags))


def reread(m: Measurement) -> int:
    """Which reading of its candidate a row is: 0 for the first measurement, k for the k-th
    re-measurement a search asked for (``Profiler.measure`` with ``{"reading": k}``)."""
    return reading_of(m.flags)


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _nan(x: Any) -> float:
    return float("nan") if x is None else float(x)


class Journal:
    """Append-only measurement log of one run, shared by every partition search of that run."""

    def __init__(self, conn: sqlite3.Connection, path: Path, config_hash: str) -> None:
        self._conn = conn
        self.path = path
        self.config_hash = config_hash

    @classmethod
    def open(cls, path: str | os.PathLike[str], config_hash: str, timeout_s: float = 60.0) -> "Journal":
        """Open or create the journal at ``path``; refuse one written under another config hash. A
        journal SQLite cannot open (locked by another run past ``timeout_s``, a full disk) is named."""
        try:
            return cls._open(Path(path), config_hash, timeout_s)
        except sqlite3.OperationalError as err:
            raise sqlite3.OperationalError(f"{path}: {err}") from err

    @classmethod
    def _open(cls, p: Path, config_hash: str, timeout_s: float) -> "Journal":
        p.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(p), timeout=timeout_s, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        _switch_to_wal(conn, timeout_s)
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("BEGIN IMMEDIATE")  # create and claim the hash atomically against other openers
        try:
            for stmt in _SCHEMA.strip().split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            row = conn.execute("SELECT value FROM meta WHERE key = 'config_hash'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta (key, value) VALUES ('config_hash', ?), ('measurement_revision', ?)",
                             (config_hash, str(MEASUREMENT_REVISION)))
            revision = _revision(conn)
            conn.execute("COMMIT")
        except BaseException:  # a signal may land after COMMIT: only roll back what is still open
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.close()
            raise
        try:
            _refuse_other(p, revision, None if row is None else row[0], config_hash)
        except JournalMismatchError:
            conn.close()
            raise
        return cls(conn, p, config_hash)

    # -- writing ---------------------------------------------------------------------------------
    def append(self, m: Measurement, *, backend: str, clock_mhz: int | None, gpu_temperature_c: float | None,
               gpu_seconds: float = 0.0) -> None:
        """Commit one measurement (durably, before returning)."""
        c = m.candidate
        readings = json.dumps([asdict(r) for r in m.readings])
        try:
            self._conn.execute(
                "INSERT INTO measurements (partition, slot, sms, freq_mhz, failed, time_s, energy_j, dynamic_energy_j, "
                "static_power_w, temperature_c, measured_freq_mhz, repeats, flags, readings, backend, clock_mhz, "
                "gpu_temperature_c, gpu_seconds, config_hash, worker, wall_time) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (c.partition, c.slot, int(c.sms), int(c.freq_mhz), int(m.failed), _num(m.time_s), _num(m.energy_j),
                 _num(m.dynamic_energy_j), _num(m.static_power_w), _num(m.temperature_c), _num(m.freq_mhz),
                 int(m.repeats), json.dumps(list(m.flags)), readings, backend,
                 None if clock_mhz is None else int(clock_mhz), _num(gpu_temperature_c), float(gpu_seconds),
                 self.config_hash, f"{os.uname().nodename}:{os.getpid()}", time.time()),
            )
        except sqlite3.OperationalError as err:  # a full disk, say: name the file, which SQLite does not
            raise sqlite3.OperationalError(f"{self.path}: {err}") from err

    # -- reading ---------------------------------------------------------------------------------
    def _rows(self, partition: str | None = None) -> Iterator[tuple]:
        q = _ROWS
        args: tuple = ()
        if partition is not None:
            q += " WHERE partition = ?"
            args = (partition,)
        yield from self._conn.execute(q + " ORDER BY id", args)

    @staticmethod
    def _measurement(row: tuple) -> tuple[Measurement, float]:
        (part, slot, sms, freq, failed, t, e, de, sp, temp, mf, reps, flags, readings, gpu_s) = row
        cand = Candidate(part, slot, int(sms), int(freq))
        rs = tuple(Reading(**r) for r in json.loads(readings))
        m = Measurement(cand, _nan(t), _nan(e), _nan(de), _nan(sp), _nan(temp), _nan(mf), int(reps), bool(failed),
                        tuple(json.loads(flags)), rs)
        return m, float(gpu_s)

    def entries(self, partition: str | None = None) -> list[tuple[Measurement, float]]:
        """Every row in order as (measurement, GPU-seconds it cost), duplicates included."""
        return [self._measurement(r) for r in self._rows(partition)]

    def measurements(self, partition: str | None = None) -> list[Measurement]:
        return [m for m, _ in self.entries(partition)]

    def load(self, partition: str | None = None) -> dict[tuple[str, str, int, int], tuple[Measurement, float]]:
        """Latest measurement of each candidate (what a resumed search is answered with); a search's
        deliberate re-measurements (``reread``) are kept apart.

        A candidate has two rows of one reading only when a tensor-parallel group measured it again
        because a peer's journal lacked it; the later row is the group's, the one every rank holds.
        """
        return {key: hit for (key, k), hit in self.load_readings(partition).items() if k == 0}

    def load_readings(self, partition: str | None = None) -> dict[tuple[tuple[str, str, int, int], int],
                                                                  tuple[Measurement, float]]:
        """Latest row of each (candidate, reading): reading 0 is its first measurement, k its k-th
        re-measurement (``reread``)."""
        out: dict[tuple[tuple[str, str, int, int], int], tuple[Measurement, float]] = {}
        for m, g in self.entries(partition):
            out[(m.candidate.key, reread(m))] = (m, g)
        return out

    def count(self, partition: str | None = None) -> int:
        if partition is None:
            return self._conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
        return self._conn.execute("SELECT COUNT(*) FROM measurements WHERE partition = ?", (partition,)).fetchone()[0]

    def duplicates(self) -> list[tuple[str, str, int, int]]:
        """Candidates with more than one row of one reading (none, unless a group measured one again
        on resume); a search's deliberate re-measurements are rows of readings of their own."""
        seen = Counter((m.candidate.key, reread(m)) for m, _ in self.entries())
        return sorted({key for (key, _k), n in seen.items() if n > 1})

    # -- copying rows between journals of one run (the Ray launcher's relay) ----------------------
    def raw_rows(self, partition: str | None = None, after: int = 0) -> list[dict[str, Any]]:
        """Rows after row id ``after``, in order, with every column (``id`` included): a relay copies
        them whole, so the copy keeps the backend, clock, temperature and worker of the original."""
        q = f"SELECT id, {', '.join(ROW_COLUMNS)} FROM measurements WHERE id > ?"
        args: tuple = (int(after),)
        if partition is not None:
            q += " AND partition = ?"
            args += (partition,)
        cols = ("id", *ROW_COLUMNS)
        return [dict(zip(cols, r)) for r in self._conn.execute(q + " ORDER BY id", args)]

    def add_row(self, row: dict[str, Any]) -> bool:
        """Append a row copied from another journal of this config unless its candidate already has a
        row of that reading (``reread``); whether it was appended. Delivery is at least once, so a copy
        can come twice."""
        if row.get("config_hash") != self.config_hash:
            raise _mismatch(self.path, str(row.get("config_hash")), self.config_hash)
        key = tuple(row[k] for k in ("partition", "slot", "sms", "freq_mhz"))
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                held = [flags for (flags,) in self._conn.execute(
                    "SELECT flags FROM measurements WHERE partition = ? AND slot = ? AND sms = ? AND freq_mhz = ?", key)]
                new = row_reading(row["flags"]) not in {row_reading(flags) for flags in held}
                if new:
                    self._conn.execute(f"INSERT INTO measurements ({', '.join(ROW_COLUMNS)}) VALUES "
                                       f"({', '.join('?' * len(ROW_COLUMNS))})", [row[c] for c in ROW_COLUMNS])
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as err:  # a full disk, say: name the file, which SQLite does not
            raise sqlite3.OperationalError(f"{self.path}: {err}") from err
        return new

    def meta_items(self) -> dict[str, str]:
        """Every run-level note but the journal's identity (config hash, measurement revision)."""
        rows = self._conn.execute("SELECT key, value FROM meta WHERE key NOT IN ('config_hash', "
                                  "'measurement_revision')").fetchall()
        return dict(rows)

    def get_meta(self, key: str) -> str | None:
        """A run-level note kept beside the measurements (e.g. a GPU's thermal calibration)."""
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        if key == "config_hash":
            raise ValueError("the config hash is fixed when the journal is created")
        self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def integrity_ok(self) -> bool:
        return self._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _switch_to_wal(conn: sqlite3.Connection, timeout_s: float) -> None:
    """``PRAGMA journal_mode = WAL``, retried: when several processes open a new journal at once,
    SQLite answers the switch with "database is locked" at once, without waiting on busy_timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@contextmanager
def _read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection that leaves the folder as it found it.

    Reading a WAL database makes SQLite create the ``-wal`` and ``-shm`` side files, which a read-only
    connection cannot remove on close; the ones this call created (the ``-wal`` still empty) are removed.
    """
    wal, shm = (path.with_name(path.name + suffix) for suffix in ("-wal", "-shm"))
    created = [side for side in (wal, shm) if not side.exists()]
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        yield conn
    finally:
        conn.close()
        if not (wal in created and wal.exists() and wal.stat().st_size):  # content: a writer came by
            for side in created:
                side.unlink(missing_ok=True)


_ROWS = ("SELECT partition, slot, sms, freq_mhz, failed, time_s, energy_j, dynamic_energy_j, static_power_w, "
         "temperature_c, measured_freq_mhz, repeats, flags, readings, gpu_seconds FROM measurements")


def _undecodable_row(conn: sqlite3.Connection) -> str | None:
    """The first row a resume could not read back (its number and why), or None: SQLite's page check
    passes a row whose JSON or values were damaged, and the resume crashed on it mid-run."""
    for number, row in enumerate(conn.execute(_ROWS + " ORDER BY id"), start=1):
        try:
            Journal._measurement(row)
        except (ValueError, TypeError, KeyError) as err:  # JSONDecodeError is a ValueError
            return f"measurement {number}: {type(err).__name__}: {err}"
    return None


def check_journal(path: str | os.PathLike[str], config_hash: str) -> None:
    """Refuse (:class:`JournalError`) a journal that is missing, not a Kareus journal, or of another config.

    Read-only: checking a run that is to be resumed must not change it.
    """
    p = Path(path)
    if not p.is_file():
        raise JournalError(f"{p.parent} has no {p.name}: not the directory of a run that measured anything")
    try:
        with _read_only(p) as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'config_hash'").fetchone()
            revision = _revision(conn)
            conn.execute("SELECT COUNT(*) FROM measurements").fetchone()
            # COUNT(*) reads an index alone: every page must be read, or a damaged one fails mid-run
            damage = conn.execute("PRAGMA quick_check").fetchone()[0]
            if damage == "ok":
                damage = _undecodable_row(conn) or "ok"
    except sqlite3.Error as err:
        raise JournalError(f"{p} is not a readable Kareus journal ({err})") from None
    if damage != "ok":
        raise JournalError(f"{p} is not a readable Kareus journal (damaged: {damage})")
    if row is None:
        raise JournalError(f"{p} is not a Kareus journal (it records no config hash)")
    _refuse_other(p, revision, row[0], config_hash)


def read_measurements(path: str | os.PathLike[str]) -> list[Measurement]:
    """Every measurement of a journal in order, read without changing it (the latest row of a candidate
    last); JournalError if it is not a readable Kareus journal."""
    return [m for m, _ in read_backend_measurements(path)]


def read_backend_measurements(path: str | os.PathLike[str]) -> list[tuple[Measurement, str]]:
    """``read_measurements`` with the backend each row was measured on (``sim:a100``, ``cuda``, ...):
    what a warm-started search matches its hardware by."""
    p = Path(path)
    if not p.is_file():
        raise JournalError(f"{p.parent} has no {p.name}: not the directory of a run that measured anything")
    try:
        with _read_only(p) as conn:
            return [(Journal._measurement(row[:-1])[0], str(row[-1]))
                    for row in conn.execute(_ROWS.replace(" FROM", ", backend FROM") + " ORDER BY id")]
    except (sqlite3.Error, ValueError, TypeError, KeyError) as err:
        raise JournalError(f"{p} is not a readable Kareus journal ({err})") from None


def copy_journal(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Copy a journal with SQLite's backup API: a consistent snapshot, WAL content included."""
    d = Path(dest)
    d.parent.mkdir(parents=True, exist_ok=True)
    with _read_only(Path(source)) as src:
        target = sqlite3.connect(str(d))
        try:
            src.backup(target)
        except sqlite3.Error as err:  # a full disk: no half copy for a later resume to trip over
            target.close()
            d.unlink(missing_ok=True)
            raise sqlite3.OperationalError(f"{d}: {err}") from err
        finally:
            target.close()
