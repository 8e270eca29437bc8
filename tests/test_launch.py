"""Partition searches as tasks: launchers agree with each other, share a journal safely, and a
search killed with SIGKILL resumes to exactly the uninterrupted result."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kareus.config.hashing import stable_hash
from kareus.launch import PartitionSearchTask, gpus_needed, run_search_task, task_from_dict, task_to_dict
from kareus.profiler import Journal
from kareus.launch.task_main import result_to_dict
from kareus.registry import LAUNCHERS

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "a100_attention_tp2"
FAST_PROFILER = {"cooldown": {"name": "fixed", "seconds": 1.0}, "frequency": {"name": "sim"}}
SEARCH = {"name": "random", "budget": 10}


def sim_tasks(journal: Path, seeds=(3, 4)) -> list[PartitionSearchTask]:
    from kareus.hardware.tables import window_partition

    parts = [window_partition(-1), window_partition(5)]
    cfg = {"hardware": {"name": "sim"}, "search": SEARCH, "profiler": FAST_PROFILER}
    h = stable_hash(cfg)
    return [PartitionSearchTask(partition=p, hardware={"name": "sim"}, search=SEARCH, profiler=FAST_PROFILER,
                                seed=s, journal_path=str(journal), config_hash=h) for p, s in zip(parts, seeds)]


def frontier_of(result):
    return [(p.time_s, p.energy_j, p.payload) for p in result.frontier], \
        [(p.time_s, p.energy_j, p.payload) for p in result.dynamic_frontier]


def check_journal(path: Path, results) -> None:
    with Journal.open(path, _hash_of(path)) as j:
        assert j.integrity_ok() and j.duplicates() == []
        for r in results:
            assert [m.candidate for m in j.measurements(r.partition)] == [m.candidate for m in r.measurements]
            assert j.measurements(r.partition) == r.measurements


def _hash_of(path: Path) -> str:
    import sqlite3

    with sqlite3.connect(path) as c:
        return c.execute("SELECT value FROM meta WHERE key='config_hash'").fetchone()[0]


@pytest.fixture(scope="module")
def local_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("local") / "journal.sqlite"
    results = LAUNCHERS.build("local", config={}).run(sim_tasks(path))
    check_journal(path, results)
    return results


def test_local_run_is_a_search(local_results):
    r = local_results[0]
    assert len(r.measurements) == 10 and len(r.frontier) >= 1
    assert [x.partition for x in local_results] == ["fwd_attn_tp2", "fwd_attn_tp2.join_attn_0"]


def test_process_launcher_matches_local_and_shares_the_journal(local_results, tmp_path):
    path = tmp_path / "journal.sqlite"
    events: list = []
    results = LAUNCHERS.build("process", config={"workers": 2}).run(sim_tasks(path), listeners=[events.append])
    names = [type(e).__name__ for e in events]  # forwarded from the workers to the driver's listeners
    assert (names.count("CandidateMeasured"), names.count("SearchStarted"), names.count("SearchFinished")) == (20, 2, 2)
    assert [frontier_of(r) for r in results] == [frontier_of(r) for r in local_results]
    assert [r.measurements for r in results] == [r.measurements for r in local_results]
    check_journal(path, results)  # two workers wrote one file at once


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_ray_launcher_matches_local(local_results, tmp_path):
    from kareus.launch.launchers import _broken_amdsmi_shim

    _broken_amdsmi_shim()  # what the launcher does before importing Ray
    pytest.importorskip("ray")
    path = tmp_path / "journal.sqlite"
    launcher = LAUNCHERS.build("ray", config={"num_cpus": 2, "num_gpus": 0})
    events: list = []
    results = launcher.run(sim_tasks(path), listeners=[events.append])
    assert sum(type(e).__name__ == "CandidateMeasured" for e in events) == 20
    assert [frontier_of(r) for r in results] == [frontier_of(r) for r in local_results]
    check_journal(path, results)


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_a_failed_ray_task_raises_its_own_error_and_stops_the_others(tmp_path):
    """ray.get raised RayTaskError, whose text is Ray's coloured traceback (the CLI printed ~30 lines),
    and the wait loop let every other search spend its whole budget first."""
    from kareus.launch.launchers import _broken_amdsmi_shim
    from kareus.types import Candidate

    _broken_amdsmi_shim()
    pytest.importorskip("ray")
    tasks = sim_tasks(tmp_path / "journal.sqlite")
    tasks[0].initial = [Candidate(tasks[0].partition.key, "nope", 1, 1)]  # this search fails at once
    slow = {"name": "random", "budget": 400}  # the other would run for minutes
    tasks[1] = PartitionSearchTask(**{**tasks[1].__dict__, "search": slow})
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        LAUNCHERS.build("ray", config={"num_cpus": 2, "num_gpus": 0}).run(tasks, listeners=[lambda e: None])
    assert "RayTaskError" not in type(err.value).__name__ and len(str(err.value).splitlines()) == 1, str(err.value)
    assert time.monotonic() - t0 < 60
    with Journal.open(tmp_path / "journal.sqlite", _hash_of(tmp_path / "journal.sqlite")) as j:
        assert len(j.measurements(tasks[1].partition.key)) < 400


@pytest.mark.parametrize("config,says", [
    ({"address": "auto"}, "launcher.address: auto: "),  # no cluster running on this machine
    ({"num_cpus": 1, "num_gpus": 0, "cpus_per_task": 4}, "launcher.cpus_per_task: 4 CPUs per search, but the Ray "
                                                           "cluster has 1"),
])
def test_a_ray_cluster_that_cannot_run_the_searches_is_one_line(tmp_path, config, says, monkeypatch):
    """No cluster at launcher.address was a ConnectionError traceback; more CPUs per search than the
    cluster has left every task unscheduled, a silent hang."""
    from kareus.errors import KareusError
    from kareus.launch.launchers import _broken_amdsmi_shim

    _broken_amdsmi_shim()
    ray = pytest.importorskip("ray")
    import ray._private.services as services

    # "auto" also joins any GCS process it sees on the machine: another test's local cluster, maybe
    # being shut down (a connection that then waits for minutes); this test's machine runs none
    def no_gcs() -> list:
        return []

    no_gcs.cache_clear = lambda: None  # (Ray clears the real one's cache)
    monkeypatch.setattr(services, "find_gcs_addresses", no_gcs)
    with pytest.raises(KareusError) as err:
        LAUNCHERS.build("ray", config=config).check(sim_tasks(tmp_path / "j.sqlite"))
    assert str(err.value).startswith(says) and "\n" not in str(err.value), str(err.value)
    assert not ray.is_initialized()  # what the check started is shut down again


def test_ray_resources_must_not_be_negative():
    from kareus.launch.launchers import RayLauncherConfig

    assert RayLauncherConfig(num_cpus=-1).problems() == ["num_cpus: must be >= 0, got -1"]


_RAY_SIGTERM = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from kareus.launch.launchers import _broken_amdsmi_shim
from kareus.registry import LAUNCHERS
from test_launch import sim_tasks
from pathlib import Path
hit = []
signal.signal(signal.SIGTERM, lambda signum, frame: hit.append(signum))  # as the CLI's own handler
_broken_amdsmi_shim()
mid_run = lambda event: None if hit else os.kill(os.getpid(), signal.SIGTERM)  # once, while Ray runs
LAUNCHERS.build("ray", config={"num_cpus": 1, "num_gpus": 0}).run(sim_tasks(Path(sys.argv[1]), seeds=(2,))[:1],
                                                                   listeners=[mid_run])
os.kill(os.getpid(), signal.SIGTERM)  # and once Ray has shut down
print("handled" if len(hit) == 2 else "lost", flush=True)
"""


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_ray_leaves_the_programs_sigterm_handler_in_place(tmp_path):
    """ray.init installed Ray's crash handler over the CLI's: a SIGTERM aborted (exit 134) without the
    resume line, and left MLflow runs RUNNING."""
    pytest.importorskip("ray")
    script = tmp_path / "ray_sigterm.py"
    script.write_text(_RAY_SIGTERM)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "j.sqlite"), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "handled", \
        (done.returncode, done.stdout[-1000:], done.stderr[-2000:])


