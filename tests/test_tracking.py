"""Tracking into a real MLflow store in a temporary folder, read back through MlflowClient."""
from __future__ import annotations

import base64
import csv
import dataclasses
import os
import io
import json
import multiprocessing as mp
import pickle
import sqlite3
from pathlib import Path

import pytest
import yaml

from kareus.errors import OutputClosed
from kareus.frontier import Frontier
from kareus.tracking import PartitionListenerFactory, Tracker, TrackingConfig, summary_metrics
from kareus.tracking.records import config_params, override_tags
from kareus.tracking.store import connect, resolve_uri
from tracking_fakes import empty_store, search_events

RESOLVED = {"model": {"name": "qwen1.7b", "num_layers": 28},
            "search": {"name": "mbo", "budget": 40, "passes": ["total", "dynamic"], "space": {"sms": None}},
            "notes": "x" * 7000}
CHOICES = {"model": "qwen1.7b", "parallel": "pp2_tp8", "search": "mbo", "hydra/launcher": "basic"}
OVERRIDES = ["+model=qwen1.7b", "search.passes=[total,dynamic]"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module; the default relative URI resolved against a temp 'working dir'."""
    base = tmp_path_factory.mktemp("work")
    empty_store(base / "runs")  # the relative default URI finds this one
    return base


@pytest.fixture(scope="module")
def client(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=resolve_uri("sqlite:///runs/mlflow.db", store))


def _text(client, run_id: str, path: str) -> str:
    return Path(client.download_artifacts(run_id, path)).read_text()


def _artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for info in client.list_artifacts(run_id, path):
        out |= _artifacts(client, run_id, info.path) if info.is_dir else {info.path}
    return out


def test_invocation_run_records_config_choices_overrides_and_closes(store, client):
    tracker = Tracker(TrackingConfig(), base=store)
    with tracker:
        run_id = tracker.start(RESOLVED, CHOICES, OVERRIDES, hardware="sim:a100")
    assert (store / "runs" / "mlflow.db").is_file()  # relative default lands under the start dir
    run = client.get_run(run_id)
    tags = run.data.tags
    assert tags["choice.model"] == "qwen1.7b" and tags["choice.parallel"] == "pp2_tp8"
    assert "choice.hydra/launcher" not in tags
    assert tags["override.model"] == "qwen1.7b" and tags["override.search.passes"] == "[total,dynamic]"
    assert tags["overrides"] == " ".join(OVERRIDES)
    assert tags["hardware"] == "sim:a100" and tags["kareus.kind"] == "invocation"
    assert run.info.run_name == "qwen1.7b pp2_tp8 mbo search.passes=[total,dynamic]"
    params = run.data.params
    assert params["model.num_layers"] == "28" and params["search.passes"] == '["total","dynamic"]'
    assert params["search.space.sms"] == "null"
    assert len(params["notes"]) == 6000  # truncated to MLflow's limit, not rejected
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((store / "runs" / "mlartifacts").as_uri())
    assert yaml.safe_load(_text(client, run_id, "config.yaml")) == RESOLVED


def test_partition_listener_logs_candidates_batches_frontier_and_plots(store, client):
    tracker = Tracker(TrackingConfig(), base=store)
    tracker.start(RESOLVED, CHOICES, [], hardware="sim:a100", simulated=True)
    factory = tracker.partition_listener_factory("fwd_attn", ("sequential", "norm_0", "attn_0"))
    assert factory.note == "hardware: sim:a100 (simulated)"
    listener = pickle.loads(pickle.dumps(factory))()  # as a worker process would get it
    events = search_events("fwd_attn", n=12, batch=4, failed_at=5)
    for event in events + search_events("bwd_mlp", n=4, batch=4):  # other partitions are ignored
        listener(event)
    tracker.end()
    assert listener.errors == 0 and listener.finished
    child = client.get_run(listener.run_id)
    assert child.data.tags["mlflow.parentRunId"] == tracker_run_parent(client, listener.run_id)
    assert child.data.tags["partition"] == "fwd_attn" and child.info.status == "FINISHED"
    assert child.data.tags["simulated"] == "true"  # each partition run says so too, not only its parent
    assert client.get_run(child.data.tags["mlflow.parentRunId"]).data.tags["simulated"] == "true"
    assert child.data.params["budget"] == "12" and child.data.params["slot_labels"] == "sequential,norm_0,attn_0"
    gpu = {k for k in child.data.metrics if "gpu" in k}
    assert gpu == {"gpu_hours_simulated"}  # named as the invocation's: no unsuffixed seconds beside it
    spent = client.get_metric_history(listener.run_id, "gpu_hours_simulated")  # per candidate, then the total
    assert [m.step for m in sorted(spent, key=lambda m: m.step)] == [*range(12), 12]

    times = client.get_metric_history(listener.run_id, "time_s")
    assert sorted(m.step for m in times) == [i for i in range(12) if i != 5]  # failed one has no time
    measured = {e.index: e.measurement for e in events if type(e).__name__ == "CandidateMeasured"}
    assert all(m.value == pytest.approx(measured[m.step].time_s) for m in times)
    clocks = {m.step: m.value for m in client.get_metric_history(listener.run_id, "knob.freq_mhz")}
    assert clocks == {i: measured[i].candidate.freq_mhz for i in range(12)}
    slot_idx = {m.step: m.value for m in client.get_metric_history(listener.run_id, "knob.slot_index")}
    assert slot_idx[1] == 1 and slot_idx[2] == 2  # norm_0, attn_0 in the given label order
    predicted = client.get_metric_history(listener.run_id, "predicted_time_s")
    assert sorted(m.step for m in predicted) == [i for i in range(4, 12) if i != 5]  # no numbers for failed
    hv = client.get_metric_history(listener.run_id, "hypervolume")
    assert sorted(m.step for m in hv) == [4, 8, 12]
    assert [m.value for m in sorted(hv, key=lambda m: m.step)] == sorted(m.value for m in hv)  # never falls
    # the ratio: the same values as a share of the rectangle (0 s, 0 J)-reference, one reference from the
    # first batch to the end, so the live curve's last point is the search's final value (no jump)
    ratio = sorted(client.get_metric_history(listener.run_id, "hypervolume_ratio"), key=lambda m: m.step)
    assert [m.step for m in ratio] == [4, 8, 12]
    assert all(0 < m.value < 1 for m in ratio) and [m.value for m in ratio] == sorted(m.value for m in ratio)
    final = client.get_run(listener.run_id).data.metrics
    assert ratio[-1].value == pytest.approx(final["hypervolume_ratio_final"])
    ref = (final["hypervolume_reference_time_s"], final["hypervolume_reference_energy_j"])
    assert ref == pytest.approx(events[-1].reference)
    assert final["hypervolume_ratio_final"] == pytest.approx(final["hypervolume_final"] / (ref[0] * ref[1]))
    assert "hypervolume_at_final_reference" not in final  # one reference: nothing to recompute

    files = _artifacts(client, listener.run_id)
    assert {"candidates.csv", "candidates.json", "frontier.csv", "frontier.json", "plots/frontier.png",
            "plots/hypervolume.png"} <= files
    rows = list(csv.DictReader(io.StringIO(_text(client, listener.run_id, "candidates.csv"))))
    assert len(rows) == 12 and rows[5]["failed"] == "True"
    assert {r["pass"] for r in rows} == {"initial", "total", "dynamic"}
    frontier = events[-1].frontier
    assert sum(r["on_frontier"] == "True" for r in rows) == len(frontier)
    frows = list(csv.DictReader(io.StringIO(_text(client, listener.run_id, "frontier.csv"))))
    assert [float(r["time_s"]) for r in frows] == pytest.approx(list(frontier.times))
    assert {"slot", "sms", "freq_mhz"} <= frows[0].keys()
    table = json.loads(_text(client, listener.run_id, "frontier.json"))
    assert len(table["data"]) == len(frontier)
    png = Path(client.download_artifacts(listener.run_id, "plots/frontier.png")).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def tracker_run_parent(client, child_id: str) -> str:
    """The parent run must exist and be an invocation run."""
    parent = client.get_run(client.get_run(child_id).data.tags["mlflow.parentRunId"])
    assert parent.data.tags["kareus.kind"] == "invocation"
    return parent.info.run_id


def test_frontiers_plan_and_summary(store, client, tmp_path):
    tracker = Tracker(TrackingConfig(), base=store)
    tracker.start(RESOLVED, CHOICES, OVERRIDES, hardware="sim:a100")
    it = Frontier.from_arrays([1.0, 1.1, 1.3], [1000.0, 900.0, 850.0], payloads=[{"plan": i} for i in range(3)])
    tracker.log_microbatch_frontiers({"stage0.fwd": it, "stage0.bwd": it}, references={"stage0.fwd": (1.02, 1050.0)})
    perseus = Frontier.from_arrays([1.02, 1.5], [1000.0, 950.0])
    tracker.log_iteration_frontier(it, reference=(1.02, 1050.0), selected=(1.1, 900.0), baseline=perseus)
    plan = tmp_path / "plan.yaml"
    plan.write_text("stages: []\n")
    tracker.log_plan(plan)
    tracker.log_summary(summary_metrics(1.1, 900.0, 1.02, 1050.0, profiled=40, profiling_gpu_seconds=7200.0),
                        tags={"selection": "min_energy"})
    run_id = tracker.run_id
    tracker.end()
    run = client.get_run(run_id)
    m = run.data.metrics
    # savings named as in summary.json, positive = better: 1.1 s is slower than 1.02 s, 900 J is less than 1050 J
    assert m["plan.energy_saving_pct"] == pytest.approx(100 * (1 - 900 / 1050)) and m["plan.energy_saving_pct"] > 0
    assert m["plan.time_saving_pct"] == pytest.approx(100 * (1 - 1.1 / 1.02)) and m["plan.time_saving_pct"] < 0
    assert not any(k.startswith("savings.") for k in m)
    assert m["profiling_gpu_hours_simulated"] == pytest.approx(2.0) and m["profiled_candidates"] == 40
    assert m["iteration.frontier_points"] == 3 and m["iteration.hypervolume"] > 0
    # the share of the rectangle (0 s, 0 J)-Megatron that the frontier dominates
    assert 0 < m["iteration.hypervolume_ratio"] < 1
    assert m["iteration.hypervolume_ratio"] == pytest.approx(m["iteration.hypervolume"] / (1.02 * 1050.0))
    assert run.data.tags["selection"] == "min_energy"
    files = _artifacts(client, run_id)
    assert {"plan/plan.yaml", "plots/iteration_frontier.png", "plots/microbatch_frontiers.png",
            "frontiers/iteration.csv", "frontiers/iteration.json", "frontiers/microbatch/stage0.fwd.csv",
            "frontiers/microbatch/stage0.bwd.csv", "frontiers/perseus.csv", "frontiers/perseus.json"} <= files
    rows = list(csv.DictReader(io.StringIO(_text(client, run_id, "frontiers/iteration.csv"))))
    assert [r["plan"] for r in rows] == ["0", "1", "2"]


def test_the_frontier_plot_states_the_savings_the_metrics_hold():
    """One sign everywhere: the plot read 'energy -19.3%' where the terminal said a +19.30% saving."""
    from kareus.tracking import plots

    it = Frontier.from_arrays([1.0, 1.1], [1000.0, 900.0])
    fig = plots.iteration_frontier_figure(it, reference=(1.02, 1050.0), selected=(1.1, 900.0))
    m = summary_metrics(1.1, 900.0, 1.02, 1050.0)
    [note] = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_text().startswith("saving vs")]
    assert f"time {m['plan.time_saving_pct']:+.1f}%" in note and m["plan.time_saving_pct"] < 0  # slower
    assert f"energy {m['plan.energy_saving_pct']:+.1f}%" in note and m["plan.energy_saving_pct"] > 0  # less energy


def test_end_closes_partition_runs_left_open(store, client):
    tracker = Tracker(TrackingConfig(run_name="mine"), base=store)
    tracker.start(RESOLVED, CHOICES, [], run_name="derived")  # the user's tracking.run_name wins
    assert client.get_run(tracker.run_id).info.run_name == "mine"
    listener = tracker.partition_listener_factory("fwd_mlp")()
    for event in search_events("fwd_mlp", n=6, batch=4)[:4]:  # the search dies before SearchFinished
        listener(event)
    tracker.end("FAILED")
    assert client.get_run(listener.run_id).info.status == "FAILED"


def test_disabled_tracker_does_nothing(tmp_path):
    tracker = Tracker({"enabled": False}, base=tmp_path)
    assert tracker.start(RESOLVED, CHOICES, OVERRIDES) is None
    factory = tracker.partition_listener_factory("fwd_attn")
    listener = pickle.loads(pickle.dumps(factory))()
    for event in search_events("fwd_attn", n=4, batch=4):
        listener(event)
    tracker.log_summary({"x": 1.0})
    tracker.end()
    assert not (tmp_path / "runs").exists()


def test_params_and_tags_respect_mlflow_limits():
    params = config_params({"a" * 300: 1, "b": {"c@d": [1, 2]}})
    assert all(len(k) <= 250 for k in params) and params["b.c_d"] == "[1,2]"
    tags = override_tags(["~x.y", "++z@pkg=3", "hydra.job.chdir=true"])
    assert tags["override.z_pkg"] == "3" and "override.x.y" not in tags


# ---- several processes writing to one fresh SQLite store at once ----------------------------

def _worker(uri: str, partition: str, n: int) -> str:
    artifacts = str(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts")  # beside the store, not ./mlruns
    client, exp_id, abs_uri = connect(uri, "concurrent", artifacts)
    listener = PartitionListenerFactory(partition, abs_uri, exp_id, plots=False, flush_interval_s=0.0)()
    for event in search_events(partition, n=n, batch=5, failed_at=None):
        listener(event)
    assert listener.errors == 0, listener.errors
    return listener.run_id


_FORKED_POOL = """
import multiprocessing as mp, sys
from kareus.tracking import store
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

def pool_id(uri):
    return id(SqlAlchemyStore._engine_map[uri].pool)

if __name__ == "__main__":
    uri = sys.argv[1]
    store.client_for(uri)
    with mp.get_context("fork").Pool(1) as pool:
        child = pool.apply(pool_id, (uri,))
    sys.exit(0 if child != pool_id(uri) else 3)
"""


def test_forked_worker_gets_its_own_connection_pool(tmp_path):
    """Forked from an interpreter of its own: forking the test process, whose earlier tests may have
    left threads holding locks, once stalled the child."""
    import subprocess
    import sys

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    uri = empty_store(tmp_path)
    script = tmp_path / "forked_pool.py"
    script.write_text(_FORKED_POOL)
    done = subprocess.run([sys.executable, str(script), uri], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_concurrent_writers_share_one_sqlite_store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/fresh/mlflow.db"  # not yet created: initialisation races too
    parts = [f"p{i}" for i in range(3)]
    # spawn: a fork of the test process, whose earlier tests leave threads holding locks, once hung
    # forever in a child; a deadline turns any hang into a failure
    with mp.get_context("spawn").Pool(3) as pool:
        run_ids = pool.starmap_async(_worker, [(uri, p, 12) for p in parts]).get(timeout=300)

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("concurrent")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(run_ids)
    for run_id in run_ids:
        assert [m.step for m in sorted(client.get_metric_history(run_id, "energy_j"), key=lambda m: m.step)] \
            == list(range(12))
        assert client.get_run(run_id).info.status == "FINISHED"
    # more writers into the store that now exists (that a forked worker gets a pool of its own, not the
    # parent's: test_forked_worker_gets_its_own_connection_pool, forked from an interpreter of its own)
    with mp.get_context("spawn").Pool(2) as pool:
        more = pool.starmap_async(_worker, [(uri, p, 6) for p in ("q0", "q1")]).get(timeout=300)
    assert len(client.search_runs([exp.experiment_id])) == 5
    for run_id in more:
        assert len(client.get_metric_history(run_id, "time_s")) == 6
    with sqlite3.connect(tmp_path / "fresh" / "mlflow.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_uris_resolve_against_the_start_directory(tmp_path, monkeypatch):
    from kareus.tracking.store import import_mlflow, resolve_artifact_location

    assert resolve_uri("sqlite:///runs/m.db", tmp_path) == f"sqlite:///{tmp_path}/runs/m.db"
    assert (tmp_path / "runs").is_dir()
    assert resolve_uri("sqlite:////abs/x.db?timeout=5", tmp_path).endswith("/abs/x.db?timeout=5")
    assert resolve_uri("http://host:5000", tmp_path) == "http://host:5000"
    assert resolve_artifact_location("runs/art", "sqlite:///x.db", tmp_path) == (tmp_path / "runs" / "art").as_uri()
    assert resolve_artifact_location("runs/art", "http://host:5000", tmp_path) is None  # the server decides
    assert resolve_artifact_location("s3://bucket/k", "http://host:5000", tmp_path) == "s3://bucket/k"
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    import_mlflow(telemetry=True)
    assert "MLFLOW_DISABLE_TELEMETRY" not in os.environ
    import_mlflow()
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"


def test_frontier_rows_spell_out_payload_knobs():
    from dataclasses import dataclass

    from kareus.tracking.records import frontier_rows
    from kareus.types import Candidate

    @dataclass(frozen=True)
    class Option:
        time_s: float
        energy_j: float
        choices: dict

    c = Candidate("fwd_attn", "attn_0", 8, 1290)
    rows = frontier_rows(Frontier.from_arrays([1.0], [2.0], [Option(1.0, 3.0, {"fwd_attn": c})], objective="dynamic"))
    assert rows == [{"rank": 0, "time_s": 1.0, "energy_j": 2.0, "objective": "dynamic", "payload_energy_j": 3.0,
                     "choices.fwd_attn.partition": "fwd_attn", "choices.fwd_attn.slot": "attn_0",
                     "choices.fwd_attn.sms": 8, "choices.fwd_attn.freq_mhz": 1290}]


def test_run_records_the_commit_of_the_installed_checkout_not_of_the_working_folder(store, client):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("kareus is not installed from a git checkout here")
    assert subprocess.run(["git", "-C", str(store), "rev-parse", "HEAD"], capture_output=True).returncode != 0
    tracker = Tracker(TrackingConfig(), base=store)  # the working folder: not a checkout
    with tracker:
        run_id = tracker.start(RESOLVED, CHOICES, [])
    tags = client.get_run(run_id).data.tags
    assert tags["git.commit"] == head.stdout.strip() and tags["git.dirty"] in ("true", "false")


@pytest.mark.parametrize("stop", [SystemExit(143), OutputClosed()], ids=["sigterm", "reader_left"])
def test_an_exit_while_recording_closes_the_run_as_killed(store, client, stop):
    """The CLI turns SIGTERM into SystemExit(143); a reader that left (``| head``) stops the run as a
    shell tool does (exit 141, 'continue with resume='): neither is a failure, and FAILED said it was."""
    tracker = Tracker(TrackingConfig(), base=store)
    with pytest.raises(type(stop)):
        with tracker:
            run_id = tracker.start(RESOLVED, CHOICES, [])
            tracker.partition_listener_factory("fwd_attn")()(search_events("fwd_attn")[0])
            raise stop
    runs = client.search_runs([client.get_run(run_id).info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'")
    assert client.get_run(run_id).info.status == "KILLED"
    assert runs and {r.info.status for r in runs} == {"KILLED"}


def test_a_partition_whose_every_candidate_failed_records_its_empty_frontier(store, client):
    """The run directory writes a header-only frontiers/partition_<key>.csv; MLflow left it out."""
    from kareus.events import CandidateMeasured, SearchFinished
    from kareus.types import Measurement

    tracker = Tracker(TrackingConfig(), base=store)
    tracker.start(RESOLVED, CHOICES, [])
    listener = tracker.partition_listener_factory("fwd_attn")()
    started, *measured = [e for e in search_events("fwd_attn", n=3, batch=4, failed_at=None)
                          if type(e).__name__ in ("SearchStarted", "CandidateMeasured")]
    listener(started)
    for e in measured:
        listener(CandidateMeasured("fwd_attn", e.index, Measurement.failure(e.measurement.candidate, "timeout")))
    listener(SearchFinished("fwd_attn", Frontier([]), 3, 3, 0.75, 0.0))
    tracker.end()
    assert listener.errors == 0
    assert _text(client, listener.run_id, "frontier.csv").splitlines() == ["rank,time_s,energy_j,objective"]
    assert json.loads(_text(client, listener.run_id, "frontier.json"))["data"] == []


@pytest.mark.parametrize("raised, status", [(RuntimeError("backend crashed"), "FAILED"), (SystemExit(143), "KILLED")],
                         ids=["error", "signal"])
def test_a_partition_search_that_raises_ends_failed_and_one_stopped_by_a_signal_killed(store, client, monkeypatch,
                                                                                         raised, status):
    """Every error left the partition's run KILLED, which the README keeps for Ctrl-C and SIGTERM: a
    filter on FAILED missed the search that failed."""
    import kareus.launch.task as task_mod

    def crash(task, backend, bus, journal=None):
        bus.emit(search_events("fwd_attn")[0])
        raise raised

    monkeypatch.setattr(task_mod, "_search", crash)
    tracker = Tracker(TrackingConfig(), base=store)
    with pytest.raises(type(raised)):
        with tracker:
            run_id = tracker.start(RESOLVED, CHOICES, [])

            class Task:  # what run_search_task reads before the search
                hardware, seed = {"name": "sim"}, 0
                listener_factories = [tracker.partition_listener_factory("fwd_attn")]

            task_mod.run_search_task(Task())
    [part] = client.search_runs([client.get_run(run_id).info.experiment_id],
                                filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'")
    assert part.info.status == status


@pytest.mark.parametrize("uri", ["sqlite://", "sqlite:///", "sqlite:///:memory:"])
def test_an_in_memory_store_is_refused(uri):
    """MLflow keeps such a store in memory: the run ended with exit 0 and its whole record gone."""
    assert TrackingConfig(uri=uri).problems() == [
        f"tracking.uri: {uri!r} is an in-memory database, gone when the run ends; give a file such as "
        "sqlite:///runs/mlflow.db, or set tracking.enabled=false"]


def test_a_database_store_that_cannot_be_opened_is_named_at_once():
    """postgresql:// and mysql:// passed validation and failed at the first write with a 70-line
    traceback: a missing driver, or a server that is not there."""
    from kareus.tracking.store import reachability_problem

    for uri in ("postgresql://localhost:1/x", "mysql://u:secret@localhost:1/x"):
        problem = reachability_problem(uri, timeout_s=2.0)
        shown = uri.replace(":secret@", ":***@")
        assert problem.startswith((f"cannot open {shown}: its database driver is not installed",
                                   f"cannot reach {shown} (")), problem
        assert "\n" not in problem and "secret" not in problem


def test_a_stop_while_the_store_is_created_lands_once_it_exists(tmp_path, monkeypatch):
    """A Ctrl-C or SIGTERM amid MLflow's schema migrations left a store no later run could open."""
    import signal

    import mlflow.tracking

    from kareus.tracking.store import client_for

    steps: list[str] = []

    class Creating:
        def __init__(self, tracking_uri: str) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives while the store is being made
            steps.append("created")

        def search_experiments(self, **kwargs):
            steps.append("migrated")
            return []

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", Creating)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stopped):
            client_for(f"sqlite:///{tmp_path}/stopped.db")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert steps == ["created", "migrated"]


def test_empty_uri_is_refused_and_a_dead_server_is_named_at_once():
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from kareus.tracking.store import reachability_problem

    assert TrackingConfig(uri="").problems()[0].startswith("tracking.uri: empty")
    assert TrackingConfig(uri="", enabled=False).problems() == []
    assert TrackingConfig().problems() == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket closes
    assert "cannot reach http://127.0.0.1:" in reachability_problem(f"http://127.0.0.1:{closed}", timeout_s=2.0)
    assert reachability_problem("http://localhost:99999") == (  # not a traceback from the port's parser
        "cannot reach http://localhost:99999 (Port out of range 0-65535); start the tracking server, or set "
        "tracking.enabled=false")

    class LoginFirst(BaseHTTPRequestHandler):
        """An MLflow server behind basic auth: /health answers 200 to alice, 401 to anyone else; under
        /api-only a proxy forwards the REST API alone (401 there); every other path is not found, as on
        a server that is no MLflow."""

        def do_GET(self) -> None:
            if self.path.startswith("/api-only/api/"):
                self.send_error(401)
            elif self.path != "/health":
                self.send_error(404)
            elif self.headers.get("Authorization") == "Basic " + base64.b64encode(b"alice:s3cret").decode():
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"OK")
            else:
                self.send_error(401)

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), LoginFirst)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert reachability_problem(f"http://127.0.0.1:{port}", timeout_s=5.0) is None  # a login: a server is there
        # MLflow's client sends a URI's user and password as basic auth; urllib took them for the host name
        assert reachability_problem(f"http://alice:s3cret@127.0.0.1:{port}", timeout_s=5.0) is None
        # a wrong port or path: anything but an MLflow server failed mid-run with the page as a traceback
        assert reachability_problem(f"http://alice:s3cret@127.0.0.1:{port}/mlflow", timeout_s=5.0) == (
            f"http://alice:***@127.0.0.1:{port}/mlflow answers, but not as an MLflow tracking server (GET "
            f"/mlflow/health: 404 Not Found; GET /mlflow/api/2.0/mlflow/experiments/search?max_results=1: 404 Not "
            f"Found); check the host, port and path, or set tracking.enabled=false")
        # a proxy that forwards MLflow's REST API alone: /health is not found, the API answers
        assert reachability_problem(f"http://127.0.0.1:{port}/api-only", timeout_s=5.0) is None
    finally:
        server.shutdown()
    assert reachability_problem("sqlite:///runs/mlflow.db") is None


