"""The mission's exact command, end to end in a subprocess from a fresh working directory, and its
resume: everything the run promises is on disk, and a resumed run measures nothing twice."""
from __future__ import annotations

import csv
import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_cli_errors import MISSION, kareus

pytestmark = pytest.mark.slow


def _run_dir(cwd: Path) -> Path:
    dirs = sorted(p.parent for p in (cwd / "runs").glob("*/*/summary.json"))
    assert dirs, "no run directory with a summary"
    return dirs[-1]


def _journal_rows(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / "journal.sqlite") as con:
        table = con.execute("select name from sqlite_master where type='table' and name like '%measure%'").fetchone()
        return con.execute(f"select count(*) from {table[0]}").fetchone()[0]


@pytest.fixture(scope="module")
def mission_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("mission")
    res = kareus(cwd, *MISSION, "hydra.run.dir=runs/first/run", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return cwd, res


def test_mission_command_writes_frontiers_plans_and_record(mission_run):
    cwd, res = mission_run
    run = cwd / "runs" / "first" / "run"
    assert (run / "kareus.log").is_file()  # hydra.job.name=kareus, not the module's name
    summary = json.loads((run / "search_summary.json").read_text())
    assert set(summary) >= {"fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp"}
    for key, s in summary.items():
        assert 0 < s["profiled"] < s["space"], (key, s)  # a search, not an enumeration
        rows = list(csv.DictReader((run / "frontiers" / f"partition_{key}.csv").open()))
        assert rows and set(rows[0]) == {"slot", "sms", "freq_mhz", "time_s", "energy_j", "dynamic_energy_j"}
    rows = list(csv.DictReader((run / "frontier_iteration.csv").open()))
    assert rows[0]["plan"] == "megatron_reference"  # the reference rides along for comparison
    frontier = rows[1:]
    times = [float(r["time_s"]) for r in frontier]
    energies = [float(r["energy_j"]) for r in frontier]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)  # a Pareto frontier
    plans = sorted((run / "plans").glob("*.yaml"))
    assert len(plans) == len(frontier)
    selected = yaml.safe_load((run / "plan_selected.yaml").read_text())
    assert selected["predicted_time_s"] == pytest.approx(min(times))  # max_throughput by default
    out = json.loads((run / "summary.json").read_text())
    assert out["selected"]["time_s"] <= out["reference"]["time_s"]  # never slower than Megatron
    # Megatron + Perseus at equal time: every point of its frontier has a plan within its time
    perseus = list(csv.DictReader((run / "frontier_perseus.csv").open()))
    assert len(perseus) == out["perseus"]["baseline_points"] >= 2
    assert float(perseus[0]["time_s"]) <= out["reference"]["time_s"] * (1 + 1e-9)
    assert all(r["plan"] and float(r["plan_energy_j"]) <= float(r["energy_j"]) * (1 + 1e-9) for r in perseus)
    assert out["perseus"]["energy_saving_min_pct"] >= 0 and "Megatron + Perseus" in res.stdout
    with sqlite3.connect(cwd / "runs" / "mlflow.db") as con:
        logged = {k for (k,) in con.execute("select distinct key from metrics where key like 'perseus.%'")}
    assert {"perseus.energy_saving_at_reference_pct", "perseus.energy_saving_min_pct",
            "perseus.energy_saving_max_pct", "perseus.gpu_hours_simulated"} <= logged
    with sqlite3.connect(cwd / "runs" / "mlflow.db") as con:  # each summary value once, not twice at step 0
        counts = dict(con.execute("SELECT key, COUNT(*) FROM metrics WHERE key IN ('reference.iteration_time_s', "
                                  "'reference.iteration_energy_j', 'profiled_candidates') GROUP BY key").fetchall())
        run_dir = con.execute("SELECT value FROM tags WHERE key = 'run_dir'").fetchone()[0]
    assert counts == {"reference.iteration_time_s": 1, "reference.iteration_energy_j": 1, "profiled_candidates": 1}
    assert Path(run_dir) == run.resolve()  # the run, found from MLflow, to resume or read
    # one id names the selected plan in its file name, the CSV, summary.json, the terminal and MLflow
    sid, file = out["selected"]["plan"], out["selected"]["plan_file"]
    [row] = [r for r in frontier if r["plan"] == sid]
    assert file == row["plan_file"] == f"plans/plan_{sid}.yaml" and (run / file).read_text() == \
        (run / "plan_selected.yaml").read_text()
    assert f"selected plan {sid} (" in res.stdout and f"│ plan {sid} " in res.stdout
    # one sign: a saving is positive when better, the same number in summary.json, the CSV and MLflow
    with sqlite3.connect(cwd / "runs" / "mlflow.db") as con:
        metrics = dict(con.execute("SELECT key, value FROM metrics WHERE key LIKE 'plan.%saving_pct'").fetchall())
        tag = con.execute("SELECT value FROM tags WHERE key = 'plan.id'").fetchone()[0]
    assert tag == sid and out["selected"]["time_saving_pct"] > 0  # the fastest plan beats Megatron's time
    for what in ("time", "energy"):
        got = out["selected"][f"{what}_saving_pct"]
        assert float(row[f"{what}_saving_pct"]) == pytest.approx(got, abs=1e-4)
        assert metrics[f"plan.{what}_saving_pct"] == pytest.approx(got)
    assert "Megatron" in res.stdout and "simulated" in res.stdout
    assert (cwd / "runs" / "mlflow.db").is_file()


