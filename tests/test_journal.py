"""The measurement journal: exact round trips, the config-hash guard, concurrent and killed writers."""
from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kareus.profiler import Journal, JournalMismatchError, journal_path_for
from kareus.types import Candidate, Measurement, Reading

ROOT = Path(__file__).resolve().parents[1]


def meas(part: str, i: int, failed: bool = False) -> Measurement:
    c = Candidate(part, "attn_0" if i % 2 else "sequential", 2 + i % 7, 1410 - 15 * (i % 20))
    if failed:
        return Measurement.failure(c, "read failed after 3 tries: counter wrapped",
                                   (Reading(math.nan, math.nan, math.nan, math.nan, 5.0, 0, False, "wrap"),))
    t = 1e-3 * (1 + i / 7)
    r = (Reading(t, 0.1 + i / 3, 61.25 + i, 1410.0, 5.0001, 4321), Reading(t * 1.01, 0.1 + i / 3.1, 62.5, 1395.0, 5.0, 4300))
    return Measurement(c, t, 0.1 + i / 3, 0.05 + i / 3, 90.0, 61.875, 1402.5, 2, False, ("outlier:1",), r)


def test_round_trip_is_exact(tmp_path):
    path = journal_path_for(tmp_path)
    assert path == tmp_path / "journal.sqlite"
    with Journal.open(path, "abc") as j:
        ms = [meas("fwd", i) for i in range(5)] + [meas("bwd", 9, failed=True)]
        for m in ms:
            j.append(m, backend="sim", clock_mhz=m.candidate.freq_mhz, gpu_temperature_c=55.5, gpu_seconds=13.0)
    with Journal.open(path, "abc") as j:
        back = j.measurements()
        assert back[:5] == ms[:5] and [b.readings for b in back[:5]] == [m.readings for m in ms[:5]]
        f = back[5]
        assert f.failed and f.flags == ms[5].flags and math.isnan(f.time_s) and not f.readings[0].ok
        assert list(j.load("fwd")) == [m.candidate.key for m in ms[:5]]
        assert j.entries("bwd")[0][1] == 13.0 and j.count() == 6 and j.duplicates() == []
        row = j._conn.execute("SELECT backend, clock_mhz, gpu_temperature_c, config_hash FROM measurements").fetchone()
        assert row == ("sim", ms[0].candidate.freq_mhz, 55.5, "abc")


def test_a_candidate_measured_again_is_answered_with_its_latest_row(tmp_path):
    """A tensor-parallel group measures a candidate again when a peer's journal lacks it; a later
    resume must answer it on every rank with that group measurement, not the rank's older one."""
    from dataclasses import replace

    old = meas("fwd", 1)
    new = replace(old, time_s=old.time_s * 2, energy_j=old.energy_j * 2)
    with Journal.open(tmp_path / "j.sqlite", "abc") as j:
        for m, cost in ((old, 1.0), (new, 2.0)):
            j.append(m, backend="sim", clock_mhz=None, gpu_temperature_c=None, gpu_seconds=cost)
        (got, cost), = j.load().values()
    assert (got.time_s, got.energy_j, cost) == (new.time_s, new.energy_j, 2.0)


def test_other_config_hash_is_refused_with_one_line(tmp_path):
    Journal.open(tmp_path / "j.sqlite", "aaaa").close()
    with pytest.raises(JournalMismatchError) as e:
        Journal.open(tmp_path / "j.sqlite", "bbbb")
    msg = str(e.value)
    assert "\n" not in msg and "aaaa" in msg and "bbbb" in msg and "new run directory" in msg


def _set_revision(path: Path, value: str | None) -> None:
    """Stamp a journal as another Kareus would have written it (``None``: before revisions were recorded)."""
    with sqlite3.connect(path) as con:
        con.execute("DELETE FROM meta WHERE key = 'measurement_revision'")
        if value is not None:
            con.execute("INSERT INTO meta (key, value) VALUES ('measurement_revision', ?)", (value,))
    con.close()