@pytest.mark.parametrize("uri", ["sqlite:runs/x.db", "sqlite://rel.db"])
def test_a_sqlite_uri_in_sqlalchemys_other_forms_is_refused(uri):
    """MLflow failed mid-run with "Could not parse SQLAlchemy URL" or "Invalid SQLite URL"."""
    assert TrackingConfig(uri=uri).problems() == [
        f"tracking.uri: a SQLite store is sqlite:///RELATIVE/PATH.db or sqlite:////ABSOLUTE/PATH.db, got {uri!r}"]


def test_a_sqlite_store_on_a_folder_or_a_file_of_another_kind_is_named_at_once(tmp_path):
    """A folder (``sqlite:///runs``) made MLflow retry for 107 s; a text file failed mid-run."""
    from kareus.tracking.store import reachability_problem

    (tmp_path / "notes.txt").write_text("not a database")
    (tmp_path / "empty.db").touch()  # SQLite makes its store in an empty file
    fix = "; choose another tracking.uri, or set tracking.enabled=false"
    assert reachability_problem(f"sqlite:///{tmp_path}") == f"{tmp_path} is a folder, not a database file{fix}"
    assert reachability_problem(f"sqlite:///{tmp_path}/notes.txt") == f"{tmp_path}/notes.txt is not an SQLite database{fix}"
    assert reachability_problem(f"sqlite:///{tmp_path}/empty.db") is None


