"""launcher=ray on a Ray cluster of several nodes (a local one: ray.cluster_utils.Cluster, every node on
127.0.0.1 with one CPU): the searches give the frontiers launcher=local gives, every measurement
reaches the run's journal once, a node removed mid-search loses nothing, a run with no node left that
fits stops with one line and a resume finishes it, and a cluster none of whose nodes fits a search's
group is refused before anything is recorded."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest

from kareus.events import CandidateMeasured
from kareus.launch import PartitionSearchTask, run_search_task
from kareus.profiler import Journal
from kareus.registry import LAUNCHERS
from test_cli_errors import error_lines, kareus, left_behind
from test_launch import DATA, check_journal, frontier_of, replay_task, sim_tasks

pytestmark = pytest.mark.slow

NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}  # a removed node is seen soon


@pytest.fixture(scope="module")
def cluster():
    """A head (no CPUs: it holds the driver's mailbox only) and three one-CPU worker nodes."""
    from kareus.launch.launchers import _broken_amdsmi_shim

    _broken_amdsmi_shim()
    ray = pytest.importorskip("ray")
    import ray._private.ray_constants as constants
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    mp.setattr(constants, "ENABLE_RAY_CLUSTER", False)  # the driver resolves 127.0.0.1 as itself, not eth0
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # so do the CLI runs this module starts
    # a folder of its own (short: Ray's socket paths must fit): a plain ray.init() elsewhere on the machine
    # reads /tmp/ray/ray_current_cluster, and must not find this cluster there
    own = tempfile.mkdtemp(prefix="kr")
    mp.setenv("RAY_TMPDIR", own)
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                          "include_dashboard": False, "_system_config": FAST_HEALTH})
        for _ in range(3):
            c.add_node(**NODE)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if c is not None:
            c.shutdown()
        mp.undo()
        shutil.rmtree(own, ignore_errors=True)


def on(cluster, tmp_path: Path, **cfg) -> object:
    return LAUNCHERS.build("ray", config={"address": cluster.address, "local_dir": str(tmp_path / "nodes"), **cfg})