def test_profiling_costs_read_the_same_in_the_terminal_the_summary_and_mlflow(mission_run):
    cwd, res = mission_run
    out = json.loads((cwd / "runs" / "first" / "run" / "summary.json").read_text())
    assert out["simulated"] is True and out["hardware"] == "sim:A100-SXM4-40GB"
    with sqlite3.connect(cwd / "runs" / "mlflow.db") as con:
        m = dict(con.execute("SELECT m.key, m.value FROM metrics m JOIN tags t ON t.run_uuid = m.run_uuid "
                             "WHERE t.key = 'kareus.kind' AND t.value = 'invocation'").fetchall())
    search_h, fixed_h = out["profiling_gpu_seconds"] / 3600, out["fixed_work_gpu_seconds"] / 3600
    assert m["profiling_gpu_hours_simulated"] == pytest.approx(search_h)
    assert m["fixed_work_gpu_hours_simulated"] == pytest.approx(fixed_h)
    assert f"profiling cost: {search_h:.2f} simulated GPU-hours" in res.stdout
    assert f"fixed work (Megatron's reference, residual ops): {fixed_h:.2f} simulated GPU-hours" in res.stdout
    assert f"Megatron + Perseus' own profiles: {out['perseus']['gpu_hours_simulated']:.2f} simulated GPU-hours" \
        in res.stdout


def test_the_measurements_energy_and_the_plans_payback_read_the_same_everywhere(mission_run):
    cwd, res = mission_run
    out = json.loads((cwd / "runs" / "first" / "run" / "summary.json").read_text())
    cost, back = out["measurement_energy_j"], out["payback_iterations"]
    saving = out["reference"]["energy_j"] - out["selected"]["energy_j"]
    assert cost > 0 and back["megatron"] == math.ceil(cost / saving)  # the plan saves: it pays back
    assert back["perseus"] is None or back["perseus"] >= back["megatron"]  # M+P spends less than Megatron
    assert f"net: this run's measurements drew {cost / 3.6e6:.3g} kWh (simulated)" in res.stdout
    assert f"pays it back after {back['megatron']:,} iterations against Megatron" in res.stdout
    with sqlite3.connect(cwd / "runs" / "mlflow.db") as con:
        m = dict(con.execute("SELECT key, value FROM metrics WHERE key LIKE 'payback_iterations.%'").fetchall())
    assert m["payback_iterations.megatron"] == back["megatron"]