def test_credentials_in_a_store_uri_never_reach_the_records():
    """Every user of a shared store reads its params, tags and config.yaml."""
    from kareus.tracking.records import config_params, override_tags, redacted

    uri = "postgresql://alice:s3cret@db:5432/mlflow"
    assert redacted(uri) == "postgresql://alice:***@db:5432/mlflow"
    # as SQLAlchemy and urllib read them, a password may hold '/', a space or '@'
    assert [redacted(u) for u in ("postgresql://alice:pa/ss@db/m", "mysql://bob:x y@db/m", "http://u:p@ss@host:1")] == [
        "postgresql://alice:***@db/m", "mysql://bob:***@db/m", "http://u:***@host:1"]
    assert [redacted(u) for u in ("http://db:5432/mlflow", "https://bob@host/x")] == ["http://db:5432/mlflow",
                                                                                   "https://bob@host/x"]
    assert config_params({"tracking": {"uri": uri}}) == {"tracking.uri": "postgresql://alice:***@db:5432/mlflow"}
    tags = override_tags([f"tracking.uri={uri}", "seed=1"])
    assert "s3cret" not in str(tags) and tags["override.tracking.uri"] == "postgresql://alice:***@db:5432/mlflow"


def test_a_signal_during_an_mlflow_write_lands_after_it():
    """SIGTERM/SIGINT raise in their handlers; inside a write they could leave a SQLite transaction
    open that the exit path's own writes then wait on. retry() defers them to the end of the call."""
    import os
    import signal

    from kareus.tracking.store import retry

    order: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: order.append("handler"))
    try:
        def write() -> str:
            os.kill(os.getpid(), signal.SIGTERM)
            order.append("write done")
            return "ok"

        assert retry(write) == "ok"
        order.append("after")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert order == ["write done", "handler", "after"]


