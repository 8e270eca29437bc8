"""A run stopped by SIGTERM or Ctrl-C: one line that says how to continue, its MLflow runs closed as
KILLED (none left RUNNING), and ``resume=`` finishes it without measuring anything twice."""
from __future__ import annotations

import errno
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from test_cli_errors import error_lines

pytestmark = pytest.mark.slow

TINY = ["+model=tiny", "parallel=pp1_tp2", "progress=false"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(COLUMNS="200", NO_COLOR="1", PYTHONWARNINGS="ignore")
    return env


def _as_a_terminal_has_it() -> None:
    """Ctrl-C at its default in the child: a shell starts background jobs with SIGINT ignored, a
    child inherits that (and rightly keeps it), so tests run in the background would see no Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_mid_search(cwd: Path, sig: int) -> tuple[subprocess.CompletedProcess, Path]:
    """Start a run, send ``sig`` once it measures (its journal holds a measurement), and wait for it to exit."""
    proc = subprocess.Popen([sys.executable, "-m", "kareus", *TINY, "hydra.run.dir=runs/stopped"], cwd=cwd,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_a_terminal_has_it)
    run_dir = cwd / "runs" / "stopped"
    deadline = time.monotonic() + 300
    while not _measured(run_dir) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run_dir


def _measured(run_dir: Path) -> bool:
    """The run's journal holds a measurement (the file exists a moment before its tables do)."""
    if not (run_dir / "journal.sqlite").exists():
        return False
    try:
        return _rows(run_dir)[0] > 0
    except sqlite3.OperationalError:  # no table yet, or the database is busy
        return False


def _statuses(cwd: Path) -> dict[str, set[str]]:
    with closing(sqlite3.connect(cwd / "runs" / "mlflow.db")) as con:
        rows = con.execute("SELECT r.status, t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                           "WHERE t.key = 'kareus.kind'").fetchall()
    out: dict[str, set[str]] = {}
    for status, kind in rows:
        out.setdefault(kind, set()).add(status)
    return out


def _rows(run_dir: Path) -> tuple[int, list]:
    with closing(sqlite3.connect(run_dir / "journal.sqlite")) as con:
        dups = con.execute("SELECT partition, slot, sms, freq_mhz FROM measurements "
                           "GROUP BY partition, slot, sms, freq_mhz HAVING COUNT(*) > 1").fetchall()
        return con.execute("SELECT COUNT(*) FROM measurements").fetchone()[0], dups


@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_stopped_run_says_how_to_continue_and_closes_its_mlflow_runs(tmp_path, sig, code, word):
    res, run_dir = _stop_mid_search(tmp_path, sig)
    assert res.returncode == code, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert error_lines(res.stderr) == [f"{word}; continue with resume={run_dir}"]
    statuses = _statuses(tmp_path)
    assert statuses["invocation"] == {"KILLED"}
    assert "RUNNING" not in set().union(*statuses.values()), statuses


def test_resume_finishes_a_terminated_run_without_measuring_twice(tmp_path):
    _, stopped = _stop_mid_search(tmp_path, signal.SIGTERM)
    partial, _ = _rows(stopped)
    res = subprocess.run([sys.executable, "-m", "kareus", *TINY, f"resume={stopped}", "hydra.run.dir=runs/resumed",
                          "tracking.enabled=false"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows, dups = _rows(tmp_path / "runs" / "resumed")
    assert rows >= partial and dups == []
    assert _rows(stopped)[0] == partial  # the stopped run's journal stays as it was


def test_ctrl_c_to_the_whole_process_group_with_worker_processes_is_one_line(tmp_path):
    """A terminal sends Ctrl-C to every process of the group: the pool's workers leave it to the parent,
    which stops them and prints its one line (no traceback from each worker)."""
    proc = subprocess.Popen([sys.executable, "-m", "kareus", *TINY, "launcher=process", "hydra.run.dir=runs/pool"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_a_terminal_has_it)
    journal = tmp_path / "runs" / "pool" / "journal.sqlite"
    deadline = time.monotonic() + 300
    while not journal.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the workers are measuring
    assert proc.poll() is None, "the run ended before it could be stopped"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and error_lines(err) == [f"interrupted; continue with resume={journal.parent}"]


# sitecustomize modules that make the machine fail mid-run, imported by the child at start-up
_FULL_AT_PLANS = '''
import errno
import pathlib

_write = pathlib.Path.write_text

def _full(self, *args, **kwargs):
    if self.parent.name == "plans":
        raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return _write(self, *args, **kwargs)

pathlib.Path.write_text = _full
'''
_FULL_AT_FOURTH_MEASUREMENT = '''
import sqlite3
from kareus.profiler import journal

class _FillsUp:
    def __init__(self, conn):
        self._conn, self._rows = conn, 0
    def execute(self, sql, *args):
        if sql.startswith("INSERT INTO measurements"):
            self._rows += 1
            if self._rows > 3:
                raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)
    def __getattr__(self, name):
        return getattr(self._conn, name)

_init = journal.Journal.__init__
journal.Journal.__init__ = lambda self, conn, path, h: _init(self, _FillsUp(conn), path, h)
'''


@pytest.mark.parametrize("inject, where, rows", [
    (_FULL_AT_PLANS, r"plans/plan_[0-9a-f]{8}\.yaml: No space left on device", None),  # a plan is named by its id
    (_FULL_AT_FOURTH_MEASUREMENT, re.escape("journal.sqlite: database or disk is full"), 3),
])
def test_a_full_disk_is_one_line_that_says_how_to_continue(tmp_path, inject, where, rows):
    """The machine's fault, not the run's: no traceback, status 1, and the journal to resume from."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(inject)
    env = {**_env(), "PYTHONPATH": str(tmp_path / "inject")}
    res = subprocess.run([sys.executable, "-m", "kareus", *TINY, "search=random", "search.budget=6",
                          "tracking.enabled=false", "hydra.run.dir=runs/full"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "runs" / "full"
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    at = re.escape(str(run_dir))
    line = error_lines(res.stderr)[-1]
    assert re.fullmatch(f"error: {at}/{where}; continue with resume={at}", line), res.stderr[-3000:]
    kept, _ = _rows(run_dir)
    if rows is not None:  # the journal holds what was written before the disk filled
        assert kept == rows
    res = subprocess.run([sys.executable, "-m", "kareus", *TINY, "search=random", "search.budget=6",
                          "tracking.enabled=false", f"resume={run_dir}", "hydra.run.dir=runs/resumed"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    after, dups = _rows(tmp_path / "runs" / "resumed")
    assert dups == []
    if rows is None:  # the plans failed after every search had finished: the resume measures nothing
        assert after == kept
    else:
        assert after > kept
    assert (tmp_path / "runs" / "resumed" / "plan_selected.yaml").is_file()


def test_a_machine_failure_is_found_through_the_errors_a_library_raised_from_it():
    """MLflow raises its own exception from SQLAlchemy's, which SQLAlchemy raised from SQLite's."""
    from kareus.errors import machine_failure

    def chained(*errors: BaseException) -> BaseException:
        for outer, inner in zip(errors, errors[1:]):
            outer.__cause__ = inner
        return errors[0]

    full = sqlite3.OperationalError("database or disk is full")
    assert machine_failure(chained(RuntimeError("mlflow"), ValueError("sqlalchemy"), full)) == str(full)
    assert machine_failure(OSError(errno.ENOSPC, "No space left on device", "/x/plan.yaml")) == "/x/plan.yaml: No space left on device"
    assert machine_failure(OSError(errno.EACCES, "Permission denied")) == "Permission denied"
    assert machine_failure(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x")) is None  # may be a bug
    assert machine_failure(sqlite3.OperationalError("no such table: measurements")) is None
    handling = RuntimeError("a bug while handling a full disk")
    handling.__context__ = full
    assert machine_failure(handling) is None
