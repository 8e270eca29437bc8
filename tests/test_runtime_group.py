"""A tensor-parallel group of two gloo ranks on the CPU, started the way torchrun starts one.

The backend starts torch.distributed from the environment, refuses a world that is not the op's
group, and every decision that changes how many collectives a rank issues is the group's: a bad or
failed read on one rank is retried by both, and a thermal anchor one GPU calls for is taken by both.
Every rank runs the search on the group's numbers (the same time and energy on each), and answers a
candidate from its journal only when every rank's journal holds it.
A rank that decided alone would wait forever in a collective its peer never joins, so the ranks run
under a deadline and a hang fails the test.
"""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")

DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Meter:
    """Energy windows of one rank; ``script`` says what each ``end()`` does (a number or an exception)."""

    name = "fake"

    def __init__(self, script: list, begin_script: list | None = None) -> None:
        self.script = list(script)
        self.begin_script = list(begin_script or [])  # what each begin() does: None, or an exception to raise

    def begin(self) -> None:
        action = self.begin_script.pop(0) if self.begin_script else None
        if action is not None:
            raise action

    def end(self) -> float:
        action = self.script.pop(0) if self.script else 5.0
        if isinstance(action, Exception):
            raise action
        return float(action)


class _FlakyTemperature:
    """NVML of a CPU rank: temperatures only, the first read failing where asked."""

    def __init__(self, fail_first: bool) -> None:
        self.fail = fail_first

    def temperature_c(self) -> float:
        if self.fail:
            self.fail = False
            raise OSError("NVML_ERROR_UNKNOWN")
        return 50.0

    def sm_clock_mhz(self) -> float:
        return 1410.0

    def close(self) -> None:
        pass


def _partition():
    from kareus.types import Collective, Direction, Link, PartitionType, Slot
    from kareus.workload.ops import comm, gemm

    ops = (gemm("a", 32, 32, 32), gemm("b", 32, 32, 32))
    return PartitionType("fwd_x", Direction.FWD, ops, comm("ag", Collective.ALL_GATHER, 4096, 2, Link.NVLINK),
                         (Slot("linear_0", (0,), "gemm"), Slot("linear_1", (1,), "gemm")))


def _profiler(backend, journal=None, emit=None, retries: int = 2, **parts):
    """A fast profiler over ``backend``; ``parts``: a ``frequency`` controller or ``cooldown`` policy."""
    from kareus.profiler import Profiler, ProfilerConfig

    cfg = ProfilerConfig(target_window_s=0.02, min_window_s=0.0, settle_s=0, warmup_runs=0, calibration_runs=1,
                         retries=retries, cooldown={"name": "none"}, frequency={"name": "sim"})
    return Profiler(cfg, backend, journal, emit, **parts)


def _scripted_lock(backend, fails):
    """A frequency controller whose lock raises ``fails(mhz)`` where that is an exception, else locks."""
    from kareus.profiler.frequency import FrequencyController

    class Scripted(FrequencyController):
        def set(self, mhz: int) -> None:
            err = fails(mhz)
            if err is not None:
                raise err
            backend.set_clock(mhz)
            self.locked = mhz

        def reset(self) -> None:
            self.locked = None

    return Scripted()


def _measure(backend, script: list, slot: str = "linear_1", begin_script: list | None = None) -> dict:
    from kareus.types import Candidate

    backend.energy = _Meter(script, begin_script)
    p = _partition()
    m = _profiler(backend).measure(p, Candidate(p.key, slot, 8, backend.gpu.max_mhz))
    return {"failed": m.failed, "flags": list(m.flags), "reads": len(m.readings), "time_s": m.time_s,
            "energy_j": m.energy_j, "executions": [r.executions for r in m.readings]}