def test_gpus_needed_and_task_json_round_trip(tmp_path):
    (task,) = sim_tasks(tmp_path / "j.sqlite", seeds=(1,))
    assert gpus_needed(task) == 0
    real = PartitionSearchTask(**{**task.__dict__, "hardware": {"name": "cuda"}})
    assert gpus_needed(real) == task.partition.comm.group_size == 2
    back = task_from_dict(json.loads(json.dumps(task_to_dict(task))))
    assert back == task
    ray_cfg = LAUNCHERS.build("ray", config={"gpus_per_task": 0.5})
    assert ray_cfg._gpus(real) == 0.5


def test_listener_factories_run_inside_the_worker(tmp_path):
    (task,) = sim_tasks(tmp_path / "j.sqlite", seeds=(2,))
    task.listener_factories = [Recorder]
    Recorder.seen.clear()
    run_search_task(task)
    kinds = [type(e).__name__ for e in Recorder.seen]
    assert kinds[0] == "SearchStarted" and kinds[-1] == "SearchFinished" and kinds.count("CandidateMeasured") == 10


def test_the_backend_is_closed_after_the_search_even_when_it_fails(tmp_path, monkeypatch):
    from kareus.registry import HARDWARE, SEARCHERS

    closed = []
    build = HARDWARE.build

    def closing_build(name, **kw):
        backend = build(name, **kw)
        backend.close = lambda: closed.append(name)
        return backend

    monkeypatch.setattr(HARDWARE, "build", closing_build)
    (task,) = sim_tasks(tmp_path / "j.sqlite", seeds=(2,))
    run_search_task(task)
    assert closed == ["sim"]

    def broken(*a, **kw):
        raise RuntimeError("searcher died")

    monkeypatch.setattr(SEARCHERS, "build", broken)
    with pytest.raises(RuntimeError, match="searcher died"):
        run_search_task(task)
    assert closed == ["sim", "sim"]


