"""The table a sweep ends with: one row per job from its summary.json, printed and written beside the jobs."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kareus.pipeline.sweep import (
    SUMMARY_CSV, SUMMARY_JSON, SweepJob, common_overrides, job_row, report, summary_stamp, sweep_table, swept_keys,
)

ROOT = Path(__file__).resolve().parents[1]


def _summary(run_dir: Path, time_s: float = 0.9, energy_j: float = 80.0, **extra) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    selected = {"plan": "0a1b2c3d", "time_s": time_s, "energy_j": energy_j,
                "time_saving_pct": 100 * (1 - time_s / 1.0), "energy_saving_pct": 100 * (1 - energy_j / 100.0)}
    data = {"mode": "run", "simulated": True, "profiled": 48, "selected": selected, **extra}
    (run_dir / "summary.json").write_text(json.dumps(data))
    return run_dir


def test_the_swept_keys_are_those_that_vary_and_those_given_several_values():
    jobs = [["+model=tiny", "seed=0", "search.passes=[total]"],
            ["+model=tiny", "seed=0", "search.passes=[total,dynamic]"]]
    assert swept_keys(jobs) == ["search.passes"]
    assert swept_keys(jobs, ["-m", "+model=tiny", "seed=0,0", "search.passes=[total],[total,dynamic]"]) == [
        "seed", "search.passes"]
    assert common_overrides(jobs, ["search.passes"]) == ["+model=tiny", "seed=0"]
    assert swept_keys([["+model=tiny", "seed=3"]]) == ["+model", "seed"]  # one job: every key it sets


def test_a_row_holds_the_selected_plan_and_its_savings_against_megatron(tmp_path):
    job = SweepJob(0, ["seed=0"], _summary(tmp_path / "0"), error=None)
    row = job_row(job, ["seed"], json.loads((tmp_path / "0" / "summary.json").read_text()))
    assert row["choices"] == {"seed": "0"} and row["status"] == "ok" and row["plan"] == "0a1b2c3d"
    assert row["time_saving_pct"] == pytest.approx(10.0) and row["energy_saving_pct"] == pytest.approx(20.0)
    assert row["profiled"] == 48 and row["error"] is None


def test_a_failed_job_is_a_failed_row_and_an_older_summary_is_not_its(tmp_path):
    """A job of a sweep into a folder that held one must not report the earlier job's numbers."""
    old = _summary(tmp_path / "1")
    jobs = [SweepJob(0, ["seed=0"], _summary(tmp_path / "0"), error=None),
            SweepJob(1, ["seed=1"], old, before=summary_stamp(old), error="RuntimeError: this job fails"),
            SweepJob(2, ["seed=2"], tmp_path / "2", error="refused: plan: no plan meets")]
    from rich.console import Console

    console = Console(record=True, width=200)
    rows = report(jobs, tmp_path, console=console)
    assert [r["status"] for r in rows] == ["ok", "failed", "failed"]
    assert rows[1]["time_s"] is None and rows[1]["profiled"] is None  # the earlier job's summary is not its
    assert rows[1]["error"] == "RuntimeError: this job fails"
    text = console.export_text()
    assert "savings against Megatron, positive = faster / less energy" in text
    assert "+10.00%" in text and "+20.00%" in text and "failed: RuntimeError: this job fails" in text
    written = json.loads((tmp_path / SUMMARY_JSON).read_text())
    assert written["swept"] == ["seed"] and [j["status"] for j in written["jobs"]] == ["ok", "failed", "failed"]
    got = list(csv.DictReader((tmp_path / SUMMARY_CSV).open()))
    assert list(got[0]) == ["job", "seed", "status", "plan", "time_s", "energy_j", "time_saving_pct",
                            "energy_saving_pct", "profiled", "simulated", "run_dir", "error"]
    assert [g["status"] for g in got] == ["ok", "failed", "failed"] and got[2]["error"].startswith("refused: ")
    assert float(got[0]["energy_saving_pct"]) == pytest.approx(20.0) and got[1]["time_s"] == ""


def test_a_sweep_whose_jobs_left_no_summary_writes_nothing(tmp_path):
    """Every job refused: the table is printed, and the sweep folder is left for the CLI to remove."""
    from rich.console import Console

    console = Console(record=True, width=200)
    rows = report([SweepJob(0, ["seed=1"], tmp_path / "0", error="refused: resume: no journal")], tmp_path,
                  console=console)
    assert rows[0]["status"] == "failed" and "failed: refused: resume: no journal" in console.export_text()
    assert list(tmp_path.iterdir()) == []