def _resume(backend, rank: int, out_dir: str) -> dict:
    """Each rank's own journal; only rank 0's holds linear_0, both hold linear_1 (a crash between the
    two ranks' appends leaves journals like these)."""
    from kareus.profiler.journal import Journal
    from kareus.types import Candidate, Measurement

    p = _partition()
    mhz = backend.gpu.max_mhz
    journal = Journal.open(f"{out_dir}/journal_{rank}.sqlite", "h")
    for slot in ("linear_0", "linear_1") if rank == 0 else ("linear_1",):
        journal.append(Measurement(Candidate(p.key, slot, 8, mhz), 1.0, 300.0, 215.0, 85.0, 40.0, float(mhz), 1),
                       backend=backend.name, clock_mhz=mhz, gpu_temperature_c=40.0)
    backend.energy = _Meter([])
    events: list = []
    prof = _profiler(backend, journal, events.append)
    out = {slot: prof.measure(p, Candidate(p.key, slot, 8, mhz)).time_s for slot in ("linear_0", "linear_1")}
    journal.close()
    return {"cached": {e.measurement.candidate.slot: e.cached for e in events}, "time_s": out}


def _anchors(backend, rank: int) -> list[int]:
    """Two anchor decisions; before the second only rank 0's GPU has heated up."""
    from kareus.profiler.cooldown import ThermalCooldown, ThermalCooldownConfig

    backend.energy = _Meter([])
    backend._idle_c = 35.0
    temperature = {"c": 40.0}
    backend.temperature = lambda: temperature["c"]
    policy = ThermalCooldown(ThermalCooldownConfig(anchor_window_s=0.01))

    def read_ops_at(mhz, ops, window_s):
        return backend.measure_ops(ops, window_s)

    first = policy.before_window(backend, read_ops_at, 1005)  # no anchor yet: reference and 1005 MHz
    temperature["c"] = 80.0 if rank == 0 else 36.0  # rank 0 now 45 degrees above idle, rank 1 one
    second = policy.before_window(backend, read_ops_at, 1005)
    return [first, second, len(policy.anchors)]


def _compensated(backend, rank: int, out_dir: str, saved: bool) -> list:
    """A compensating cooldown: rank 0's GPU is still warm, rank 1's is cool. With ``saved``, only
    rank 0's journal holds the probe's fit (a crash between the ranks' commits leaves that)."""
    import json as _json

    from kareus.profiler.cooldown import CompensatedCooldown, CompensatedCooldownConfig
    from kareus.profiler.journal import Journal
    from kareus.types import Candidate

    backend.energy = _Meter([])
    backend._idle_c = 35.0
    backend.temperature = (lambda: 60.0) if rank == 0 else (lambda: 36.0)
    policy = CompensatedCooldown(CompensatedCooldownConfig(cycles=1, probe_idle_s=0.0, probe_windows=2,
                                                           probe_window_s=0.01))
    journal = Journal.open(f"{out_dir}/compensated_{saved}_{rank}.sqlite", "h")
    if saved and rank == 0:
        journal.set_meta(f"thermal:{backend.name}:CompensatedCooldown", _json.dumps({"tau_s": 25.0, "slopes": {"1410": 0.5}}))
    prof = _profiler(backend, journal)
    prof.cooldown = policy
    p = _partition()
    out = []
    for slot in ("linear_0", "linear_1"):
        m = prof.measure(p, Candidate(p.key, slot, 8, backend.gpu.max_mhz))
        out.append([m.failed, m.time_s, m.energy_j])
    journal.close()
    del backend.temperature
    return out