_DYING_WORKER = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import kareus.launch.launchers as launchers
from kareus.registry import LAUNCHERS
from test_launch import sim_tasks

def killed(task):
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a worker

launchers.run_search_task = killed  # a forked worker sees the patch
launcher = LAUNCHERS.build("process", config={"workers": 1, "start_method": "fork"})
try:
    launcher.run(sim_tasks(__import__("pathlib").Path(sys.argv[1])))
except launchers.WorkerLost as exc:
    print(exc)
    sys.exit(0 if "worker process died" in str(exc) else 4)
sys.exit(3)
"""


def test_a_worker_that_dies_is_one_clear_error_not_a_broken_pool(tmp_path):
    """Forked from an interpreter of its own: a fork of the test process, whose earlier tests may have
    left threads holding locks, can stall the child."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    script = tmp_path / "dying_worker.py"
    script.write_text(_DYING_WORKER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "j.sqlite"), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]


@pytest.mark.parametrize("with_listener", [True, False], ids=["listened", "quiet"])
def test_a_failed_task_stops_the_others_at_once(tmp_path, with_listener):
    """With listeners (always, from the CLI) the parent waited for every task before looking at any
    result: the other searches ran to their end for a run that failed anyway."""
    import dataclasses

    from kareus.events import SearchFinished
    from kareus.registry import UnknownComponentError

    bad, good = sim_tasks(tmp_path / "j.sqlite")
    bad = dataclasses.replace(bad, search={"name": "nope"})
    long = dataclasses.replace(good, search={"name": "mbo", "budget": 120, "batch_size": 4})  # seconds of work
    events: list = []
    launcher = LAUNCHERS.build("process", config={"workers": 2})
    with pytest.raises(UnknownComponentError):
        launcher.run([long, bad], listeners=[events.append] if with_listener else [])  # the failure second
    assert not [e for e in events if isinstance(e, SearchFinished)]
    with Journal.open(tmp_path / "j.sqlite", long.config_hash) as j:
        assert len(j.measurements(long.partition.key)) < 120


def test_a_dead_event_relay_is_one_clear_error(tmp_path, monkeypatch):
    import kareus.launch.launchers as launchers

    def relay_gone(*args, **kwargs):
        raise EOFError  # what a read from the killed manager process raises

    monkeypatch.setattr(launchers, "_dispatch", relay_gone)
    launcher = LAUNCHERS.build("process", config={"workers": 1})
    with pytest.raises(launchers.WorkerLost, match="relaying the workers' events died"):
        launcher.run(sim_tasks(tmp_path / "j.sqlite", seeds=(2,)), listeners=[lambda event: None])


