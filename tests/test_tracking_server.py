"""Through a real ``mlflow server``: what the UI reads over REST (runs, tags, metrics, artifacts)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from kareus.frontier import Frontier
from kareus.tracking import Tracker, TrackingConfig
from tracking_fakes import empty_store, search_events

STARTUP_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, endpoint: str, **query) -> dict:
    url = f"{base}{endpoint}?{urllib.parse.urlencode(query)}" if query else base + endpoint
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(base: str, endpoint: str, body: dict) -> dict:
    req = urllib.request.Request(base + endpoint, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server per module: SQLite backend, artifacts proxied by the server (as on a cluster)."""
    tmp = tmp_path_factory.mktemp("server")
    backend = empty_store(tmp)
    # a run logged locally beforehand, as `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db` finds it
    local = Tracker(TrackingConfig(uri=backend, artifact_location=str(tmp / "local-artifacts")), base=tmp)
    local.start({"search": {"budget": 4}}, {"model": "tiny"}, [], hardware="sim:a100")
    listener = local.partition_listener_factory("fwd_attn")()
    for event in search_events("fwd_attn", n=4, batch=4, failed_at=None):
        listener(event)
    local.end()
    port = _free_port()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
                             "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail("mlflow server exited: " + (tmp / "server.log").read_text()[-2000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not up within {STARTUP_S} s")
            time.sleep(0.5)
        yield base, listener.run_id
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker processes
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        log.close()


def test_ui_serves_a_run_logged_to_the_local_store(server):
    base, run_id = server
    run = _get(base, "/api/2.0/mlflow/runs/get", run_id=run_id)["run"]
    assert {t["key"]: t["value"] for t in run["data"]["tags"]}["partition"] == "fwd_attn"
    url = f"{base}/get-artifact?" + urllib.parse.urlencode({"path": "candidates.csv", "run_uuid": run_id})
    with urllib.request.urlopen(url, timeout=30) as r:
        assert len(r.read().decode().strip().splitlines()) == 1 + 4
    plots = _get(base, "/api/2.0/mlflow/artifacts/list", run_id=run_id, path="plots")["files"]
    assert {f["path"] for f in plots} == {"plots/frontier.png", "plots/hypervolume.png"}


def test_ui_sees_candidates_frontiers_and_tags_over_rest(server, tmp_path):
    server, _ = server
    tracker = Tracker(TrackingConfig(uri=server, experiment="kareus-ui"), base=tmp_path)
    tracker.start({"search": {"budget": 8}}, {"model": "qwen1.7b", "search": "mbo"}, ["+model=qwen1.7b"],
                  hardware="sim:a100")
    run_id = tracker.run_id
    listener = tracker.partition_listener_factory("fwd_attn")()
    for event in search_events("fwd_attn", n=8, batch=4, failed_at=None):
        listener(event)
    tracker.log_iteration_frontier(Frontier.from_arrays([1.0, 1.2], [900.0, 800.0]), reference=(1.0, 1000.0))
    tracker.end()
    assert not (tmp_path / "runs").exists()  # nothing local when the store is a server

    exp = _get(server, "/api/2.0/mlflow/experiments/get-by-name", experiment_name="kareus-ui")["experiment"]
    parent = _get(server, "/api/2.0/mlflow/runs/get", run_id=run_id)["run"]
    tags = {t["key"]: t["value"] for t in parent["data"]["tags"]}
    assert tags["choice.model"] == "qwen1.7b" and tags["override.model"] == "qwen1.7b"
    assert tags["hardware"] == "sim:a100" and parent["info"]["status"] == "FINISHED"
    assert {p["key"]: p["value"] for p in parent["data"]["params"]}["search.budget"] == "8"

    found = _post(server, "/api/2.0/mlflow/runs/search", {
        "experiment_ids": [exp["experiment_id"]],
        "filter": f"tags.`mlflow.parentRunId` = '{run_id}'"})["runs"]
    assert len(found) == 1
    child = found[0]["info"]["run_id"]
    history = _get(server, "/api/2.0/mlflow/metrics/get-history", run_id=child, metric_key="energy_j")["metrics"]
    assert sorted(int(m.get("step", 0)) for m in history) == list(range(8))
    hv = _get(server, "/api/2.0/mlflow/metrics/get-history", run_id=child, metric_key="hypervolume")["metrics"]
    assert sorted(int(m["step"]) for m in hv) == [4, 8]

    listed = {f["path"] for f in _get(server, "/api/2.0/mlflow/artifacts/list", run_id=child).get("files", [])}
    assert {"candidates.csv", "frontier.csv", "plots"} <= listed
    plots = {f["path"] for f in _get(server, "/api/2.0/mlflow/artifacts/list", run_id=child, path="plots")["files"]}
    assert {"plots/frontier.png", "plots/hypervolume.png"} <= plots
    # the UI's artifact viewer fetches files like this
    url = f"{server}/get-artifact?" + urllib.parse.urlencode({"path": "frontier.csv", "run_uuid": child})
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    assert text.startswith("rank,time_s,energy_j,objective") and len(text.strip().splitlines()) == 1 + len(
        search_events("fwd_attn", n=8, batch=4, failed_at=None)[-1].frontier)
    parent_files = {f["path"] for f in _get(server, "/api/2.0/mlflow/artifacts/list", run_id=run_id,
                                            path="frontiers")["files"]}
    assert "frontiers/iteration.csv" in parent_files
