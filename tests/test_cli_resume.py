"""``resume=<run dir>`` from the command line: a run that cannot be continued is refused before anything
is recorded, and every run directory holds its own whole journal, so resumes chain and never re-measure."""
from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from kareus.profiler import Journal
from test_cli_errors import error_lines, kareus, left_behind

pytestmark = pytest.mark.slow

TINY = ["+model=tiny", "parallel=pp1_tp2", "progress=false"]


def _rows(run_dir: Path) -> int:
    """Rows of a run's journal, none of them a candidate measured twice (the file is left closed)."""
    with closing(sqlite3.connect(run_dir / "journal.sqlite")) as con:
        [(digest,)] = con.execute("SELECT value FROM meta WHERE key = 'config_hash'").fetchall()
    with Journal.open(run_dir / "journal.sqlite", digest) as journal:
        assert journal.duplicates() == []
        return journal.count()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("resume")
    res = kareus(cwd, *TINY, "hydra.run.dir=runs/a", "tracking.enabled=false", timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return cwd / "runs" / "a"


def test_resumes_chain_each_run_dir_holds_its_whole_journal(first):
    cwd = first.parents[1]
    rows = _rows(first)
    before = _files(first)
    for old, new in (("a", "b"), ("b", "c")):
        res = kareus(cwd, *TINY, f"resume=runs/{old}", f"hydra.run.dir=runs/{new}", "tracking.enabled=false",
                     timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert _rows(cwd / "runs" / new) == rows  # every candidate answered from its own copied journal
        said = [ln for ln in res.stdout.splitlines() if ln.startswith("resume: ")]
        assert len(said) == 1 and " measured now (0.00 simulated GPU-hours)" in said[0], res.stdout[-2000:]
        assert said[0].startswith("resume: ") and "candidates answered from the journal" in said[0]
        summary = json.loads((cwd / "runs" / new / "summary.json").read_text())
        assert summary["measured_now"] == 0 and summary["profiled"] > 0
    assert _files(first) == before  # the old run is never written to, not even a -wal file
    assert (cwd / "runs" / "c" / "search_summary.json").read_text() == \
        (cwd / "runs" / "b" / "search_summary.json").read_text()


def test_a_resume_with_another_microbatch_count_recomposes_without_measuring(first):
    """parallel.num_microbatches only shapes composition: the resume answers every candidate from the
    copied journal and its plans cover the new count."""
    cwd = first.parents[1]
    rows = _rows(first)
    res = kareus(cwd, *TINY, "parallel.num_microbatches=5", "resume=runs/a", "hydra.run.dir=runs/m5",
                 "tracking.enabled=false", timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert _rows(cwd / "runs" / "m5") == rows
    assert (cwd / "runs" / "m5" / "search_summary.json").read_text() == (first / "search_summary.json").read_text()
    assert "num_microbatches: 5" in (cwd / "runs" / "m5" / "plan_selected.yaml").read_text()
    assert "num_microbatches: 2" in (first / "plan_selected.yaml").read_text()


def _broken(folder: Path) -> Path:
    folder.mkdir()
    (folder / "journal.sqlite").write_text("not a database")
    return folder


def _older(first: Path):
    """A copy of ``first`` as a Kareus from before measurement revisions would have left it."""
    def make(folder: Path) -> Path:
        import shutil

        shutil.copytree(first, folder)
        with closing(sqlite3.connect(folder / "journal.sqlite")) as con, con:
            con.execute("DELETE FROM meta WHERE key = 'measurement_revision'")
        return folder
    return make


def _foreign(folder: Path) -> Path:
    folder.mkdir()
    (folder / "notes.txt").write_text("someone else's folder")
    return folder


@pytest.mark.parametrize("make, extra, says", [
    (lambda d: d / "nowhere", [], "is not a run directory"),
    (_foreign, [], "has no journal.sqlite"),
    (_broken, [], "is not a readable Kareus journal"),
    (None, ["search.budget_frac=0.3"], "was written with config hash"),
    (None, ["search.budget_frac=0.3", "seed=3"], "; it differs in search.budget_frac (0.15 -> 0.3), search.seed (0 -> 3), seed (0 -> 3)"),
    ("older", [], "was measured under measurement revision 0"),
])
def test_a_resume_that_cannot_continue_is_refused_before_anything_is_recorded(first, tmp_path, make, extra, says):
    make = _older(first) if make == "older" else make
    target = first if make is None else make(tmp_path / "old")
    before = _files(target) if target.exists() else {}
    work = tmp_path / "work"
    work.mkdir()
    res = kareus(work, *TINY, f"resume={target}", *extra, timeout=300)  # tracking on: no MLflow run either
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: resume: ") and says in lines[0], lines
    assert left_behind(work) == []  # no run folder, no MLflow store
    assert (_files(target) if target.exists() else {}) == before  # no journal made in a foreign folder


def test_a_refused_resume_in_place_names_what_differs_from_the_runs_own_config(first, tmp_path):
    """Resuming into the old run's own folder: Hydra has rewritten its saved config by then."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(first, work / "runs" / "a")
    before = (work / "runs" / "a" / ".hydra" / "config.yaml").read_bytes()
    res = kareus(work, *TINY, "seed=1", "resume=runs/a", "hydra.run.dir=runs/a", timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: resume: "), lines
    assert lines[0].endswith("; it differs in search.seed (0 -> 1), seed (0 -> 1)"), lines
    assert (work / "runs" / "a" / ".hydra" / "config.yaml").read_bytes() == before


def test_a_rerun_refused_at_the_plan_keeps_its_own_config_beside_its_outputs(first, tmp_path):
    """The refusal comes after the rerun replaced the folder's outputs: the old config put back would
    describe results that are gone, and the old plan_selected.yaml would pass for the rerun's."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(first, work / "runs" / "a")
    assert (work / "runs" / "a" / "plan_selected.yaml").is_file()
    res = kareus(work, *TINY, "plan.deadline_s=0.000001", "hydra.run.dir=runs/a", "tracking.enabled=false",
                 timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert error_lines(res.stderr)[-1].startswith("error: plan: no plan meets plan.deadline_s=1e-06 s")
    assert not (work / "runs" / "a" / "plan_selected.yaml").exists()
    assert "deadline_s: 1.0e-06" in (work / "runs" / "a" / ".hydra" / "config.yaml").read_text()


def test_describe_into_a_folder_that_holds_a_run_leaves_its_config_as_it_was(first, tmp_path):
    import shutil

    work = tmp_path / "work"
    shutil.copytree(first, work / "runs" / "a")
    before = _files(work / "runs" / "a")
    res = kareus(work, "+model=tiny", "parallel=pp2_tp2", "mode=describe", "hydra.run.dir=runs/a", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _files(work / "runs" / "a") == before


def test_a_relative_resume_is_found_from_the_start_folder_when_hydra_changes_into_the_job(first):
    cwd = first.parents[1]
    res = kareus(cwd, *TINY, "resume=runs/a", "hydra.run.dir=runs/chdir", "hydra.job.chdir=true",
                 "tracking.enabled=false", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _rows(cwd / "runs" / "chdir") == _rows(first)


def test_describe_with_resume_checks_the_journal_and_copies_nothing(first):
    cwd = first.parents[1]
    res = kareus(cwd, *TINY, "mode=describe", "resume=runs/a", "hydra.run.dir=runs/described", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (cwd / "runs" / "described" / "journal.sqlite").exists()


def test_a_run_directory_with_another_configs_journal_is_refused_before_anything_is_recorded(first, tmp_path):
    import shutil

    work = tmp_path / "work"
    shutil.copytree(first, work / "runs" / "reused")
    res = kareus(work, *TINY, "seed=1", "hydra.run.dir=runs/reused", timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: journal: ") and "config hash" in lines[0], lines
    # it names what differs from the run the folder holds, as a refused resume does
    assert lines[0].endswith("; it differs in search.seed (0 -> 1), seed (0 -> 1)"), lines
    # also where Hydra writes no config of its own (hydra.output_subdir=null): the folder's is read
    res = kareus(work, *TINY, "seed=1", "hydra.run.dir=runs/reused", "hydra.output_subdir=null", timeout=300)
    assert res.returncode == 2 and error_lines(res.stderr)[0].endswith("; it differs in search.seed (0 -> 1), seed (0 -> 1)")
    assert not (work / "runs" / "mlflow.db").exists()  # refused before the MLflow run was opened


def test_a_resume_after_the_replay_table_changed_is_refused_and_says_so(tmp_path):
    """The config names the table by path: a table recorded again (every energy doubled here) under the
    same path would have had its candidates answered with the old table's numbers."""
    table = tmp_path / "t.csv"
    rows = [("sequential", 4, 1410, 0.004, 1.0), ("norm_0", 4, 1410, 0.003, 0.9), ("norm_0", 8, 1200, 0.0031, 0.8)]

    def write(scale: float) -> None:
        table.write_text("partition,slot,sms,freq_mhz,time_s,energy_j,repeat\n" + "".join(
            f"p,{s},{n},{f},{t},{e * scale},0\n" for s, n, f, t, e in rows))

    args = ["mode=search", "hardware=replay", f"hardware.table={table}", "search=exhaustive", "progress=false",
            "tracking.enabled=false"]
    write(1.0)
    res = kareus(tmp_path, *args, "hydra.run.dir=runs/a", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    res = kareus(tmp_path, *args, "resume=runs/a", "hydra.run.dir=runs/same", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]  # the same table: resumed
    write(2.0)
    res = kareus(tmp_path, *args, "resume=runs/a", "hydra.run.dir=runs/b", timeout=300)
    [line] = error_lines(res.stderr)
    assert res.returncode != 0 and line.startswith("error: resume: journal ")
    assert line.endswith(f"its config is the same, but the replay table {table} changed since it was measured")
    assert not (tmp_path / "runs" / "b" / "journal.sqlite").exists()


def test_a_search_in_the_folder_of_a_run_removes_the_runs_plans(tmp_path):
    """``mode=search`` composes nothing: the earlier run's plans stayed beside a config and summary
    of a search, and a launcher reading the folder would take that run's plan for this one's."""
    args = (*TINY, "search=random", "search.budget=8", "tracking.enabled=false", "hydra.run.dir=runs/a")
    assert kareus(tmp_path, *args, timeout=600).returncode == 0
    run = tmp_path / "runs" / "a"
    composed = ("frontier_iteration.csv", "plan_selected.yaml", "plans")
    assert all((run / name).exists() for name in composed)
    (run / "notes.txt").write_text("the user's own")
    res = kareus(tmp_path, *args, "mode=search", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [name for name in composed if (run / name).exists()] == []
    assert (run / "notes.txt").is_file() and (run / "search_summary.json").is_file()


def test_the_run_directory_line_is_never_broken_for_a_pipe(tmp_path, monkeypatch):
    """Piped output was hard-wrapped at 160 columns (80 under FORCE_COLOR, which many CI systems set):
    a long run directory came out over three lines, and a script reading it for resume= got a piece."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    run = "runs/" + "a" * 90 + "/" + "b" * 90
    res = kareus(tmp_path, *TINY, "mode=search", "search=random", "search.budget=4", "tracking.enabled=false",
                 f"hydra.run.dir={run}", timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if "run directory:" in ln]
    assert [ln.split("run directory: ", 1)[1].strip() for ln in lines] == [str(tmp_path / run)], res.stdout[-1500:]