def _lock_refused(backend, rank: int) -> dict:
    """Rank 1's clock lock fails once (a transient NVML error), then is denied (no admin rights):
    the first fails the candidate on both ranks, the second stops the search on both."""
    from kareus.errors import KareusError
    from kareus.types import Candidate

    script = [RuntimeError("NVMLError_Unknown"), None,
              KareusError("profiler.frequency=nvml: locking GPU clocks needs admin rights")] if rank == 1 else []
    backend.energy = _Meter([])
    p = _partition()
    lock = _scripted_lock(backend, lambda mhz: script.pop(0) if script else None)
    prof = _profiler(backend, retries=0, frequency=lock)
    out: dict = {}
    for i, slot in enumerate(("linear_0", "linear_1")):
        m = prof.measure(p, Candidate(p.key, slot, 4 + i, backend.gpu.max_mhz))
        out[slot] = [m.failed, list(m.flags)[:1]]
    try:
        prof.measure(p, Candidate(p.key, "linear_0", 7, backend.gpu.max_mhz))
        out["stopped"] = ""
    except KareusError as e:
        out["stopped"] = str(e)
    return out


def _anchor_lock_refused(backend, rank: int) -> dict:
    """A thermal anchor at the reference clock whose lock fails on rank 1 alone (a transient NVML
    error): the anchor is skipped on both ranks, and the candidate is measured by both."""
    from kareus.profiler.cooldown import ThermalCooldown, ThermalCooldownConfig
    from kareus.types import Candidate

    ref, low = backend.gpu.max_mhz, backend.gpu.clocks()[len(backend.gpu.clocks()) // 2]
    once = [RuntimeError("NVMLError_Unknown")] if rank == 1 else []
    backend.energy = _Meter([])
    lock = _scripted_lock(backend, lambda mhz: once.pop() if once and mhz == ref else None)
    prof = _profiler(backend, retries=1, frequency=lock, cooldown=ThermalCooldown(ThermalCooldownConfig(anchor_window_s=0.01)))
    p = _partition()
    m = prof.measure(p, Candidate(p.key, "linear_0", 8, low))
    return {"failed": m.failed, "anchors": len(prof.cooldown.anchors), "at_candidates_clock": backend.clock() == low}

def _worker(rank: int, port: int, out_dir: str) -> None:
    from dataclasses import replace

    import torch.distributed as dist

    from kareus.runtime import CudaBackend, CudaConfig
    from kareus.runtime.comm import CommSetupError, GlooBackend, GlooConfig
    from kareus.types import Collective, Link
    from kareus.workload.ops import comm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    res: dict = {"before": dist.is_initialized()}
    backend = CudaBackend(CudaConfig(device="cpu", comm="gloo", energy="none", warmup=0), seed=rank)
    res.update(started=dist.is_initialized(), pg=dist.get_backend(), world=dist.get_world_size())
    op4 = comm("ar4", Collective.ALL_REDUCE, 64, 4, Link.NVLINK)  # a TP 4 op in a world of 2
    try:
        backend.comm.prepare(op4, 8, torch.device("cpu"))
        res["mismatch"] = ""
    except CommSetupError as e:
        res["mismatch"] = str(e)
    p2 = _partition()
    p4 = replace(p2, key="fwd_tp4", comm=op4)  # tensor and context parallel: comm groups of 4 and 2
    res["unmeasurable"] = backend.partition_problems([p2, p4])
    loose = GlooBackend(GlooConfig(check_group_size=False)).prepare(op4, 8, torch.device("cpu"))
    loose().wait()
    res["loose"] = sorted(set(loose.output.tolist()))
    # rank 1 reads a negative counter delta first (a wrap); the group must retry it together
    res["bad_read"] = _measure(backend, [-1.0] if rank == 1 else [])
    # rank 0's NVML read raises once: a read error on every rank, retried by both
    res["read_error"] = _measure(backend, [OSError("NVML_ERROR_UNKNOWN")] if rank == 0 else [])
    # rank 1's meter cannot start a window once: it still runs the window's collectives, and the whole
    # group retries it (it used to skip them, and the ranks' next collectives paired up wrongly)
    res["begin_error"] = _measure(backend, [], begin_script=[OSError("NVML_ERROR_GPU_IS_LOST")] if rank == 1 else [])
    res["agreed_after"] = backend._agree(100 + rank)
    # rank 0's temperature read fails once: the last reading stands in, and no rank leaves the group
    backend.nvml = _FlakyTemperature(fail_first=rank == 0)
    res["temperature_error"] = _measure(backend, [])
    backend.nvml = None
    # rank 1's reads are bad on every try: both ranks record the candidate as failed
    res["always_bad"] = _measure(backend, [0.0, 0.0, 0.0] if rank == 1 else [])
    res["anchors"] = _anchors(backend, rank)
    # each GPU reads its own energy; the search on every rank must see the same numbers
    res["own_energy"] = _measure(backend, [4.0 if rank == 0 else 6.0] * 8, slot="linear_0")
    res["resume"] = _resume(backend, rank, out_dir)
    res["compensated"] = _compensated(backend, rank, out_dir, saved=False)
    res["compensated_saved_on_one"] = _compensated(backend, rank, out_dir, saved=True)
    res["lock_refused"] = _lock_refused(backend, rank)
    res["anchor_lock_refused"] = _anchor_lock_refused(backend, rank)
    dist.barrier()  # both ranks get here only if neither waits in a collective the other skipped
    res["barrier"] = True
    backend.close()
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
    # leave without interpreter finalisation: gloo's threads and torch's at-exit teardown can abort
    # in either order there (rarely), after every result above is on disk
    os._exit(0)


def _run_ranks(worker, out, hung: str) -> list[dict]:
    """Two spawned ranks of ``worker(rank, port, out)``, each writing ``<out>/<rank>.json``; a rank
    still running after the deadline fails the test with ``hung``."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(_free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{hung} ({DEADLINE_S:.0f} s)")
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _run_ranks(_worker, tmp_path_factory.mktemp("group"),
                      "the group hung: its ranks disagreed on their collectives")


def test_the_backend_starts_torch_distributed_from_torchruns_environment(ranks):
    for r in ranks:
        assert not r["before"] and r["started"] and r["pg"] == "gloo" and r["world"] == 2
        assert r["barrier"]


def test_a_world_that_is_not_the_ops_group_is_a_configuration_error(ranks):
    for r in ranks:
        assert "all_reduce over 4 GPUs but torch.distributed has 2 ranks" in r["mismatch"]
        assert "--nproc-per-node=4" in r["mismatch"]
        assert r["loose"] == [0.0]  # check_group_size=False: the one-rank plumbing check's opt-out
        # found before any candidate: only the partition whose group is not the world
        [line] = r["unmeasurable"]
        assert line.startswith("partition fwd_tp4: comm op 'ar4' is a all_reduce over 4 GPUs but torch.distributed has 2")


def test_a_bad_read_on_one_rank_is_retried_by_the_whole_group(ranks):
    for r in ranks:
        assert not r["bad_read"]["failed"] and "retried:1" in r["bad_read"]["flags"]
        assert not r["read_error"]["failed"] and "retried:1" in r["read_error"]["flags"]


def test_a_meter_that_cannot_start_a_window_on_one_rank_is_retried_by_the_whole_group(ranks):
    for r in ranks:
        assert not r["begin_error"]["failed"] and "retried:1" in r["begin_error"]["flags"]
        assert r["agreed_after"] == 101  # the ranks' collectives still pair up


def test_a_failed_temperature_read_on_one_rank_neither_stops_it_nor_splits_the_group(ranks):
    assert [r["temperature_error"]["failed"] for r in ranks] == [False, False]
    assert ranks[0]["temperature_error"]["energy_j"] == ranks[1]["temperature_error"]["energy_j"]


def test_reads_bad_on_one_rank_fail_the_candidate_on_every_rank(ranks):
    r0, r1 = ranks
    assert r0["always_bad"]["failed"] and r1["always_bad"]["failed"]
    assert r0["always_bad"]["reads"] == r1["always_bad"]["reads"] == 3
    assert "another rank of the group read an invalid window" in r0["always_bad"]["flags"][0]
    assert "bad energy" in r1["always_bad"]["flags"][0]


def test_an_anchor_one_gpu_calls_for_is_taken_by_the_whole_group(ranks):
    assert ranks[0]["anchors"] == ranks[1]["anchors"] == [2, 1, 3]


def test_every_rank_measures_the_groups_numbers(ranks):
    r0, r1 = ranks
    a, b = r0["own_energy"], r1["own_energy"]
    assert not a["failed"] and not b["failed"]
    assert (a["time_s"], a["energy_j"]) == (b["time_s"], b["energy_j"])
    # the ranks' mean window energy (4 J and 6 J) per execution
    assert a["energy_j"] == pytest.approx(5.0 / a["executions"][0])


def test_a_candidate_one_ranks_journal_lacks_is_measured_again_by_the_whole_group(ranks):
    r0, r1 = ranks
    assert r0["resume"]["cached"] == r1["resume"]["cached"] == {"linear_0": False, "linear_1": True}
    assert r0["resume"]["time_s"]["linear_0"] == r1["resume"]["time_s"]["linear_0"] != 1.0
    assert r0["resume"]["time_s"]["linear_1"] == r1["resume"]["time_s"]["linear_1"] == 1.0


def test_a_heat_correction_is_the_groups_so_every_rank_records_the_same_energy(ranks):
    r0, r1 = ranks
    assert r0["compensated"] == r1["compensated"]
    assert not any(failed for failed, _t, _e in r0["compensated"])


def test_a_thermal_fit_one_ranks_journal_lacks_is_probed_again_by_the_whole_group(ranks):
    r0, r1 = ranks
    assert r0["compensated_saved_on_one"] == r1["compensated_saved_on_one"]


def test_a_clock_lock_one_rank_cannot_take_fails_or_stops_the_whole_group(ranks):
    r0, r1 = ranks
    assert r0["lock_refused"]["linear_0"][0] and r1["lock_refused"]["linear_0"][0]  # failed on both
    assert r0["lock_refused"]["linear_0"][1] == ["clock: another rank of the group failed here"]
    assert r1["lock_refused"]["linear_0"][1] == ["clock: RuntimeError: NVMLError_Unknown"]
    assert not r0["lock_refused"]["linear_1"][0] and not r1["lock_refused"]["linear_1"][0]  # in step again
    assert "needs admin rights" in r1["lock_refused"]["stopped"]
    assert "another rank of the group stopped on a configuration error (clock)" in r0["lock_refused"]["stopped"]


def test_an_anchor_lock_one_rank_cannot_take_is_skipped_by_the_whole_group(ranks):
    a, b = ranks[0]["anchor_lock_refused"], ranks[1]["anchor_lock_refused"]
    assert a == b and not a["failed"]  # the same anchors on both ranks, and the candidate measured
    assert a["at_candidates_clock"]  # locked back to the candidate's clock on both


def _refusing_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank 1's GPU is not the one its config describes; both ranks record how they stopped."""
    from kareus.errors import KareusError
    from kareus.runtime import CudaBackend, CudaConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    if rank == 1:  # what the check says on a GPU of another model
        CudaBackend._gpu_problem = lambda self, index: "hardware.gpu: A100-SXM4-40GB, but this GPU is an H200"
    try:
        CudaBackend(CudaConfig(device="cpu", comm="gloo", energy="none", warmup=0), seed=rank)
        stopped = ""
    except KareusError as e:
        stopped = str(e)
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump({"stopped": stopped}, f)
    os._exit(0)


def test_a_gpu_one_rank_refuses_stops_every_rank_with_one_line(tmp_path):
    """The refused rank stopping alone, before the process group, left its peer waiting there."""
    r0, r1 = (r["stopped"] for r in _run_ranks(_refusing_worker, tmp_path, "a rank waited for a peer that had stopped"))
    assert r1 == "hardware.gpu: A100-SXM4-40GB, but this GPU is an H200"
    assert r0.startswith("another rank of the group refused its GPU") and "\n" not in r0
