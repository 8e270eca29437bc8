"""MSCCL++ collectives, whose thread-block (= SM) count is an argument of every launch.

NCCL fixes a communicator's CTA count when the communicator is made, so the ``nccl`` comm backend keeps
one communicator per SM count. MSCCL++'s built-in algorithms (``mscclpp.ext.AlgorithmCollectionBuilder
.build_default_algorithms``) take ``nblocks`` per call instead, so one MSCCL++ communicator over the
tensor-parallel group serves every SM count a plan names.

Algorithm choice is ours, not MSCCL++'s selector (which runs only behind its NCCL shim): an all-reduce of
at most ``small_bytes`` runs ``allreduce_small`` (a packet algorithm: low latency), a larger one
``allreduce_large``; an all-gather runs ``allgather``. These defaults follow MSCCL++'s own selector on
GPUs without NVLink SHARP and are assumptions, not measurements; set them per cluster. The built-in
algorithms include no reduce-scatter, so sequence-parallel layouts are refused with one line.

Every algorithm ignores ``nblocks`` unless ``nthreads_per_block`` is set too, so both are always passed.
The package is imported lazily: without it, the backend and ``train.comm=mscclpp`` are refused with one
line at config validation.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from kareus.registry import COMM_BACKENDS
from kareus.runtime.comm import CommCall, CommSetupError, _DistBackend, _collective, _elements
from kareus.types import Collective, Op

# the collectives MSCCL++'s built-in algorithms implement, by the executor's and the workload's names
SUPPORTED = {"all_reduce": "allreduce", "all_gather": "allgather"}


def mscclpp_problem(key: str) -> str:
    """One line naming ``key`` when mscclpp cannot be imported here, else ""."""
    if importlib.util.find_spec("mscclpp") is not None:
        return ""
    return (f"{key}: mscclpp is not importable here (build MSCCL++ with its Python package for this CUDA "
            f"and torch, see docs/runtime.md); use nccl")


def sequence_parallel_problem(key: str, sequence_parallel: bool) -> str:
    """One line naming ``key`` when the layout needs a reduce-scatter MSCCL++'s algorithms lack, else ""."""
    if not sequence_parallel:
        return ""
    return (f"{key}: mscclpp's built-in algorithms have no reduce-scatter, which sequence parallelism needs; "
            "use nccl, or parallel.sequence_parallel=false")


@dataclass
class MscclppConfig:
    name: str = "mscclpp"
    dtype: str = "bfloat16"
    scratch_mib: int = 128  # the algorithms' scratch buffer; a message larger than it is refused
    small_bytes: int = 1 << 20  # all-reduces up to this size run allreduce_small, larger ones allreduce_large
    allreduce_small: str = "default_allreduce_packet"
    allreduce_large: str = "default_allreduce_rsag"
    allgather: str = "default_allgather_fullmesh2"
    threads_per_block: int = 1024  # with nblocks; 0 would let each algorithm pick both (ignoring the SM count)