def test_a_held_signal_stops_the_back_off_from_a_locked_store():
    """Inside a deferring block (the profiler's journal write and its report), a write that meets a
    locked store gives up at once when a stop is pending, instead of holding Ctrl-C for its back-off."""
    import os
    import signal
    import time

    from kareus.interrupts import signals_deferred
    from kareus.tracking.store import retry

    tries: list[float] = []

    def locked() -> None:
        tries.append(time.monotonic())
        if len(tries) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives while the writer backs off
        raise RuntimeError("database is locked")

    landed: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: landed.append("handler"))
    try:
        with pytest.raises(RuntimeError, match="locked"):
            with signals_deferred():
                try:
                    retry(locked, attempts=10, delay_s=0.2)
                finally:
                    landed.append("retry ended")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(tries) == 2 and landed == ["retry ended", "handler"]


def test_a_run_is_named_after_every_override_but_the_named_groups():
    from kareus.tracking.tracker import default_run_name

    choices = {"model": "tiny", "parallel": "pp1_tp2", "search": "mbo", "hardware": "h100_sim",
               "profiler/cooldown": "none"}
    name = default_run_name(choices, ["+model=tiny", "hardware=h100_sim", "profiler/cooldown=none", "seed=1"])
    assert name == "tiny pp1_tp2 mbo hardware=h100_sim profiler/cooldown=none seed=1"
    # how a run is shown, launched or recorded cannot change its numbers: the experiment keeps its name
    quiet = default_run_name(choices, ["+model=tiny", "seed=1", "progress=false", "launcher=process",
                                       "launcher.workers=2", "tracking.plots=false", "resume=runs/a"])
    assert quiet == "tiny pp1_tp2 mbo seed=1"