@pytest.mark.parametrize("stamp, shown", [(None, "0"), ("999", "999")])
def test_a_journal_of_another_measurement_revision_is_refused_with_one_line(tmp_path, stamp, shown):
    """Same config, another Kareus: its partition keys or measured values may mean something else, so
    its numbers must not answer this run's candidates, on open nor on a resume's check."""
    from kareus.profiler.journal import MEASUREMENT_REVISION, check_journal

    path = tmp_path / "journal.sqlite"
    with Journal.open(path, "aaaa") as j:
        j.append(meas("fwd", 1), backend="sim", clock_mhz=1410, gpu_temperature_c=50.0)
    _set_revision(path, stamp)
    for attempt in (lambda: Journal.open(path, "aaaa"), lambda: check_journal(path, "aaaa")):
        with pytest.raises(JournalMismatchError) as e:
            attempt()
        msg = str(e.value)
        assert "\n" not in msg and f"revision {shown}," in msg and f"revision {MEASUREMENT_REVISION} " in msg
        assert "new run directory" in msg
    _set_revision(path, str(MEASUREMENT_REVISION))
    with Journal.open(path, "aaaa") as j:  # its own revision continues
        assert j.count() == 1


def _writer(path: str, part: str, n: int) -> None:
    with Journal.open(path, "h") as j:
        for i in range(n):
            j.append(meas(part, i), backend="sim", clock_mhz=1410, gpu_temperature_c=50.0, gpu_seconds=1.0)


def test_concurrent_writers_do_not_corrupt(tmp_path):
    path = str(tmp_path / "j.sqlite")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, f"p{k}", 40)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with Journal.open(path, "h") as j:
        assert j.integrity_ok() and j.count() == 160 and j.duplicates() == []
        for k in range(4):
            assert j.measurements(f"p{k}") == [meas(f"p{k}", i) for i in range(40)]


KILLED_WRITER = """
import sys
from kareus.profiler import Journal
from kareus.types import Candidate, Measurement
j = Journal.open(sys.argv[1], "h")
i = 0
while True:
    c = Candidate("p", "sequential", i % 100, 1000 + i)
    j.append(Measurement(c, 1.0, float(i), 0.5, 90.0, 50.0, 1000.0, 1), backend="sim", clock_mhz=1000,
             gpu_temperature_c=50.0)
    if i == 0:
        print("ready", flush=True)
    i += 1
"""


def test_sigkill_mid_write_leaves_a_valid_journal(tmp_path):
    path = tmp_path / "j.sqlite"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with Journal.open(path, "h") as j:
        n = j.count()
        assert n >= 1 and j.integrity_ok()
        assert [m.energy_j for m in j.measurements()] == [float(i) for i in range(n)]  # a prefix, none torn


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_check_refuses_what_cannot_be_resumed_and_changes_nothing(tmp_path):
    from kareus.profiler.journal import JournalError, check_journal

    with pytest.raises(JournalError, match="has no journal.sqlite"):
        check_journal(tmp_path / "journal.sqlite", "h")
    assert list(tmp_path.iterdir()) == []  # nothing created where the journal was looked for
    (tmp_path / "journal.sqlite").write_text("not a database")
    with pytest.raises(JournalError, match="not a readable Kareus journal"):
        check_journal(tmp_path / "journal.sqlite", "h")
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as con:
        con.execute("CREATE TABLE t (x)")
    with pytest.raises(JournalError, match="not a readable Kareus journal"):
        check_journal(other, "h")
    good = tmp_path / "good" / "journal.sqlite"
    with Journal.open(good, "aaaa") as j:
        j.append(meas("fwd", 1), backend="sim", clock_mhz=1410, gpu_temperature_c=50.0)
    before = _files(good.parent)
    with pytest.raises(JournalMismatchError, match="aaaa.*bbbb"):
        check_journal(good, "bbbb")
    check_journal(good, "aaaa")
    assert _files(good.parent) == before  # read-only: no bytes changed, no -wal/-shm left behind