class MscclppCollectives:
    """One MSCCL++ communicator over a torch.distributed group and the built-in algorithms on it."""

    def __init__(self, group: Any, cfg: MscclppConfig, device: Any) -> None:
        import mscclpp
        import mscclpp.ext
        import torch
        import torch.utils.dlpack
        from mscclpp.utils import torch_dtype_to_mscclpp_dtype

        self.cfg = cfg
        self.device = device
        self.group = mscclpp.CommGroup(torch_group=group)
        raw = mscclpp.RawGpuBuffer(int(cfg.scratch_mib) << 20)
        self.scratch = torch.utils.dlpack.from_dlpack(raw.to_dlpack(data_type=str(torch.uint8)))
        algos = mscclpp.ext.AlgorithmCollectionBuilder().build_default_algorithms(
            scratch_buffer=self.scratch.data_ptr(), scratch_buffer_size=self.scratch.nbytes, rank=self.group.my_rank)
        self.algorithms = {(a.collective, a.name): a for a in algos}
        for collective, name in ((SUPPORTED["all_reduce"], cfg.allreduce_small),
                                 (SUPPORTED["all_reduce"], cfg.allreduce_large),
                                 (SUPPORTED["all_gather"], cfg.allgather)):
            if (collective, name) not in self.algorithms:
                known = sorted(n for c, n in self.algorithms if c == collective)
                raise CommSetupError(f"comm=mscclpp: no {collective} algorithm {name!r} in this MSCCL++ build; "
                                     f"it has: {', '.join(known)}")
        self._dtype = torch_dtype_to_mscclpp_dtype
        self._sum = mscclpp.ReduceOp.SUM
        self._nop = mscclpp.ReduceOp.NOP

    def algorithm_name(self, kind: str, nbytes: int) -> str:
        """Which configured algorithm runs a ``kind`` collective of ``nbytes`` (see the module doc)."""
        if kind == "all_reduce":
            return self.cfg.allreduce_small if nbytes <= self.cfg.small_bytes else self.cfg.allreduce_large
        if kind == "all_gather":
            return self.cfg.allgather
        raise CommSetupError(f"comm=mscclpp: no built-in algorithm for {kind}; use nccl")

    def launch(self, kind: str, src: Any, dst: Any, sms: int | None) -> None:
        """Launch ``kind`` from ``src`` into ``dst`` on the current stream with ``sms`` blocks (None: the
        algorithm's own count). Raises on a non-zero MSCCL++ result."""
        import torch

        if src.nbytes > self.scratch.nbytes:
            raise CommSetupError(f"comm=mscclpp: a {src.nbytes}-byte message exceeds the {self.cfg.scratch_mib} MiB "
                                 "scratch buffer; raise scratch_mib")
        name = self.algorithm_name(kind, src.nbytes)
        algo = self.algorithms[(SUPPORTED[kind], name)]
        blocks, threads = (0, 0) if sms is None else (int(sms), int(self.cfg.threads_per_block))
        cuda = getattr(self.device, "type", str(self.device)) == "cuda"
        stream = torch.cuda.current_stream(self.device).cuda_stream if cuda else 0
        rc = algo.execute(comm=self.group.communicator, input_buffer=src.data_ptr(), output_buffer=dst.data_ptr(),
                          input_size=src.nbytes, output_size=dst.nbytes, dtype=self._dtype(src.dtype),
                          op=self._sum if kind == "all_reduce" else self._nop,
                          stream=stream,
                          nblocks=blocks, nthreads_per_block=threads)
        if rc != 0:
            raise RuntimeError(f"mscclpp {name} ({kind}, {src.nbytes} bytes, {blocks} blocks) returned {rc}")

    def issue(self, kind: str, tensor: Any, sms: int | None) -> tuple[None, Any]:
        """The executor's collective along the sequence dimension, ordered on the current stream:
        (no work to wait on, the result)."""
        t = tensor.contiguous()
        if kind == "all_reduce":
            self.launch(kind, t, t, sms)
            return None, t
        if kind == "all_gather":
            out = t.new_empty((t.shape[0] * self.group.nranks, *t.shape[1:]))
            self.launch(kind, t, out, sms)
            return None, out
        raise CommSetupError(sequence_parallel_problem("comm", True) or f"comm=mscclpp: no algorithm for {kind}")


@COMM_BACKENDS.register("mscclpp", MscclppConfig)
class MscclppBackend(_DistBackend):
    """Profiling's comm op on MSCCL++: the candidate's SM count is the launch's block count.

    torch.distributed (started by torchrun) bootstraps the MSCCL++ communicator and carries the
    lockstep agreements (``agree``/``gather``); the measured collective itself is MSCCL++'s."""

    name = "mscclpp"
    async_op = False

    def __init__(self, cfg: MscclppConfig) -> None:
        super().__init__(cfg.dtype, True)
        self.cfg = cfg
        self._collectives: MscclppCollectives | None = None

    def check_ready(self, device: Any) -> None:
        problem = mscclpp_problem("hardware.comm")
        if problem:
            raise CommSetupError(problem)
        if getattr(device, "type", str(device)) != "cuda":
            raise CommSetupError("hardware.comm=mscclpp runs on GPUs only; use hardware.comm=gloo with hardware.device=cpu")
        super().check_ready(device)

    def collectives(self, device: Any) -> MscclppCollectives:
        import torch.distributed as dist

        if self._collectives is None:
            self._collectives = MscclppCollectives(dist.group.WORLD, self.cfg, device)
        return self._collectives

    def prepare(self, op: Op, sms: int, device: Any) -> CommCall:
        import torch

        ws = self.world_size()
        self.check_world(op, ws)
        coll = _collective(op)
        kind = {Collective.ALL_REDUCE: "all_reduce", Collective.ALL_GATHER: "all_gather"}.get(coll)
        if kind is None:
            raise CommSetupError(f"hardware.comm=mscclpp: comm op {op.name!r} is a {coll.value}, which MSCCL++'s "
                                 "built-in algorithms do not implement; use hardware.comm=nccl")
        n = _elements(op.message_bytes, self.dtype)
        coll_ops = self.collectives(device)
        src = torch.zeros(n, device=device, dtype=self.dtype)  # zeros: repeated in-place sums stay finite
        dst = src if kind == "all_reduce" else torch.empty(n * ws, device=device, dtype=self.dtype)
        return CommCall(lambda: coll_ops.launch(kind, src, dst, int(sms)), dst)

    def close(self) -> None:
        self._collectives = None


def mscclpp_issue(group: Any, device: Any, cfg: MscclppConfig | None = None) -> Any:
    """An issue function for ``CommIssuer``: the TP group's collectives on one MSCCL++ communicator."""
    coll = MscclppCollectives(group, cfg or MscclppConfig(), device)
    return coll.issue