def test_gpu_hours_say_simulated_only_on_the_simulated_gpu():
    assert "profiling_gpu_hours_simulated" in summary_metrics(1.0, 1.0, profiling_gpu_seconds=3600.0)
    real = summary_metrics(1.0, 1.0, profiling_gpu_seconds=3600.0, simulated=False)
    assert real["profiling_gpu_hours"] == 1.0 and "profiling_gpu_hours_simulated" not in real


@pytest.mark.parametrize("uri, refused", [("mlruns", True), ("file:///tmp/mlruns", True), ("databricks", False),
                                          ("sqlite:///runs/mlflow.db", False), ("http://host:5000", False)])
def test_mlflows_retired_file_store_is_refused_and_other_stores_pass(uri, refused):
    lines = TrackingConfig(uri=uri).problems()
    assert bool(lines) == refused and all(line.startswith("tracking.uri: MLflow's file store is retired") for line in lines)


@pytest.mark.parametrize("uri", ["htp://localhost:5000", "foo://x", "sqlit:///runs/mlflow.db"])
def test_a_mistyped_store_scheme_is_one_line_before_anything_runs(uri):
    """MLflow raised on an unknown scheme at the first write, with a traceback, after the run directory existed."""
    assert TrackingConfig(uri="postgresql+psycopg2://u@h/db").problems() == []
    assert all(TrackingConfig(uri=bare).problems() == [] for bare in ("databricks", "databricks-uc", "uc"))
    assert TrackingConfig(uri=uri).problems() == [
        f"tracking.uri: unsupported scheme {uri.split(':')[0]!r} in {uri!r}; allowed: sqlite, postgresql, mysql, mssql, "
        "http, https, databricks, databricks-uc, uc (a database may name its driver: postgresql+psycopg2)"]


