"""A real Hydra multirun: one parent sweep run, one nested child run per job, store in the start dir."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tracking_fakes import empty_store

ROOT = Path(__file__).resolve().parents[1]

APP = textwrap.dedent("""
    import os
    import hydra
    from omegaconf import OmegaConf

    import kareus.tracking  # registers the tracking schema
    from kareus.config.store import store_all
    from kareus.tracking import Tracker, hydra_context

    store_all()

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def main(cfg):
        if "boom" in cfg.passes:
            raise RuntimeError("this job fails")
        with Tracker(cfg.tracking) as tracker:
            tracker.start(OmegaConf.to_container(cfg, resolve=True), **hydra_context(), hardware="sim",
                          simulated="real" not in cfg.passes)
            listener = tracker.partition_listener_factory("fwd_attn")()
            from tracking_fakes import search_events
            for event in search_events("fwd_attn", n=4, batch=4, failed_at=None):
                listener(event)

    main()
""")

CONFIG = textwrap.dedent("""
    defaults:
      - tracking: default
      - _self_
    passes: [total]
    hydra:
      callbacks:
        mlflow_sweep:
          _target_: kareus.tracking.callback.MlflowSweepCallback
""")


def multirun(tmp_path, *overrides):
    """Run APP as a Hydra multirun in ``tmp_path``; (process, MLflow tracking URI)."""
    (tmp_path / "conf" / "tracking").mkdir(parents=True)
    (tmp_path / "conf" / "config.yaml").write_text(CONFIG)
    shutil.copy(ROOT / "kareus" / "conf" / "tracking" / "default.yaml", tmp_path / "conf" / "tracking" / "default.yaml")
    (tmp_path / "app.py").write_text(APP)
    uri = empty_store(tmp_path / "runs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("KAREUS_MLFLOW_PARENT_RUN_ID", None)
    proc = subprocess.run([sys.executable, "app.py", "-m", *overrides, "tracking.plots=false"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    return proc, uri


def test_multirun_nests_one_child_run_per_job_under_a_sweep_run(tmp_path):
    proc, uri = multirun(tmp_path, "passes=[total,dynamic],[total,dynamic,static]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((tmp_path / "multirun").rglob("mlflow.db")), "store must stay in the start directory"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("kareus")
    runs = client.search_runs([exp.experiment_id])
    by_kind: dict[str, list] = {}
    for run in runs:
        by_kind.setdefault(run.data.tags["kareus.kind"], []).append(run)
    assert len(by_kind["sweep"]) == 1 and len(by_kind["invocation"]) == 2 and len(by_kind["partition"]) == 2
    sweep = by_kind["sweep"][0]
    assert sweep.info.status == "FINISHED" and sweep.data.metrics["jobs"] == 2
    assert "passes=[total,dynamic],[total,dynamic,static]" in sweep.data.tags["overrides"]
    assert sweep.data.tags["simulated"] == "true"  # as every job's run: a chart of the sweep is simulated
    jobs = by_kind["invocation"]
    assert {r.data.tags["mlflow.parentRunId"] for r in jobs} == {sweep.info.run_id}
    assert sorted(r.data.tags["override.passes"] for r in jobs) == ["[total,dynamic,static]", "[total,dynamic]"]
    assert sorted(r.data.params["passes"] for r in jobs) == ['["total","dynamic","static"]', '["total","dynamic"]']
    assert {r.data.tags["mlflow.parentRunId"] for r in by_kind["partition"]} == {r.info.run_id for r in jobs}
    # a partition run tells its job apart, by name (chart legends) and by tags (filters)
    job_of = {r.info.run_id: r for r in jobs}
    for part in by_kind["partition"]:
        job = job_of[part.data.tags["mlflow.parentRunId"]]
        assert part.info.run_name.endswith(job.info.run_name) and part.info.run_name != job.info.run_name
        assert part.data.tags["override.passes"] == job.data.tags["override.passes"]
    assert len({p.info.run_name for p in by_kind["partition"]}) == 2
    # the sweep's counts carry the time they were logged (0 charts as 1970)
    history = client.get_metric_history(sweep.info.run_id, "jobs")
    assert [m.timestamp > 1_600_000_000_000 for m in history] == [True]
    sweep_files = list((tmp_path / "multirun").rglob("mlflow_parent_run_id"))
    assert [p.read_text().strip() for p in sweep_files] == [sweep.info.run_id]


def test_a_failing_job_leaves_the_sweep_run_failed_not_running(tmp_path):
    proc, uri = multirun(tmp_path, "passes=[total],[boom]")
    assert proc.returncode != 0 and "this job fails" in proc.stderr

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("kareus").experiment_id])
    sweeps = [r for r in runs if r.data.tags["kareus.kind"] == "sweep"]
    assert len(sweeps) == 1 and sweeps[0].info.status == "FAILED"
    assert all(r.info.status != "RUNNING" for r in runs)
    # the failing job raised before it opened an MLflow run: Hydra's jobs are counted, not child runs
    assert sweeps[0].data.metrics["jobs"] == 2 and sweeps[0].data.metrics["jobs_failed"] == 1


def test_a_sweep_is_tagged_simulated_as_its_jobs_agree():
    from types import SimpleNamespace

    from kareus.tracking.callback import sweep_simulated

    def job(**tags):
        return SimpleNamespace(data=SimpleNamespace(tags=tags))

    assert sweep_simulated([job(simulated="true"), job(simulated="true")]) == "true"
    assert sweep_simulated([job(simulated="false"), job()]) == "false"  # a job refused before it knew
    assert sweep_simulated([job(simulated="true"), job(simulated="false")]) == "mixed"  # hardware=sim,replay
    assert sweep_simulated([job()]) is None
