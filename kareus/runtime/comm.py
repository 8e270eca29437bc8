"""Comm backends: run one comm op (a collective of the other nanobatch) with a given SM count.

Registered in ``COMM_BACKENDS`` (config group ``runtime/comm``); built with
``COMM_BACKENDS.build(name, config=section)``. ``prepare(op, sms, device)`` allocates the message
buffers once and returns a launcher; calling it issues the collective on the current stream and
returns a handle to ``wait()`` on (or None when the call already ordered itself on the stream).

- ``nccl``: torch.distributed on NCCL; the SM count is the communicator's CTA count
  (``ProcessGroupNCCL.Options().config.min_ctas/max_ctas``), one process group per SM count, cached.
  Every rank of the default group must ask for the same SM counts in the same order (group creation
  is collective), which the lockstep profiling of a TP group does.
- ``gloo``: torch.distributed on CPU, for tests; the SM count is ignored, collectives run async.
- ``copy``: no process group: a device-local copy of the message bytes, the single-GPU stand-in for
  a comm kernel (memory-bound, on the side stream), on ``sms`` persistent blocks where Triton runs
  (``kareus.runtime.smcopy``), else a plain ``copy_`` that ignores the SM count.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kareus.registry import COMM_BACKENDS
from kareus.types import Collective, Op

Launch = Callable[[], Any]


class CommBackend(Protocol):
    name: str

    def prepare(self, op: Op, sms: int, device: Any) -> Callable[[], Any]: ...
    def world_size(self) -> int: ...
    def agree(self, value: int, device: Any) -> int:
        """The group's maximum of ``value`` (ranks must launch equally many collectives)."""


def _elements(nbytes: float, dtype: Any) -> int:
    return max(1, int(nbytes) // dtype.itemsize)


def _collective(op: Op) -> Collective:
    if op.collective is None:
        raise ValueError(f"comm op {op.name!r} names no collective")
    return Collective(op.collective)


class _DistBackend:
    """Shared collective launchers over a torch.distributed group (the group is backend-specific)."""

    name = "dist"
    async_op = False

    def __init__(self, dtype: str) -> None:
        from kareus.runtime.kernels import torch_dtype

        self.dtype = torch_dtype(dtype)

    def group(self, sms: int) -> Any:
        raise NotImplementedError

    def world_size(self) -> int:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"comm backend {self.name!r} needs an initialised torch.distributed process group "
                               "(torchrun, or init_process_group before building the hardware backend)")
        return dist.get_world_size()

    def agree(self, value: int, device: Any) -> int:
        """The largest ``value`` over the group: every rank must issue the same number of collectives."""
        import torch
        import torch.distributed as dist

        if self.world_size() == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def prepare(self, op: Op, sms: int, device: Any) -> "CommCall":
        import torch
        import torch.distributed as dist

        ws = self.world_size()
        group = self.group(int(sms))
        rank = dist.get_rank()
        n = _elements(op.message_bytes, self.dtype)
        kw = dict(device=device, dtype=self.dtype)
        coll = _collective(op)
        a = self.async_op
        mark = float(rank + 1)  # inputs hold rank + 1, so results are checkable and stay finite
        if coll is Collective.ALL_REDUCE:
            buf = torch.zeros(n, **kw)  # zeros: repeated in-place sums stay finite
            return CommCall(lambda: dist.all_reduce(buf, group=group, async_op=a), buf)
        if coll is Collective.ALL_GATHER:
            src, dst = torch.full((n,), mark, **kw), torch.empty(n * ws, **kw)
            return CommCall(lambda: dist.all_gather_into_tensor(dst, src, group=group, async_op=a), dst)
        if coll is Collective.REDUCE_SCATTER:
            src, dst = torch.full((n * ws,), mark, **kw), torch.empty(n, **kw)
            rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return CommCall(lambda: rs(dst, src, group=group, async_op=a), dst)
        # SEND_RECV: a ring exchange, as a pipeline stage sends to the next and receives from the last
        send, recv = torch.full((n,), mark, **kw), torch.empty(n, **kw)
        if ws == 1:
            return CommCall(lambda: recv.copy_(send), recv)
        me = dist.get_group_rank(group, rank)
        peer_next = dist.get_global_rank(group, (me + 1) % ws)
        peer_prev = dist.get_global_rank(group, (me - 1) % ws)

        def p2p() -> Any:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer_next, group),
                                            dist.P2POp(dist.irecv, recv, peer_prev, group)])
            return _Works(works)

        return CommCall(p2p, recv)


class CommCall:
    """A prepared comm launch; ``output`` is the buffer the collective writes (for checks)."""

    def __init__(self, launch: Launch, output: Any) -> None:
        self.launch = launch
        self.output = output

    def __call__(self) -> Any:
        return self.launch()