def test_a_signal_during_an_mlflow_write_lands_after_it_even_with_other_threads_running(ctrl_c_raises):
    """The kernel may hand the signal to any thread; the write still finishes before the handler runs."""
    import os
    import signal
    import threading

    from kareus.tracking.store import retry

    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)  # a thread that does not block the signal
    worker.start()
    steps = []

    def write():
        steps.append("begin")
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes at which an undeferred handler would run
            pass
        steps.append("end")

    try:
        with pytest.raises(KeyboardInterrupt):
            retry(write)
    finally:
        stop.set()
    assert steps == ["begin", "end"]


def test_a_tracking_store_plugins_scheme_is_accepted(monkeypatch):
    """MLflow plugins register stores under the "mlflow.tracking_store" entry points: their schemes pass."""
    import importlib.metadata
    from types import SimpleNamespace

    real = importlib.metadata.entry_points

    def fake(**kw):
        return [SimpleNamespace(name="mystore")] if kw.get("group") == "mlflow.tracking_store" else real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    assert TrackingConfig(uri="mystore://bucket/runs").problems() == []
    assert TrackingConfig(uri="otherstore://x").problems()[0].endswith(
        "http, https, databricks, databricks-uc, uc, mystore (a database may name its driver: postgresql+psycopg2)")


