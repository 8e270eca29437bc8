"""Comm backends in a real 2-process gloo group on the CPU (127.0.0.1, a free port)."""
from __future__ import annotations

import json
import socket

import pytest

torch = pytest.importorskip("torch")

from kareus.types import Collective, Link  # noqa: E402
from kareus.workload.ops import comm  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from kareus.registry import COMM_BACKENDS
    from kareus.runtime import CudaBackend, CudaConfig
    from kareus.types import Candidate, Direction, PartitionType, Slot
    from kareus.workload.ops import gemm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        backend = COMM_BACKENDS.build("gloo")
        res: dict = {"world": backend.world_size()}
        for coll in Collective:
            call = backend.prepare(comm("c", coll, 64, 2, Link.NVLINK), 8, torch.device("cpu"))
            h = call()
            if h is not None:
                h.wait()
            res[coll.value] = sorted(set(call.output.tolist()))
            res[coll.value + "_numel"] = call.output.numel()
        # a partition whose comm is a real async all-gather, joined after the chain
        ops = (gemm("a", 32, 32, 32), gemm("b", 32, 32, 32))
        p = PartitionType("fwd_x", Direction.FWD, ops, comm("ag", Collective.ALL_GATHER, 4096, 2, Link.NVLINK),
                          (Slot("linear_0", (0,), "gemm"), Slot("linear_1", (1,), "gemm")))
        hw = CudaBackend(CudaConfig(device="cpu", comm="gloo", warmup=1), seed=rank)
        hw.run_partition(p, "linear_1", 8)
        res["partition_gather"] = sorted(set(hw.comm_launch(p, 8).output.tolist()))
        # rank 1 asks for a longer window: both must agree on the execution count or the group hangs
        r = hw.measure(p, Candidate(p.key, "linear_1", 8, hw.gpu.max_mhz), 0.01 if rank == 0 else 0.05)
        res["executions"] = r.executions
        res["reading_ok"] = r.ok
        res["time_s"] = r.time_s
        res["layer"] = _layer_partition(rank)
        with open(f"{out_dir}/{rank}.json", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _layer_partition(rank: int) -> dict:
    """A real partition of a tp 2 layout on each rank's megatron-core layer, its all-reduce over the two
    ranks: megatron's parallel state is made over the existing world, and only it is undone on close."""
    import torch.distributed as dist

    import kareus.partition  # noqa: F401  (registers the partitioners)
    from kareus.registry import PARTITIONERS
    from kareus.runtime import CudaBackend, CudaConfig
    from kareus.runtime.backend import with_layout
    from kareus.types import Candidate, ModelSpec, ParallelSpec
    from kareus.workload import build_workload

    model = ModelSpec("layer-bench", 4, 64, 128, 4, 2, 16, 128)
    parallel = ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=16)
    p = PARTITIONERS.build("nanobatch", config={}).partition(build_workload(model, parallel)).type("fwd_attn")
    hw = CudaBackend(with_layout(CudaConfig(device="cpu", comm="gloo", warmup=1, dtype="float32"), model, parallel),
                     seed=rank)
    try:
        hw.run_partition(p, "attn_0", 8)
        r = hw.measure(p, Candidate(p.key, "attn_0", 8, hw.gpu.max_mhz), 0.01 if rank == 0 else 0.03)
        reduced = sorted(set(hw.comm_launch(p, 8).output.tolist()))
        return {"kernels": len(hw.compute_kernels(p)), "ops": len(p.compute), "executions": r.executions,
                "time_s": r.time_s, "reduced": reduced, "finite": bool(hw.layer_bench().output.isfinite().all())}
    finally:
        hw.close()
        assert dist.is_initialized() and dist.get_world_size() == 2  # the test's own group stays


