"""The mscclpp comm option: refused with one line where mscclpp is absent or cannot run the layout, and,
against a recording stand-in of mscclpp's Python API on the CPU, the plan's SM count reaches every
launch as its block count with the configured algorithm for the collective and message size."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest

from test_validate import problems

torch = pytest.importorskip("torch")

from kareus.runtime.comm import CommSetupError  # noqa: E402
from kareus.runtime.mscclpp_comm import MscclppCollectives, MscclppConfig, mscclpp_problem  # noqa: E402


class _Algo:
    def __init__(self, collective: str, name: str, calls: list) -> None:
        self.collective, self.name, self.calls = collective, name, calls

    def execute(self, **kw) -> int:
        self.calls.append((self.name, kw["nblocks"], kw["nthreads_per_block"], kw["input_size"], kw["op"]))
        return 0


def _fake_mscclpp(names: list[tuple[str, str]], calls: list) -> types.ModuleType:
    mod = types.ModuleType("mscclpp")
    mod.__spec__ = importlib.machinery.ModuleSpec("mscclpp", None)
    ext, utils = types.ModuleType("mscclpp.ext"), types.ModuleType("mscclpp.utils")

    class CommGroup:
        def __init__(self, torch_group=None):
            self.my_rank, self.nranks, self.communicator = 0, 1, object()

    class RawGpuBuffer:
        def __init__(self, nbytes: int):
            self.t = torch.zeros(nbytes, dtype=torch.uint8)

        def to_dlpack(self, data_type: str):
            return torch.utils.dlpack.to_dlpack(self.t)

    class Builder:
        def build_default_algorithms(self, scratch_buffer, scratch_buffer_size, rank):
            return [_Algo(c, n, calls) for c, n in names]

    mod.CommGroup, mod.RawGpuBuffer = CommGroup, RawGpuBuffer
    mod.ReduceOp = types.SimpleNamespace(SUM="sum", NOP="nop")
    ext.AlgorithmCollectionBuilder = Builder
    utils.torch_dtype_to_mscclpp_dtype = lambda dtype: str(dtype)
    mod.ext, mod.utils = ext, utils
    return mod


DEFAULTS = [("allreduce", "default_allreduce_packet"), ("allreduce", "default_allreduce_rsag"),
            ("allgather", "default_allgather_fullmesh2")]


@pytest.fixture
def fake(monkeypatch):
    calls: list = []

    def install(names=DEFAULTS):
        mod = _fake_mscclpp(names, calls)
        for name, m in (("mscclpp", mod), ("mscclpp.ext", mod.ext), ("mscclpp.utils", mod.utils)):
            monkeypatch.setitem(sys.modules, name, m)
        return calls

    return install


def test_without_mscclpp_each_key_is_refused_with_one_line():
    if importlib.util.find_spec("mscclpp") is not None:
        pytest.skip("mscclpp is installed here")
    line = ("train.comm: mscclpp is not importable here (build MSCCL++ with its Python package for this CUDA and "
            "torch, see docs/runtime.md); use nccl")
    assert problems("train.comm=mscclpp") == [line]
    assert problems("train.comm=gloo") == ["train.comm: must be one of nccl, mscclpp, got 'gloo'"]


def test_sequence_parallel_needs_a_reduce_scatter_mscclpp_lacks(fake):
    fake()
    got = problems("train.comm=mscclpp", "parallel.sequence_parallel=true")
    assert got == ["train.comm: mscclpp's built-in algorithms have no reduce-scatter, which sequence parallelism "
                   "needs; use nccl, or parallel.sequence_parallel=false"]
    assert problems("train.comm=mscclpp") == []


def test_the_sm_count_is_each_launch_block_count_with_the_configured_algorithm(fake):
    calls = fake()
    coll = MscclppCollectives(None, MscclppConfig(small_bytes=4096, threads_per_block=512), torch.device("cpu"))
    small = torch.ones(256, dtype=torch.float32)  # 1 KiB
    large = torch.ones(4096, dtype=torch.float32)  # 16 KiB
    work, out = coll.issue("all_reduce", small, 8)
    assert work is None and out.data_ptr() == small.data_ptr()  # in place, ordered on the stream
    coll.issue("all_reduce", large, 20)
    coll.issue("all_reduce", large, None)
    _, gathered = coll.issue("all_gather", small.view(16, 16), 4)
    assert gathered.shape == (16, 16)  # one rank
    assert calls == [("default_allreduce_packet", 8, 512, 1024, "sum"),
                     ("default_allreduce_rsag", 20, 512, 16384, "sum"),
                     ("default_allreduce_rsag", 0, 0, 16384, "sum"),  # the library's own count
                     ("default_allgather_fullmesh2", 4, 512, 1024, "nop")]


def test_a_reduce_scatter_or_a_message_over_the_scratch_is_refused(fake):
    fake()
    coll = MscclppCollectives(None, MscclppConfig(scratch_mib=1), torch.device("cpu"))
    with pytest.raises(CommSetupError, match="no reduce-scatter"):
        coll.issue("reduce_scatter", torch.ones(8), 4)
    with pytest.raises(CommSetupError, match="exceeds the 1 MiB scratch buffer"):
        coll.issue("all_reduce", torch.ones((1 << 20) // 4 + 1), 4)


def test_an_algorithm_this_build_lacks_is_named_with_the_ones_it_has(fake):
    fake(DEFAULTS[:1] + DEFAULTS[2:])
    with pytest.raises(CommSetupError) as err:
        MscclppCollectives(None, MscclppConfig(), torch.device("cpu"))
    assert str(err.value) == ("comm=mscclpp: no allreduce algorithm 'default_allreduce_rsag' in this MSCCL++ build; "
                              "it has: default_allreduce_packet")


def test_a_failed_launch_raises_with_the_algorithm_and_result(fake):
    calls = fake()
    coll = MscclppCollectives(None, MscclppConfig(), torch.device("cpu"))
    coll.algorithms[("allreduce", "default_allreduce_packet")].execute = lambda **kw: 3
    with pytest.raises(RuntimeError, match=r"default_allreduce_packet \(all_reduce, 32 bytes, 2 blocks\) returned 3"):
        coll.issue("all_reduce", torch.ones(8), 2)
    assert calls == []


def test_profiling_with_mscclpp_refuses_a_sequence_parallel_layout(fake):
    fake()
    got = problems("hardware=h100_cuda", "profiler/frequency=nvml", "hardware.comm=mscclpp",
                   "parallel.sequence_parallel=true")
    assert got == ["hardware.comm: mscclpp's built-in algorithms have no reduce-scatter, which sequence "
                   "parallelism needs; use nccl, or parallel.sequence_parallel=false"]
    assert problems("hardware=h100_cuda", "profiler/frequency=nvml", "hardware.comm=mscclpp") == []