def test_the_table_shows_the_swept_values_as_given_and_says_where_it_is_written(tmp_path):
    """A swept list such as ``[total]`` is no rich markup: it reached the table as an empty cell."""
    from rich.console import Console

    job = SweepJob(0, ["+model=tiny", "search.passes=[total]"], _summary(tmp_path / "0"), error=None)
    rows = [job_row(job, ["search.passes"], json.loads((tmp_path / "0" / "summary.json").read_text()))]
    console = Console(record=True, width=200)
    console.print(sweep_table(rows, ["search.passes"], ["+model=tiny", "search.space.sms=[4,8]"], tmp_path))
    text = console.export_text()
    assert "│ [total] " in text and "in every job: +model=tiny search.space.sms=[4,8]" in text
    assert str(tmp_path / SUMMARY_CSV) in text and "0a1b2c3d" in text


APP = textwrap.dedent("""
    import json, os
    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def main(cfg):
        if cfg.passes == "boom":
            raise RuntimeError("this job fails")
        out = HydraConfig.get().runtime.output_dir
        selected = {"plan": "feedbeef", "time_s": 0.9, "energy_j": 80.0, "time_saving_pct": 10.0,
                    "energy_saving_pct": 20.0}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({"mode": "run", "simulated": True, "profiled": 7, "selected": selected}, f)

    main()
""")

CONFIG = textwrap.dedent("""
    mode: run
    passes: total
    hydra:
      callbacks:
        sweep_summary:
          _target_: kareus.pipeline.sweep.SweepSummaryCallback
""")


def test_a_sweep_whose_job_raised_still_ends_with_its_table(tmp_path):
    """Hydra skips on_multirun_end when a job raised; the jobs that ran, and the one that raised, are
    still reported at exit."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(CONFIG)
    (tmp_path / "app.py").write_text(APP)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "app.py", "-m", "passes=total,boom,dynamic",
                           "hydra.sweep.dir=sweep"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0 and "this job fails" in proc.stderr
    data = json.loads((tmp_path / "sweep" / SUMMARY_JSON).read_text())
    assert [(j["choices"], j["status"]) for j in data["jobs"]] == [
        ({"passes": "total"}, "ok"), ({"passes": "boom"}, "failed"), ({"passes": "dynamic"}, "ok")]
    assert data["jobs"][1]["error"] == "RuntimeError: this job fails" and data["jobs"][2]["plan"] == "feedbeef"
    assert "Sweep: 3 jobs" in proc.stdout and "failed: RuntimeError: this job fails" in proc.stdout


@pytest.mark.slow  # two end-to-end runs of the tiny model
def test_a_kareus_sweep_ends_with_a_table_of_its_jobs(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(COLUMNS="200", NO_COLOR="1", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-m", "kareus", "-m", "+model=tiny", "parallel=pp1_tp2", "search=random",
                          "search.budget=8", "tracking.enabled=false", "progress=false", "plan.deadline_s=1e-06,1",
                          "hydra.sweep.dir=runs/sweep"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    sweep = tmp_path / "runs" / "sweep"
    data = json.loads((sweep / SUMMARY_JSON).read_text())
    assert data["swept"] == ["plan.deadline_s"] and "+model=tiny" in data["common"]
    refused, ok = data["jobs"]
    assert refused["status"] == "failed" and refused["error"].startswith("refused: plan: no plan meets")
    assert refused["profiled"] > 0 and refused["time_s"] is None  # it measured, then no plan met its deadline
    job = json.loads((sweep / "1" / "summary.json").read_text())["selected"]
    assert ok["status"] == "ok" and ok["profiled"] > 0
    assert {k: ok[k] for k in job if k in ok} == {k: job[k] for k in job if k in ok}  # the job's own numbers
    assert (sweep / "1" / "plans" / f"plan_{ok['plan']}.yaml").is_file()
    table = res.stdout[res.stdout.index("Sweep: 2 jobs"):]
    assert ok["plan"] in table and "failed: refused: plan:" in table
    rows = list(csv.DictReader((sweep / SUMMARY_CSV).open()))
    assert [(r["job"], r["plan.deadline_s"], r["status"]) for r in rows] == [("0", "1e-06", "failed"), ("1", "1", "ok")]