def test_a_missing_process_group_stops_a_real_gpu_search_at_once(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import torch.distributed as dist

    from kareus.errors import KareusError

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (task,) = sim_tasks(tmp_path / "j.sqlite", seeds=(2,))
    task.hardware = {"name": "cuda", "device": "cpu", "comm": "gloo", "energy": "none"}
    with pytest.raises(KareusError, match="torch.distributed process group"):
        run_search_task(task)
    assert _rows(str(tmp_path / "j.sqlite")) == 0  # no candidate recorded as a crash


class Recorder:
    seen: list = []

    def __call__(self, event) -> None:
        self.seen.append(event)


# -- kill and resume ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replay_table(tmp_path_factory):
    if not (DATA / "clock_default.csv").exists():
        pytest.skip("real A100 table not available")
    from kareus.hardware.tables import convert_a100_attention

    return convert_a100_attention(DATA, tmp_path_factory.mktemp("replay") / "a100.csv")


def replay_task(table: Path, journal: Path) -> PartitionSearchTask:
    from kareus.hardware.tables import window_partition

    hw = {"name": "replay", "table": str(table)}
    search = {"name": "mbo", "budget": 16, "batch_size": 4, "initial": 4,
              "surrogate": {"members": 2, "rounds": 10, "threads": 1}}
    prof = {"cooldown": {"name": "fixed"}, "frequency": {"name": "sim"}}
    return PartitionSearchTask(partition=window_partition(-1), hardware=hw, search=search, profiler=prof, seed=11,
                               journal_path=str(journal), config_hash=stable_hash([hw, search, prof, 11]))


def _rows(path: str) -> int:
    """Rows committed so far (a plain reader: it never takes the writer's lock)."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as c:
            return c.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_sigkill_resume_equals_uninterrupted_run(replay_table, tmp_path):
    ref_task = replay_task(replay_table, tmp_path / "ref" / "journal.sqlite")
    ref = run_search_task(ref_task)
    assert len(ref.measurements) == 16

    task = replay_task(replay_table, tmp_path / "run" / "journal.sqlite")
    task_file = tmp_path / "task.json"
    task_file.write_text(json.dumps(task_to_dict(task)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "kareus.launch.task_main", str(task_file), "--pace", "0.03"]
    rng = random.Random(5)
    kills, counts = 0, []
    for target in sorted(rng.sample(range(2, 15), 3)):
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE)
        deadline = time.time() + 60
        n = 0
        while time.time() < deadline and proc.poll() is None:
            if Path(task.journal_path).exists():
                n = _rows(task.journal_path)
                if n >= target:
                    time.sleep(rng.uniform(0.0, 0.03))  # somewhere inside the next measurement
                    break
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        with Journal.open(task.journal_path, task.config_hash) as j:
            counts.append(j.count())
            assert j.integrity_ok() and j.duplicates() == []
    assert kills == 3 and counts == sorted(counts) and counts[-1] < 16
    resumed = run_search_task(task)  # the last resume, in process, runs to the end
    with Journal.open(task.journal_path, task.config_hash) as j:
        assert j.duplicates() == []  # no candidate measured twice
        assert j.measurements() == ref.measurements  # none lost, same values, same order
    assert resumed.measurements == ref.measurements
    assert frontier_of(resumed) == frontier_of(ref)
    res = result_to_dict(resumed)
    assert res["frontier"] == [[p.time_s, p.energy_j, list(p.payload.candidate.key)] for p in ref.frontier]
    assert res["measured"] == [list(m.candidate.key) for m in ref.measurements]


def test_resume_with_another_config_is_refused(replay_table, tmp_path):
    task = replay_task(replay_table, tmp_path / "journal.sqlite")
    Journal.open(task.journal_path, "another-config").close()
    from kareus.profiler import JournalMismatchError

    with pytest.raises(JournalMismatchError, match="config hash"):
        run_search_task(task)


def test_a_second_ctrl_c_during_the_relays_shutdown_waits_for_it(ctrl_c_raises):
    """A Ctrl-C that lands inside the event relay's shutdown is held until the shutdown is done (and
    a relay that outlives it is killed), then delivered: it used to leave the relay alive, and the
    run's exit waited on it for good."""
    import signal

    from kareus.launch.launchers import _stop_manager

    class Relay:
        done = False

        def __init__(self) -> None:
            self._process = self

        def shutdown(self) -> None:
            signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, mid-handshake
            Relay.done = True

        def is_alive(self) -> bool:
            return True

        def kill(self) -> None:
            Relay.killed = True

    with pytest.raises(KeyboardInterrupt):
        _stop_manager(Relay())
    assert Relay.done and Relay.killed