def rows(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as c:
        return c.execute("SELECT partition, slot, sms, freq_mhz FROM measurements ORDER BY id").fetchall()


def exact(path: Path, results) -> None:
    """The run's journal holds each candidate of each search once, in the search's order, and nothing else."""
    check_journal(path, results)
    assert sorted(rows(path)) == sorted(m.candidate.key for r in results for m in r.measurements)


def nothing_left(tmp_path: Path) -> None:
    """Every node-local journal (and the run's folder) is gone once its rows are in the run's journal."""
    assert not list((tmp_path / "nodes").rglob("*"))


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    if not (DATA / "clock_default.csv").exists():
        pytest.skip("real A100 table not available")
    from kareus.hardware.tables import convert_a100_attention

    return convert_a100_attention(DATA, tmp_path_factory.mktemp("replay") / "a100.csv")


def replay_tasks(table: Path, journal: Path) -> list[PartitionSearchTask]:
    """Two searches of a recorded table: its answers do not depend on what the GPU did before, so a
    search that a lost node cut short and a retry finished equals an uninterrupted one exactly."""
    from kareus.hardware.tables import window_partition

    task = replay_task(table, journal)
    return [dataclasses.replace(task, partition=window_partition(end)) for end in (-1, 5)]


def test_searches_on_several_nodes_equal_the_local_ones(cluster, tmp_path):
    local = LAUNCHERS.build("local", config={}).run(sim_tasks(tmp_path / "local.sqlite"))
    path = tmp_path / "journal.sqlite"
    events: list = []
    launcher = on(cluster, tmp_path)
    results = launcher.run(sim_tasks(path), listeners=[events.append])
    names = [type(e).__name__ for e in events]  # every remote search shown live, each event once
    assert (names.count("CandidateMeasured"), names.count("SearchStarted"), names.count("SearchFinished")) == (20, 2, 2)
    assert [frontier_of(r) for r in results] == [frontier_of(r) for r in local]
    assert [r.measurements for r in results] == [r.measurements for r in local]
    exact(path, results)
    nodes = launcher.summary()["nodes"]
    assert sum(n["measured_now"] for n in nodes.values()) == 20 and sum(n["searches"] for n in nodes.values()) == 2
    spent = sum(r.gpu_seconds for r in local)
    assert sum(n["measured_now_gpu_seconds"] for n in nodes.values()) == pytest.approx(spent)
    assert [r.measured_now for r in results] == [10, 10]
    nothing_left(tmp_path)


def test_a_node_removed_mid_search_loses_no_measurement(cluster, table, tmp_path):
    local = [run_search_task(t) for t in replay_tasks(table, tmp_path / "local.sqlite")]
    path = tmp_path / "journal.sqlite"
    launcher = on(cluster, tmp_path)
    cut = replay_tasks(table, path)[0].partition.key
    events: list = []
    removed: list = []

    def remove_its_node(event) -> None:
        events.append(event)
        if not removed and isinstance(event, CandidateMeasured) and event.partition == cut and event.index == 5:
            node_id = launcher.cluster.placed[cut]
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            cluster.remove_node(node, allow_graceful=False)
            removed.append(node_id)

    try:
        results = launcher.run(replay_tasks(table, path), listeners=[remove_its_node])
    finally:
        cluster.add_node(**NODE)  # the next test's cluster has three workers again
    assert removed
    assert [frontier_of(r) for r in results] == [frontier_of(r) for r in local]
    assert [r.measurements for r in results] == [r.measurements for r in local]
    exact(path, results)
    with Journal.open(path, replay_tasks(table, path)[0].config_hash) as j:
        assert j.duplicates() == [] and j.count() == 32
    shown = [e.index for e in events if isinstance(e, CandidateMeasured) and e.partition == cut]
    assert shown == list(range(16))  # the retry's answers from the journal are not shown again
    nodes = launcher.summary()["nodes"]
    assert sum(n["searches"] for n in nodes.values()) == 3 and sum(n["measured_now"] for n in nodes.values()) == 32
    assert [r.measured_now for r in results] == [16, 16]  # measured in this run, by whichever node
    nothing_left(tmp_path)


def test_with_no_node_left_that_fits_the_run_stops_and_a_resume_finishes_it(cluster, table, tmp_path):
    """Only one node has the two CPUs a search asks for here; it goes, and the run stops with one line.
    The resume (a copy of the journal, as resume= makes) on a new such node finishes exactly."""
    from kareus.launch.launchers import WorkerLost
    from kareus.profiler.journal import copy_journal

    local = [run_search_task(t) for t in replay_tasks(table, tmp_path / "local.sqlite")]
    big = cluster.add_node(**{**NODE, "num_cpus": 2})
    first, second = tmp_path / "a" / "journal.sqlite", tmp_path / "b" / "journal.sqlite"
    launcher = on(cluster, tmp_path, cpus_per_task=2)

    def remove_it(event) -> None:
        if isinstance(event, CandidateMeasured) and event.index == 5 and big in cluster.worker_nodes:
            cluster.remove_node(big, allow_graceful=False)

    with pytest.raises(WorkerLost) as err:
        launcher.run(replay_tasks(table, first), listeners=[remove_it])
    line = str(err.value)
    assert line.startswith("launcher: no live node of the Ray cluster fits partition ") and "\n" not in line, line
    assert "a group of 1 rank(s) on one node (0 GPU(s), 2 CPU(s)); the largest has 0 GPU(s) and 1 CPU(s)" in line
    kept = len(rows(first))
    assert 6 <= kept < 32
    copy_journal(first, second)
    big = cluster.add_node(**{**NODE, "num_cpus": 2})
    try:
        resumed = on(cluster, tmp_path, cpus_per_task=2).run(replay_tasks(table, second))
    finally:
        cluster.remove_node(big)
    assert [frontier_of(r) for r in resumed] == [frontier_of(r) for r in local]
    assert [r.measurements for r in resumed] == [r.measurements for r in local]
    exact(second, resumed)
    assert sum(r.measured_now for r in resumed) == 32 - kept  # what the first run kept is not measured again
    nothing_left(tmp_path)


def test_a_cluster_none_of_whose_nodes_fits_a_group_is_refused_before_anything_is_recorded(cluster, tmp_path):
    from kareus.errors import KareusError

    ray = pytest.importorskip("ray")
    path = tmp_path / "journal.sqlite"
    with pytest.raises(KareusError) as err:
        on(cluster, tmp_path, cpus_per_task=4).run(sim_tasks(path))
    assert str(err.value) == ("launcher: a partition search needs a group of 1 rank(s) on one node (0 GPU(s), 4 "
                              "CPU(s)), but the largest node of the Ray cluster has 0 GPU(s) and 1 CPU(s); add a node "
                              "that fits, or lower launcher.cpus_per_task or launcher.gpus_per_task")
    assert not path.exists() and not ray.is_initialized()


TINY = ["+model=tiny", "parallel=pp1_tp2", "mode=search", "search.budget_frac=0.1", "progress=false",
        "tracking.plots=false"]


def _outputs(run_dir: Path) -> dict[str, str]:
    files = [run_dir / "search_summary.json", *sorted((run_dir / "frontiers").glob("*.csv"))]
    return {p.name: p.read_text() for p in files}


def test_the_command_line_on_several_nodes_equals_the_local_run(cluster, tmp_path):
    """python -m kareus ... launcher=ray launcher.address=<cluster>: the same frontiers as launcher=local,
    an MLflow partition run per search that logged every candidate, and the per-node GPU-hours."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    local.mkdir(), remote.mkdir()
    refused = kareus(remote, *TINY, "launcher=ray", f"launcher.address={cluster.address}", "launcher.cpus_per_task=3",
                     timeout=300)
    assert refused.returncode == 2 and left_behind(remote) == [], refused.stderr[-2000:]
    assert [ln for ln in error_lines(refused.stderr) if "error" in ln.lower()] == [  # beside Ray's own log
        "error: launcher: a partition search needs a group of 1 rank(s) on one node (0 GPU(s), 3 CPU(s)), but the "
        "largest node of the Ray cluster has 0 GPU(s) and 1 CPU(s); add a node that fits, or lower "
        "launcher.cpus_per_task or launcher.gpus_per_task"]
    ran = kareus(local, *TINY, "hydra.run.dir=runs/a", timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    ran = kareus(remote, *TINY, "hydra.run.dir=runs/a", "launcher=ray", f"launcher.address={cluster.address}",
                 f"launcher.local_dir={tmp_path / 'nodes'}", timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert _outputs(remote / "runs" / "a") == _outputs(local / "runs" / "a")
    summary = json.loads((remote / "runs" / "a" / "summary.json").read_text())
    profiled = summary["profiled"]
    assert sum(n["measured_now"] for n in summary["nodes"].values()) == profiled == summary["measured_now"]
    assert len(summary["nodes"]) >= 2  # the searches spread over the workers
    with Journal.open(remote / "runs" / "a" / "journal.sqlite", _hash(remote / "runs" / "a")) as j:
        assert j.duplicates() == [] and j.count() == profiled
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{remote / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("kareus").experiment_id])
    parts = [r for r in runs if r.data.tags.get("kareus.kind") == "partition"]
    search = json.loads((remote / "runs" / "a" / "search_summary.json").read_text())
    assert sorted(r.data.tags["partition"] for r in parts) == sorted(search)
    for r in parts:
        assert r.info.status == "FINISHED"
        history = client.get_metric_history(r.info.run_id, "time_s")
        assert len(history) == search[r.data.tags["partition"]]["profiled"] == r.data.metrics["profiled"]
    nothing_left(tmp_path)


def _hash(run_dir: Path) -> str:
    with sqlite3.connect(run_dir / "journal.sqlite") as c:
        return c.execute("SELECT value FROM meta WHERE key='config_hash'").fetchone()[0]


FAST_PROFILER = {"target_window_s": 0.02, "min_window_s": 0.0, "settle_s": 0.0, "warmup_runs": 0,
                 "calibration_runs": 1, "retries": 0, "cooldown": {"name": "none"}, "frequency": {"name": "sim"}}


def test_a_tensor_parallel_group_runs_as_ranks_of_one_placement_group(cluster, tmp_path):
    """The real-GPU path on the CPU: a TP 2 partition's search runs as two rank actors of one placement
    group, started like torchrun (a gloo group here, NCCL on GPUs); the CPU has no energy counter, so
    every candidate fails the same way on both ranks, and rank 0 relays the group's rows."""
    pytest.importorskip("torch")
    from kareus.types import Collective, Direction, Link, PartitionType, Slot
    from kareus.workload.ops import comm, gemm

    part = PartitionType("fwd_x", Direction.FWD, (gemm("a", 32, 32, 32), gemm("b", 32, 32, 32)),
                         comm("ag", Collective.ALL_GATHER, 4096, 2, Link.NVLINK),
                         (Slot("linear_0", (0,), "gemm"), Slot("linear_1", (1,), "gemm")))
    (task,) = sim_tasks(tmp_path / "journal.sqlite", seeds=(2,))[:1]
    task = dataclasses.replace(task, partition=part, profiler=FAST_PROFILER, search={"name": "random", "budget": 3},
                               hardware={"name": "cuda", "device": "cpu", "comm": "gloo", "energy": "none"})
    events: list = []
    (result,) = on(cluster, tmp_path, gpus_per_task=0).run([task], listeners=[events.append])
    assert len(result.measurements) == 3 and all(m.failed for m in result.measurements)
    assert all("energy is unavailable on device cpu" in m.flags[0] for m in result.measurements)
    assert [type(e).__name__ for e in events].count("CandidateMeasured") == 3
    with Journal.open(tmp_path / "journal.sqlite", task.config_hash) as j:  # (failed readings are nan: no ==)
        assert j.duplicates() == [] and [(m.candidate, m.flags) for m in j.measurements()] == \
            [(m.candidate, m.flags) for m in result.measurements]
    nothing_left(tmp_path)