class _Works:
    """Waits on several works as one handle."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


@dataclass
class GlooConfig:
    name: str = "gloo"
    dtype: str = "float32"


@COMM_BACKENDS.register("gloo", GlooConfig)
class GlooBackend(_DistBackend):
    """CPU collectives over gloo (tests, CPU runs); comm SMs are ignored; collectives run async."""

    name = "gloo"
    async_op = True

    def __init__(self, cfg: GlooConfig) -> None:
        super().__init__(cfg.dtype)
        self.cfg = cfg
        self._group: Any = None

    def group(self, sms: int) -> Any:
        import torch.distributed as dist

        if self._group is None:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self._group


@dataclass
class NCCLConfig:
    name: str = "nccl"
    dtype: str = "bfloat16"
    exact_ctas: bool = True  # min_ctas = max_ctas = SMs (else only max_ctas: NCCL may use fewer)
    cga_cluster_size: int = 0  # 0 = NCCL's default
    high_priority_stream: bool = False


def nccl_options(sms: int, cfg: NCCLConfig) -> Any:
    """ProcessGroupNCCL options whose communicator uses exactly ``sms`` CTAs (one SM each).

    Returns None where this torch build exposes no per-communicator NCCL config; the caller then
    falls back to NCCL_MIN_CTAS / NCCL_MAX_CTAS, which NCCL reads once per process.
    """
    import torch.distributed as dist

    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    if pg_nccl is None:
        return None
    opts = pg_nccl.Options(is_high_priority_stream=cfg.high_priority_stream)
    config = getattr(opts, "config", None)
    if config is None or not hasattr(config, "max_ctas"):
        return None
    config.max_ctas = int(sms)
    if cfg.exact_ctas:
        config.min_ctas = int(sms)
    if cfg.cga_cluster_size > 0:
        config.cga_cluster_size = int(cfg.cga_cluster_size)
    return opts


@COMM_BACKENDS.register("nccl", NCCLConfig)
class NCCLBackend(_DistBackend):
    """GPU collectives over NCCL with the comm kernel's CTA (= SM) count fixed per process group."""

    name = "nccl"
    async_op = False  # ordered on the current (side) stream; the executor joins with an event

    def __init__(self, cfg: NCCLConfig) -> None:
        super().__init__(cfg.dtype)
        self.cfg = cfg
        self._groups: dict[int, Any] = {}
        self._env_sms: int | None = None

    def group(self, sms: int) -> Any:
        import torch.distributed as dist

        if sms <= 0:
            raise ValueError(f"comm SMs must be positive, got {sms}")
        hit = self._groups.get(sms)
        if hit is not None:
            return hit
        if not dist.is_nccl_available():
            raise RuntimeError("comm backend 'nccl' needs a torch build with NCCL (a CUDA build)")
        opts = nccl_options(sms, self.cfg)
        if opts is None:
            self._env_fallback(sms)
        self._groups[sms] = dist.new_group(backend="nccl", pg_options=opts)
        return self._groups[sms]

    def _env_fallback(self, sms: int) -> None:
        if self._env_sms is not None and self._env_sms != sms:
            raise RuntimeError(f"this torch build has no per-communicator NCCL config; NCCL_MIN/MAX_CTAS are "
                               f"read once per process, so only one SM count ({self._env_sms}) can be used, "
                               f"not {sms}")
        os.environ["NCCL_MAX_CTAS"] = str(sms)
        if self.cfg.exact_ctas:
            os.environ["NCCL_MIN_CTAS"] = str(sms)
        self._env_sms = sms


@dataclass
class CopyConfig:
    name: str = "copy"
    dtype: str = "bfloat16"
    passes: float = 1.0  # copies of the message bytes per launch (2 ~ a ring all-reduce's HBM traffic)
    kernel: str = "auto"  # auto: persistent Triton copy on `sms` blocks where it runs, else copy_ | sm | torch


@COMM_BACKENDS.register("copy", CopyConfig)
class CopyBackend:
    """Single-device stand-in for a comm kernel: copies the message bytes on ``sms`` persistent blocks."""

    name = "copy"

    def __init__(self, cfg: CopyConfig) -> None:
        from kareus.runtime.kernels import torch_dtype

        if cfg.kernel not in ("auto", "sm", "torch"):
            raise ValueError(f"copy.kernel must be auto, sm or torch, got {cfg.kernel!r}")
        self.cfg = cfg
        self.dtype = torch_dtype(cfg.dtype)
        self.kernel_used: str | None = None

    def world_size(self) -> int:
        return 1

    def agree(self, value: int, device: Any) -> int:
        return int(value)

    def prepare(self, op: Op, sms: int, device: Any) -> CommCall:
        import torch

        from kareus.runtime import smcopy

        n = _elements(op.message_bytes * max(self.cfg.passes, 1e-9), self.dtype)
        src = torch.ones(n, device=device, dtype=self.dtype)
        dst = torch.empty(n, device=device, dtype=self.dtype)
        use_sm = self.cfg.kernel == "sm" or (self.cfg.kernel == "auto" and smcopy.available(device)
                                             and n <= smcopy.MAX_ELEMENTS)
        self.kernel_used = "sm" if use_sm else "torch"
        if use_sm:
            return CommCall(lambda: smcopy.sm_copy(src, dst, sms), dst)
        return CommCall(lambda: dst.copy_(src), dst)