def test_a_simulated_gpus_learned_thermal_state_is_its_tasks_own(tmp_path):
    """Each task builds a fresh simulated GPU: a search's thermal anchors do not depend on what other
    tasks journaled first, so a parallel launcher gives the frontiers a serial one gives."""
    import sqlite3

    profiler = {"cooldown": {"name": "thermal"}, "frequency": {"name": "sim"}}

    def tasks(path: Path) -> list[PartitionSearchTask]:
        return [PartitionSearchTask(partition=t.partition, hardware=t.hardware, search=t.search, profiler=profiler,
                                    seed=t.seed, journal_path=t.journal_path, config_hash=t.config_hash)
                for t in sim_tasks(path)]

    both = tmp_path / "both.sqlite"
    after = [run_search_task(t) for t in tasks(both)][1]
    alone = run_search_task(tasks(tmp_path / "alone.sqlite")[1])
    assert after.measurements == alone.measurements
    with sqlite3.connect(both) as c:
        keys = {k for (k,) in c.execute("SELECT key FROM meta WHERE key LIKE 'thermal:%'")}
    assert keys == {"thermal:sim:A100-SXM4-40GB/fwd_attn_tp2:ThermalCooldown",
                    "thermal:sim:A100-SXM4-40GB/fwd_attn_tp2.join_attn_0:ThermalCooldown"}


def test_a_physical_gpus_thermal_state_is_named_by_host_and_uuid():
    from types import SimpleNamespace

    from kareus.launch.task import thermal_device

    task = sim_tasks(Path("unused.sqlite"))[0]
    on_gpu = PartitionSearchTask(partition=task.partition, hardware={"name": "cuda"}, search=SEARCH,
                                 profiler=FAST_PROFILER, seed=1, journal_path="j", config_hash="h")
    gpu = SimpleNamespace(name="cuda:H200-SXM-141GB:0", device_id="node7:GPU-5d1f")
    assert thermal_device(on_gpu, gpu) == "node7:GPU-5d1f"  # two nodes' cuda:0 stay apart
    assert thermal_device(task, SimpleNamespace(name="sim:A100-SXM4-40GB")) == "sim:A100-SXM4-40GB/fwd_attn_tp2"
    on_cpu = PartitionSearchTask(partition=task.partition, hardware={"name": "cuda", "device": "cpu"}, search=SEARCH,
                                 profiler=FAST_PROFILER, seed=1, journal_path="j", config_hash="h")
    assert thermal_device(on_cpu, SimpleNamespace(name="cpu:A100", device_id="cpu:A100")) == "cpu:A100/fwd_attn_tp2"


def test_a_profiler_built_without_a_device_id_keys_thermal_state_by_the_backends_gpu():
    """The fixed-work and Perseus measurements build their own profiler: on a real GPU it must share
    the search's state, keyed by the physical GPU, not by the process-local device index."""
    import kareus.hardware  # noqa: F401
    from kareus.profiler import Profiler, ProfilerConfig
    from kareus.registry import HARDWARE

    backend = HARDWARE.build("sim", config={"name": "sim"}, seed=0)
    backend.device_id = "node7:GPU-5d1f"
    cfg = ProfilerConfig(cooldown={"name": "thermal"}, frequency={"name": "sim"})
    assert Profiler(cfg, backend)._thermal_key == "thermal:node7:GPU-5d1f:ThermalCooldown"
    assert Profiler(cfg, backend, device_id="sim/x")._thermal_key == "thermal:sim/x:ThermalCooldown"