def test_overrides_read_alike_in_single_runs_and_sweep_jobs():
    """Hydra writes a sweep job's booleans as True/False; a filter on 'false' missed those jobs."""
    from kareus.tracking.records import normal_override, override_tags
    from kareus.tracking.tracker import default_run_name

    assert normal_override("progress=False") == "progress=false" and normal_override("name=False x") == "name=False x"
    assert override_tags(["progress=False"])["override.progress"] == "false"
    assert default_run_name({"model": "tiny"}, ["search.greedy=True"]) == "tiny search.greedy=true"


def test_a_failed_mlflow_write_loses_no_candidate_metric(store, client, monkeypatch):
    """The buffer was emptied before the write: one write that failed left a hole in every history."""
    tracker = Tracker(TrackingConfig(), base=store)
    tracker.start(RESOLVED, CHOICES, [])
    factory = dataclasses.replace(tracker.partition_listener_factory("fwd_attn"), flush_interval_s=0.0, plots=False)
    listener = factory()
    events = search_events("fwd_attn", n=4, batch=4)
    listener(events[0])  # SearchStarted: the run exists
    real = listener.client.log_batch
    calls = []

    def busy_once(*args, **kwargs):
        calls.append(kwargs.get("metrics"))
        if len(calls) == 2:
            raise OSError("database is locked")
        return real(*args, **kwargs)

    monkeypatch.setattr(listener.client, "log_batch", busy_once)
    monkeypatch.setattr("kareus.tracking.partition.retry", lambda fn, *a, **kw: fn(*a, **kw))
    for event in events[1:]:
        listener(event)
    tracker.end()
    assert listener.errors == 1 and listener.finished
    assert sorted(m.step for m in client.get_metric_history(listener.run_id, "time_s")) == [0, 1, 2, 3]
    assert client.get_run(listener.run_id).info.status == "FINISHED"