def test_copy_holds_the_rows_a_live_writer_has_only_in_its_wal(tmp_path):
    from kareus.profiler.journal import copy_journal

    source = tmp_path / "old" / "journal.sqlite"
    writer = Journal.open(source, "h")
    writer._conn.execute("PRAGMA wal_autocheckpoint = 0")  # keep the rows in the -wal file
    for i in range(5):
        writer.append(meas("fwd", i), backend="sim", clock_mhz=1410, gpu_temperature_c=50.0)
    assert source.with_name("journal.sqlite-wal").stat().st_size > 0
    copy_journal(source, tmp_path / "new" / "journal.sqlite")
    writer.close()
    with Journal.open(tmp_path / "new" / "journal.sqlite", "h") as copy:
        assert copy.measurements() == [meas("fwd", i) for i in range(5)] and copy.integrity_ok()
        copy.append(meas("fwd", 9), backend="sim", clock_mhz=1410, gpu_temperature_c=50.0)
    with Journal.open(source, "h") as old:
        assert old.count() == 5  # the copy is continued, the old journal is not


def _checked_journal(folder: Path, rows: int) -> Path:
    """A journal of ``rows`` measurements under hash ``h``, which its check accepts as written."""
    from kareus.profiler.journal import check_journal

    path = folder / "journal.sqlite"
    with Journal.open(path, "h") as j:
        for i in range(rows):
            j.append(meas("fwd", i), backend="sim", clock_mhz=1410, gpu_temperature_c=50.0)
    check_journal(path, "h")
    return path


def test_check_reads_every_page_of_a_journal_to_be_resumed(tmp_path):
    """A damaged page of the measurements table is refused with one line before the run starts: a
    row count, answered from an index alone, passed it, and the resumed run died mid-way."""
    from kareus.profiler.journal import JournalError, check_journal

    path = _checked_journal(tmp_path, 300)
    with sqlite3.connect(path) as con:
        [(root,)] = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'measurements'").fetchall()
        [(size,)] = con.execute("PRAGMA page_size").fetchall()
    data = bytearray(path.read_bytes())
    data[(root - 1) * size: root * size] = b"\xff" * size
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match="not a readable Kareus journal"):
        check_journal(path, "h")


def test_check_reads_back_every_row_of_a_journal_to_be_resumed(tmp_path):
    """A row whose readings were damaged passed SQLite's page check; the resume then crashed on it
    with a JSONDecodeError traceback, a new run folder left behind."""
    from kareus.profiler.journal import JournalError, check_journal

    path = _checked_journal(tmp_path, 3)
    with sqlite3.connect(path) as con:
        con.execute("UPDATE measurements SET readings = '[X' WHERE id = 2")
    with pytest.raises(JournalError, match=r"not a readable Kareus journal \(damaged: measurement 2: JSONDecodeError"):
        check_journal(path, "h")


# What a journal row means under each measurement revision, as ``measurement_fingerprint()`` reads it.
# A change of partitions, ops, the simulated GPU or the profiler's protocol changes it: then bump
# MEASUREMENT_REVISION (kareus/profiler/journal.py) and pin the new fingerprint under the new revision.
REVISION_FINGERPRINTS = {2: "4793f24cf4618de9", 3: "1984b41c6b631666", 4: "240eab56ef1e5588"}


def _sig(x: float) -> str:
    return f"{x:.6g}"