def test_resume_measures_nothing_twice(mission_run):
    cwd, _ = mission_run
    first = cwd / "runs" / "first" / "run"
    before = _journal_rows(first)
    res = kareus(cwd, *MISSION, f"resume={first}", "hydra.run.dir=runs/second/run", "tracking.enabled=false",
                 timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    second = cwd / "runs" / "second" / "run"
    assert _journal_rows(first) == before  # the old run is left as it was
    assert _journal_rows(second) == before  # its own copy, every candidate answered from it
    a = json.loads((first / "search_summary.json").read_text())
    b = json.loads((second / "search_summary.json").read_text())
    assert a == b
    # costs come from the journal: a resume reports what its measurements cost, not zero
    a, b = (json.loads((d / "summary.json").read_text()) for d in (first, second))
    assert b["profiling_gpu_seconds"] == pytest.approx(a["profiling_gpu_seconds"])
    assert b["fixed_work_gpu_seconds"] == pytest.approx(a["fixed_work_gpu_seconds"]) and a["fixed_work_gpu_seconds"] > 0
    assert b["perseus"]["gpu_hours_simulated"] == pytest.approx(a["perseus"]["gpu_hours_simulated"])
    assert a["perseus"]["gpu_hours_simulated"] > 0


def test_resume_under_another_config_is_refused(mission_run):
    cwd, _ = mission_run
    first = cwd / "runs" / "first" / "run"
    res = kareus(cwd, *MISSION, f"resume={first}", "search.budget_frac=0.2", "hydra.run.dir=runs/third/run",
                 "tracking.enabled=false", timeout=600)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: resume:"), res.stderr
    assert "Traceback" not in res.stderr
    assert not (cwd / "runs" / "third").exists()  # refused before the run folder held anything


def test_a_search_only_run_logs_what_it_profiled(tmp_path):
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "mode=search", "search.budget=8", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    with sqlite3.connect(tmp_path / "runs" / "mlflow.db") as con:
        metrics = dict(con.execute(
            "SELECT m.key, m.value FROM metrics m JOIN tags t ON t.run_uuid = m.run_uuid "
            "WHERE t.key = 'kareus.kind' AND t.value = 'invocation'").fetchall())
    assert metrics["profiled_candidates"] == 6 * 8 and metrics["profiling_gpu_hours_simulated"] > 0
    # its run directory is printed, as a full run's is: resume= and the frontiers need it
    assert res.stdout.strip().splitlines()[-1] == f"run directory: {_run_dir(tmp_path)}"
    # progress is logged to stderr, so stdout holds the results alone (a pipe reads only those)
    assert "partition fwd_attn: profiled 8/8" in res.stderr and "kareus.progress" not in res.stdout


def test_a_run_whose_plan_is_refused_records_why_and_what_it_profiled(tmp_path):
    """Its MLflow run said FAILED and nothing more: no reason, and none of the search's cost."""
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "plan.deadline_s=0.001", "progress=false", timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    with sqlite3.connect(tmp_path / "runs" / "mlflow.db") as con:
        [(run, status)] = con.execute("SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                                      "WHERE t.key = 'kareus.kind' AND t.value = 'invocation'").fetchall()
        tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run,)).fetchall())
        metrics = dict(con.execute("SELECT key, value FROM metrics WHERE run_uuid = ?", (run,)).fetchall())
    assert status == "FAILED" and tags["error"].startswith("plan: no plan meets plan.deadline_s=0.001 s")
    assert metrics["profiled_candidates"] > 0 and metrics["profiling_gpu_hours_simulated"] > 0