def test_a_finished_search_whose_plots_could_not_be_written_ends_finished(store, client, monkeypatch):
    """A failed artifact write at the end left the run to be closed KILLED after a search that ended."""
    tracker = Tracker(TrackingConfig(), base=store)
    tracker.start(RESOLVED, CHOICES, [])
    listener = tracker.partition_listener_factory("fwd_attn")()

    def disk_full(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(listener.client, "log_artifacts", disk_full)
    monkeypatch.setattr("kareus.tracking.partition.retry", lambda fn, *a, **kw: fn(*a, **kw))
    for event in search_events("fwd_attn", n=8, batch=4):
        listener(event)
    listener.close()  # as run_search_task closes every listener
    tracker.end()
    assert listener.errors == 1
    run = client.get_run(listener.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["hypervolume_final"] > 0


def test_an_artifact_location_no_run_could_write_is_named_at_once(tmp_path, monkeypatch):
    """MLflow raised at the run's first artifact: a FAILED run left behind, and the location kept for
    the experiment it had just created."""
    import importlib.util

    from kareus.tracking.store import artifact_location_problem

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "boto3" else real(name, *a))
    (tmp_path / "notes.txt").write_text("a file where a folder would go")
    local = "sqlite:///runs/mlflow.db"
    assert artifact_location_problem("s3://bucket/x", local) == (
        "s3://bucket/x needs the package boto3 for MLflow's s3:// artifacts; install it, or give a local folder")
    assert artifact_location_problem(f"{tmp_path}/notes.txt/art", local).endswith("is not a folder; choose another folder")
    assert artifact_location_problem(f"{tmp_path}/art", local) is None
    assert artifact_location_problem("s3://bucket/x", "http://127.0.0.1:5000") is None  # the server's own root


def test_a_deleted_experiment_is_refused_not_restored_with_its_runs(store, client):
    """Restoring it brought back every run the user had deleted with it; MLflow's own set_experiment
    refuses a deleted experiment the same way."""
    from kareus.errors import KareusError
    from kareus.tracking.store import experiment_id

    uri = resolve_uri("sqlite:///runs/mlflow.db", store)
    exp = client.create_experiment("deleted-here")
    run = client.create_run(exp).info.run_id
    client.delete_experiment(exp)
    with pytest.raises(KareusError, match=r"^tracking.experiment: 'deleted-here' is deleted in sqlite:///.*; restore it "
                                          rf"\(mlflow experiments restore --experiment-id {exp}\)"):
        experiment_id(uri, "deleted-here")
    assert client.get_experiment(exp).lifecycle_stage == "deleted"
    assert client.get_run(run).info.lifecycle_stage == "deleted"