_KILLED_PARENT = """
import dataclasses, os, signal, sys
sys.path.insert(0, sys.argv[2])
from kareus.registry import LAUNCHERS
from test_launch import sim_tasks

def children():
    mine = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    mine.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return mine

def on_event(event):
    print(*children(), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends the main process

if __name__ == "__main__":  # spawned workers import this file
    (task,) = sim_tasks(__import__("pathlib").Path(sys.argv[1]), seeds=(2,))
    task = dataclasses.replace(task, search={"name": "mbo", "budget": 120, "batch_size": 4})
    LAUNCHERS.build("process", config={"workers": 1}).run([task], listeners=[on_event])
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_end_when_the_main_process_is_killed(tmp_path):
    """A main process killed outright left its worker and event relay measuring into the journal."""
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux only")
    script = tmp_path / "killed_parent.py"
    script.write_text(_KILLED_PARENT)
    out = tmp_path / "out.txt"
    with out.open("w") as f:  # not a pipe: surviving children would hold it open
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "j.sqlite"), str(Path(__file__).parent)],
                              stdout=f, stderr=subprocess.STDOUT, timeout=300, cwd=ROOT)
    assert done.returncode == -signal.SIGKILL, out.read_text()[-2000:]
    pids = [int(p) for p in out.read_text().splitlines()[0].split()]
    assert len(pids) >= 2  # the worker and the event relay
    deadline = time.monotonic() + 10
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _running(p)]


def test_a_ray_cluster_none_of_whose_nodes_fits_a_group_is_refused_before_any_search(tmp_path, monkeypatch):
    """On several nodes a search's tensor-parallel group must fit on one: GPUs spread over nodes would
    leave it waiting forever. The refusal names the group and the largest node, and records nothing."""
    import types

    from kareus.errors import KareusError

    ran: list = []
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: True  # a cluster the program connected to itself
    fake.cluster_resources = lambda: {"CPU": 64.0, "GPU": 16.0}
    node = {"Alive": True, "Resources": {"CPU": 32.0, "GPU": 1.0}}
    fake.nodes = lambda: [node, node, {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0}}]
    fake.remote = lambda fn: ran.append(fn)
    monkeypatch.setitem(sys.modules, "ray", fake)
    tasks = [PartitionSearchTask(**{**t.__dict__, "hardware": {"name": "cuda"}}) for t in sim_tasks(tmp_path / "j.sqlite")]
    with pytest.raises(KareusError) as err:
        LAUNCHERS.build("ray", config={}).run(tasks)
    assert str(err.value) == ("launcher: a partition search needs a group of 2 rank(s) on one node (2 GPU(s), 1 CPU(s)), "
                              "but the largest node of the Ray cluster has 1 GPU(s) and 32 CPU(s); add a node that fits, "
                              "or lower launcher.cpus_per_task or launcher.gpus_per_task")
    assert ran == [] and not (tmp_path / "j.sqlite").exists()
    fake.nodes = lambda: [node, {"Alive": False}]  # one node alive: past the check, to the searches
    with pytest.raises(AttributeError, match="exceptions"):  # (which need more of Ray than this fake has)
        LAUNCHERS.build("ray", config={"gpus_per_task": 1}).run(tasks)


def test_a_failed_task_leaves_no_worker_dialing_the_stopped_event_relay(tmp_path, monkeypatch, capfd):
    """The relay stopped before the workers did: a worker that took a queued task in between dialed it
    and printed a multiprocessing traceback under the run's one error line. Widened here to a second."""
    import dataclasses

    import kareus.launch.launchers as launchers
    from kareus.registry import UnknownComponentError

    stop = launchers._stop_manager

    def slow_stop(manager):
        stop(manager)
        time.sleep(1.0)

    monkeypatch.setattr(launchers, "_stop_manager", slow_stop)
    quick = {"name": "random", "budget": 2}
    bad, good = sim_tasks(tmp_path / "j.sqlite")
    bad = dataclasses.replace(bad, search={"name": "nope"})
    tasks = [bad, dataclasses.replace(good, search={"name": "mbo", "budget": 60, "batch_size": 4})]
    tasks += [dataclasses.replace(good, search=quick, seed=s) for s in range(6)]
    with pytest.raises(UnknownComponentError):
        LAUNCHERS.build("process", config={"workers": 2}).run(tasks, listeners=[lambda event: None])
    assert "Traceback" not in capfd.readouterr().err


def test_a_sigterm_ray_took_during_its_start_ends_through_the_programs_handler():
    """Ray's Python handler, installed inside ray.init, turns a SIGTERM into sys.exit(15): exit 15, no
    resume line. The block hands it to the handler it found instead."""
    from kareus.launch.launchers import _python_signal_handlers_kept

    class Stopped(Exception):
        pass

    def programs_own(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, programs_own)
    try:
        with pytest.raises(Stopped):
            with _python_signal_handlers_kept():
                signal.signal(signal.SIGTERM, lambda s, f: sys.exit(15))  # as Ray's own handler
                raise SystemExit(15)
        assert signal.getsignal(signal.SIGTERM) is programs_own
        with pytest.raises(SystemExit):  # any other exit passes through
            with _python_signal_handlers_kept():
                raise SystemExit(3)
    finally:
        signal.signal(signal.SIGTERM, previous)