def measurement_fingerprint() -> str:
    """A hash of the tiny model's partitions (keys, ops, slots) on pp2_tp2 for each norm and activation,
    the simulated A100's outcomes of a few settings of each, and one default-protocol profile."""
    import hashlib

    from omegaconf import OmegaConf

    import kareus.hardware  # noqa: F401  (registers the backends)
    import kareus.partition  # noqa: F401
    from kareus.config.schema import ModelConfig, ParallelConfig
    from kareus.hardware.model import simulate_partition
    from kareus.profiler import Profiler, ProfilerConfig
    from kareus.registry import HARDWARE, PARTITIONERS
    from kareus.types import SEQUENTIAL
    from kareus.workload import build_workload

    conf = ROOT / "kareus" / "conf"
    hw = OmegaConf.load(conf / "hardware" / "a100_sim.yaml")
    hw.pop("defaults", None)
    par = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig),
                                              OmegaConf.load(conf / "parallel" / "pp2_tp2.yaml"))).spec()
    parts = []
    for norm, act in (("rmsnorm", "swiglu"), ("layernorm", "gelu")):
        m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(conf / "model" / "tiny.yaml"),
                            {"norm": norm, "activation": act, "qk_layernorm": True})
        types = PARTITIONERS.build("nanobatch", config={}).partition(build_workload(OmegaConf.to_object(m).spec(), par)).types
        parts += [(norm, act, t) for t in types]
    backend = HARDWARE.build("sim", config=hw, seed=0)
    lines = []
    for norm, act, t in parts:
        lines.append(f"{norm} {act} {t.key} {t!r}")
        for slot in (SEQUENTIAL, t.slots[0].label if t.slots else SEQUENTIAL):
            for sms, mhz in ((4, 1410), (16, 990)):
                o = simulate_partition(backend.cfg, t, slot, sms, mhz)
                lines.append(" ".join(map(_sig, (o.time_s, o.dynamic_j, o.static_scale, o.overlap_s, o.exposed_comm_s))))
    first = parts[0][2]
    with Profiler(ProfilerConfig(), backend) as prof:
        m = prof.measure(first, Candidate(first.key, SEQUENTIAL, 8, 1200))
    lines.append(" ".join(map(_sig, (m.time_s, m.energy_j, m.dynamic_energy_j))))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def test_what_journal_rows_mean_is_pinned_to_the_measurement_revision():
    """Journals of another revision are refused on resume; this keeps the revision honest: a change
    of what a row means without a bump would let a resumed run mix old numbers with new ones."""
    from kareus.profiler.journal import MEASUREMENT_REVISION

    assert REVISION_FINGERPRINTS.get(MEASUREMENT_REVISION) == measurement_fingerprint(), (
        "what a journal row means changed: bump MEASUREMENT_REVISION in kareus/profiler/journal.py and pin "
        "measurement_fingerprint() under the new revision in REVISION_FINGERPRINTS")


def test_a_journal_another_process_holds_is_named_as_the_machines_failure(tmp_path):
    """Locked past the busy timeout, the journal's open ended the run with a traceback naming no file."""
    from kareus.errors import machine_failure

    path = tmp_path / "journal.sqlite"
    Journal.open(path, "h").close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError) as caught:
            Journal.open(path, "h", timeout_s=0.2)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert machine_failure(caught.value) == f"{path}: database is locked"


def test_a_copy_that_fails_leaves_no_half_journal(tmp_path, monkeypatch):
    """A full disk mid-copy left a 0-byte journal that the error line then told the user to resume."""
    from kareus.profiler import journal as journal_module

    source = tmp_path / "old" / "journal.sqlite"
    with Journal.open(source, "h") as j:
        j.append(meas("fwd", 1), backend="sim", clock_mhz=1410, gpu_temperature_c=50.0)
    dest = tmp_path / "new" / "journal.sqlite"

    class FullDisk:
        def __init__(self, conn):
            self.conn = conn

        def backup(self, target):
            target.execute("CREATE TABLE half (x)")
            raise sqlite3.OperationalError("database or disk is full")

        def __getattr__(self, name):
            return getattr(self.conn, name)

    real = journal_module._read_only

    @contextlib.contextmanager
    def full(path):
        with real(path) as conn:
            yield FullDisk(conn)

    monkeypatch.setattr(journal_module, "_read_only", full)
    with pytest.raises(sqlite3.OperationalError, match=f"^{dest}: database or disk is full$"):
        journal_module.copy_journal(source, dest)
    assert not dest.exists()