def test_gloo_collectives_and_partition_in_two_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    n = 64 // 4  # float32 elements in a 64-byte message
    for rank, r in ((0, r0), (1, r1)):
        assert r["world"] == 2
        assert r["all_reduce"] == [0.0] and r["all_reduce_numel"] == n  # zeros stay finite when repeated
        assert r["all_gather"] == [1.0, 2.0] and r["all_gather_numel"] == 2 * n  # each rank's shard (rank + 1)
        assert r["reduce_scatter"] == [3.0] and r["reduce_scatter_numel"] == n  # 1 + 2
        assert r["send_recv"] == [float(2 - rank)]  # the previous rank's mark (a ring of two)
        assert r["partition_gather"] == [1.0, 2.0]
        assert not r["reading_ok"] and r["time_s"] > 0
    assert r0["executions"] == r1["executions"] >= 1
    for r in (r0, r1):  # the comm beside the megatron-core layer's chain: the same collectives on both ranks
        lay = r["layer"]
        assert lay["kernels"] == lay["ops"] == 6 and lay["time_s"] > 0 and lay["finite"]
    assert r0["layer"]["executions"] == r1["layer"]["executions"] >= 1


def test_nccl_options_carry_the_sm_count_as_ctas():
    from kareus.runtime.comm import NCCLConfig, nccl_options

    import torch.distributed as dist

    opts = nccl_options(12, NCCLConfig())
    if getattr(dist, "ProcessGroupNCCL", None) is None:
        assert opts is None  # a CPU build: no NCCL, the backend says so when asked for a group
        return
    assert opts.config.max_ctas == 12 and opts.config.min_ctas == 12


def test_nccl_without_nccl_or_a_group_fails_clearly():
    import torch.distributed as dist

    from kareus.registry import COMM_BACKENDS

    b = COMM_BACKENDS.build("nccl", config={"exact_ctas": True})
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            b.prepare(comm("ar", Collective.ALL_REDUCE, 64, 2, Link.NVLINK), 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="positive"):
        b.group(0)


def test_copy_backend_is_a_local_stand_in():
    from kareus.registry import COMM_BACKENDS

    b = COMM_BACKENDS.build("copy", config={"passes": 2.0})
    call = b.prepare(comm("ar", Collective.ALL_REDUCE, 1024, 8, Link.NVLINK), 8, torch.device("cpu"))
    call()
    assert b.world_size() == 1 and b.agree(7, None) == 7
    assert call.output.numel() == 1024  # 2 passes of 1024 bytes in 2-byte elements
    assert set(call.output.tolist()) == {1.0}


def test_sm_limited_copy_moves_every_element_with_few_programs(monkeypatch):
    pytest.importorskip("triton")
    from kareus.runtime import smcopy

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter runs the kernel on CPU tensors
    monkeypatch.setattr(smcopy, "_KERNEL", None)  # decorate under the interpreter
    monkeypatch.setattr(smcopy, "BLOCK", 256)
    src = torch.arange(5000, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)
    try:
        smcopy.sm_copy(src, dst, 3)  # 3 programs stride over 20 blocks, the last one partial
    except Exception as e:
        if device.type == "cpu" and "only 0-dimensional arrays" in str(e):
            # Triton 3.6's interpreter turns a loop bound into an int through a 1-element array, which
            # numpy 2.4+ refuses; the compiled kernel is unaffected (run on a GPU)
            pytest.skip("Triton's CPU interpreter fails with this numpy (int() of a 1-element array)")
        raise
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(src, dst)
    assert smcopy.available(device)
    with pytest.raises(ValueError, match="equal sizes"):
        smcopy.sm_copy(src, dst[:10], 3)
    monkeypatch.setattr(smcopy, "_KERNEL", None)  # leave no interpreted kernel behind


def test_copy_backend_falls_back_to_copy_on_the_cpu(monkeypatch):
    from kareus.registry import COMM_BACKENDS

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b = COMM_BACKENDS.build("copy")
    b.prepare(comm("ar", Collective.ALL_REDUCE, 1024, 8, Link.NVLINK), 8, torch.device("cpu"))()
    assert b.kernel_used == "torch"
    with pytest.raises(ValueError, match="copy.kernel"):
        COMM_BACKENDS.build("copy", config={"kernel": "nope"})