def test_perseus_comparison_is_optional_and_leaves_the_reference_as_it_was(tmp_path):
    """plan.compare_perseus=false measures Megatron's layout at the top clock alone; with it (the
    default) the other clocks are measured after the reference, which reads the same either way."""
    tiny = ("+model=tiny", "parallel=pp1_tp2", "progress=false", "tracking.enabled=false")
    runs = {}
    for flag in ("true", "false"):
        res = kareus(tmp_path, *tiny, f"plan.compare_perseus={flag}", f"hydra.run.dir=runs/{flag}", timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
        runs[flag] = (tmp_path / "runs" / flag, res.stdout)
    on, off = (json.loads((runs[f][0] / "summary.json").read_text()) for f in ("true", "false"))
    assert on["reference"] == off["reference"]
    assert "perseus" not in off and not (runs["false"][0] / "frontier_perseus.csv").exists()
    assert "Megatron + Perseus" not in runs["false"][1] and "Megatron + Perseus" in runs["true"][1]
    assert on["perseus"]["energy_saving_at_reference_pct"] >= 0 and on["perseus"]["gpu_hours_simulated"] > 0
    assert _journal_rows(runs["true"][0]) > _journal_rows(runs["false"][0])
    # run again in the first folder without the comparison: its CSV named plans this run does not write
    res = kareus(tmp_path, *tiny, "plan.compare_perseus=false", "hydra.run.dir=runs/true", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (runs["true"][0] / "frontier_perseus.csv").exists()


def test_a_one_clock_runs_perseus_line_names_its_one_point(tmp_path):
    """It read '+2.4% to +2.4% over its 1 points'."""
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "progress=false", "tracking.enabled=false",
                 "+experiment=no_clock_search", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    [line] = [ln for ln in res.stdout.splitlines() if ln.startswith("against Megatron + Perseus at equal time")]
    assert " at its one point (" in line and "over its" not in line, line
    assert "is Megatron's reference alone" in res.stdout


def test_runs_started_together_get_their_own_run_directories(tmp_path):
    """Two runs launched in the same second (a script starting several configs) must not share a
    run directory: each keeps its own journal and outputs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    args = [sys.executable, "-m", "kareus", "+model=tiny", "parallel=pp2_tp2", "mode=search", "search=random",
            "search.budget=4", "tracking.enabled=false", "progress=false"]
    procs = [subprocess.Popen([*args, f"seed={i}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    dirs = sorted(p.parent for p in (tmp_path / "runs").glob("*/*/journal.sqlite"))
    assert len(dirs) == 2, dirs
    seeds = {yaml.safe_load((d / ".hydra" / "config.yaml").read_text())["seed"] for d in dirs}
    assert seeds == {0, 1}


def test_a_replayed_tables_search_is_not_recorded_under_a_parallel_layout(tmp_path):
    """Its partitions are the table's own; the default ``parallel`` plays no part and must not label it."""
    table = tmp_path / "t.csv"
    table.write_text("partition,slot,sms,freq_mhz,time_s,energy_j,repeat\n"
                     "p,sequential,4,1410,0.004,1.0,0\np,norm_0,4,1410,0.003,0.9,0\np,norm_0,8,1200,0.0031,0.8,0\n")
    res = kareus(tmp_path, "mode=search", "hardware=replay", f"hardware.table={table}", "search=exhaustive",
                 "progress=false", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    with sqlite3.connect(tmp_path / "runs" / "mlflow.db") as con:
        (run_id, name), = con.execute("SELECT r.run_uuid, r.name FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                                      "WHERE t.key = 'kareus.kind' AND t.value = 'invocation'").fetchall()
        tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)).fetchall())
    assert "pp2_tp8" not in name and "choice.parallel" not in tags and tags["choice.search"] == "exhaustive"


@pytest.mark.parametrize("mode", ["search", "run"])
def test_a_search_where_every_profile_fails_is_refused_naming_why(tmp_path, mode):
    """A hardware description no candidate survives (a link of 1e-300 GB/s overflows every time) ended a
    search-only run with exit 0 and empty frontiers, and a full run with a composer error naming no cause."""
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", f"mode={mode}", "search.budget=4",
                 "hardware.nvlink_gbps=1e-300", "progress=false", timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: search: every profile failed in fwd_attn (4 profiles), ")
    assert "first reason: crash: OverflowError" in line
    run_dir = _run_dir(tmp_path)
    assert f"are in {run_dir / 'journal.sqlite'})" in line
    assert _journal_rows(run_dir) > 0  # what it measured, the failures' reasons too, is kept
    searched = json.loads((run_dir / "search_summary.json").read_text())
    assert all(s["failed"] == s["profiled"] == 4 for s in searched.values())
    with sqlite3.connect(tmp_path / "runs" / "mlflow.db") as con:
        [(status,)] = con.execute("SELECT r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                                  "WHERE t.key = 'kareus.kind' AND t.value = 'invocation'").fetchall()
    assert status == "FAILED"
