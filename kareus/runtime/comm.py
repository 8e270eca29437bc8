"""Comm backends: run one comm op (a collective of the other nanobatch) with a given SM count.

Registered in ``COMM_BACKENDS`` (config group ``runtime/comm``); built with
``COMM_BACKENDS.build(name, config=section)``. ``prepare(op, sms, device)`` allocates the message
buffers once and returns a launcher; calling it issues the collective on the current stream and
returns a handle to ``wait()`` on (or None when the call already ordered itself on the stream).

- ``nccl``: torch.distributed on NCCL; the SM count is the communicator's CTA count
  (``ProcessGroupNCCL.Options().config.min_ctas/max_ctas``), one process group per SM count, cached.
  Every rank of the default group must ask for the same SM counts in the same order (group creation
  is collective), which the lockstep profiling of a TP group does; ``close()`` destroys them.
- ``gloo``: torch.distributed on CPU, for tests; the SM count is ignored, collectives run async.
- ``copy``: no process group: a device-local copy of the message bytes, the single-GPU stand-in for
  a comm kernel (memory-bound, on the side stream), on ``sms`` persistent blocks where Triton runs
  (``kareus.runtime.smcopy``), else a plain ``copy_`` that ignores the SM count.

The torch.distributed backends size each collective by the world size, so the world must be the
op's group (one process per GPU of the tensor-parallel group): ``init_process_group_from_env``
starts that world from torchrun's environment, and a missing or mismatched world raises
``CommSetupError``, a configuration error that stops the search at once.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from kareus.errors import KareusError
from kareus.registry import COMM_BACKENDS
from kareus.types import Collective, Op

Launch = Callable[[], Any]


class CommBackend(Protocol):
    name: str

    def prepare(self, op: Op, sms: int, device: Any) -> Callable[[], Any]: ...
    def world_size(self) -> int: ...
    def agree(self, value: int, device: Any) -> int:
        """The group's maximum of ``value`` (ranks must launch equally many collectives)."""
    def gather(self, values: Sequence[float], device: Any) -> list[list[float]]:
        """Every rank's ``values``, in rank order, on every rank."""


class CommSetupError(KareusError):
    """torch.distributed is missing, unusable or the wrong size for the comm op.

    A configuration error, not a failed candidate: every candidate would fail the same way, so the
    search stops at once with this one line instead of recording a crash per candidate.
    """


def init_process_group_from_env(device: Any) -> bool:
    """Start torch.distributed from torchrun's environment (WORLD_SIZE, RANK, MASTER_ADDR, ...) if unset.

    Returns whether this call started it. NCCL is bound to this rank's GPU (``device_id``: the
    communicator is created there, eagerly); gloo serves CPU runs. Without WORLD_SIZE nothing starts:
    the caller then reports how to launch. The group lives until the process exits.
    """
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return False
    if getattr(device, "type", str(device)) == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    atexit.register(_destroy_default_group)
    return True


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


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
    needs_process_group = True  # the hardware backend starts (or checks) torch.distributed first

    def __init__(self, dtype: str, check_group_size: bool = True) -> None:
        from kareus.runtime.kernels import torch_dtype

        self.dtype = torch_dtype(dtype)
        self.check_group_size = check_group_size

    def group(self, sms: int) -> Any:
        raise NotImplementedError

    def _pop_groups(self) -> list[Any]:
        """The process groups this backend created, forgotten here: ``close`` destroys them."""
        return []

    def check_ready(self, device: Any) -> None:
        """Raise CommSetupError unless collectives can run on ``device`` (called when measuring starts)."""
        self.world_size()

    def world_size(self) -> int:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise CommSetupError(
                f"hardware.comm={self.name} needs a torch.distributed process group: launch one process per GPU "
                "of the tensor-parallel group (torchrun --nproc-per-node=TP sets WORLD_SIZE), or call "
                "init_process_group before building the hardware backend; on one GPU use hardware.comm=copy")
        return dist.get_world_size()

    def check_world(self, op: Op, world: int) -> None:
        """Collectives are sized by the world, so it must be the op's group (a ring exchange fits any)."""
        if not self.check_group_size or _collective(op) is Collective.SEND_RECV or world == op.group_size:
            return
        raise CommSetupError(
            f"comm op {op.name!r} is a {_collective(op).value} over {op.group_size} GPUs but torch.distributed "
            f"has {world} ranks: run one process per GPU of the group (torchrun --nproc-per-node={op.group_size})")

    def close(self) -> None:
        """Destroy the groups this backend created: each NCCL communicator holds GPU memory and threads."""
        import torch.distributed as dist

        groups = self._pop_groups()
        if not groups or not dist.is_available() or not dist.is_initialized():
            return
        for g in groups:
            dist.destroy_process_group(g)

    def agree(self, value: int, device: Any) -> int:
        """The largest ``value`` over the group: every rank must issue the same number of collectives."""
        import torch
        import torch.distributed as dist

        if self.world_size() == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def gather(self, values: Sequence[float], device: Any) -> list[list[float]]:
        """Every rank's ``values`` in rank order: each rank then derives the same numbers from them."""
        import torch
        import torch.distributed as dist

        if self.world_size() == 1:
            return [[float(v) for v in values]]
        mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size())]
        dist.all_gather(parts, mine)
        return [[float(v) for v in part.tolist()] for part in parts]

    def prepare(self, op: Op, sms: int, device: Any) -> "CommCall":
        import torch
        import torch.distributed as dist

        ws = self.world_size()
        self.check_world(op, ws)
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
            ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name, else the old
            return CommCall(lambda: ag(dst, src, group=group, async_op=a), dst)
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
    check_group_size: bool = True  # the world must be the comm op's group (False: plumbing checks only)


@COMM_BACKENDS.register("gloo", GlooConfig)
class GlooBackend(_DistBackend):
    """CPU collectives over gloo (tests, CPU runs); comm SMs are ignored; collectives run async."""

    name = "gloo"
    async_op = True

    def __init__(self, cfg: GlooConfig) -> None:
        super().__init__(cfg.dtype, cfg.check_group_size)
        self.cfg = cfg
        self._group: Any = None
        self._owned = False

    def group(self, sms: int) -> Any:
        import torch.distributed as dist

        if self._group is None:
            self._owned = dist.get_backend() != "gloo"
            self._group = dist.new_group(backend="gloo") if self._owned else dist.group.WORLD
        return self._group

    def _pop_groups(self) -> list[Any]:
        groups = [self._group] if self._owned and self._group is not None else []  # WORLD is not ours
        self._group, self._owned = None, False
        return groups


@dataclass
class NCCLConfig:
    name: str = "nccl"
    dtype: str = "bfloat16"
    exact_ctas: bool = True  # min_ctas = max_ctas = SMs (else only max_ctas: NCCL may use fewer)
    cga_cluster_size: int = 0  # 0 = NCCL's default
    high_priority_stream: bool = False
    check_group_size: bool = True  # the world must be the comm op's group (False: a one-rank plumbing check)


# NCCL's environment knobs that bound a communicator's CTAs (channels), over its config
NCCL_CTA_ENV = ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")


def nccl_conf_files() -> list[Path]:
    """The files NCCL loads its environment from at start-up (a variable already set wins):
    ``$NCCL_CONF_FILE`` (NCCL 2.23+), ``~/.nccl.conf`` (earlier releases) and ``/etc/nccl.conf``."""
    out = [Path(os.environ["NCCL_CONF_FILE"])] if os.environ.get("NCCL_CONF_FILE") else []
    return out + [Path.home() / ".nccl.conf", Path("/etc/nccl.conf")]


def nccl_cta_overrides(files: Sequence[Path] | None = None) -> list[str]:
    """``KEY=VALUE (where)`` for each of NCCL_CTA_ENV set in the environment or in NCCL's config files."""
    out = [f"{k}={os.environ[k]} in the environment" for k in NCCL_CTA_ENV if k in os.environ]
    seen = {k for k in NCCL_CTA_ENV if k in os.environ}
    for path in nccl_conf_files() if files is None else files:
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):  # absent or unreadable: NCCL skips it too
            continue
        for line in lines:
            key, sep, value = line.strip().partition("=")
            key = key.strip()
            if sep and not key.startswith("#") and key in NCCL_CTA_ENV and key not in seen:
                seen.add(key)
                out.append(f"{key}={value.strip()} in {path}")
    return out


def nccl_options(sms: int, cfg: NCCLConfig) -> Any:
    """ProcessGroupNCCL options whose communicator uses exactly ``sms`` CTAs (one SM each).

    Returns None where this torch build exposes no per-communicator NCCL config (NCCL before 2.17,
    or torch without the binding): there the SM count cannot vary within a process, since NCCL reads
    its environment once, at the first communicator (torch creates the default one eagerly).
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
        super().__init__(cfg.dtype, cfg.check_group_size)
        self.cfg = cfg
        self._groups: dict[int, Any] = {}

    def check_ready(self, device: Any) -> None:
        import torch.distributed as dist

        overriding = nccl_cta_overrides()
        if overriding:  # NCCL lets them override every communicator's config: each SM count would run alike
            raise CommSetupError(f"hardware.comm=nccl: {'; '.join(overriding)} overrides the comm SMs set per "
                                 f"communicator, so every SM count would run the same kernel; unset it for profiling")
        if not dist.is_available() or not dist.is_nccl_available():
            raise CommSetupError("hardware.comm=nccl needs a torch build with NCCL (a CUDA build); "
                                 "use hardware.comm=gloo with hardware.device=cpu to check the logic")
        if getattr(device, "type", str(device)) != "cuda":
            raise CommSetupError("hardware.comm=nccl runs on GPUs only; use hardware.comm=gloo with hardware.device=cpu")
        if nccl_options(1, self.cfg) is None:
            raise CommSetupError(NO_NCCL_CONFIG)
        super().check_ready(device)

    def _pop_groups(self) -> list[Any]:
        groups, self._groups = list(self._groups.values()), {}
        return groups

    def group(self, sms: int) -> Any:
        import torch.distributed as dist

        if sms <= 0:
            raise ValueError(f"comm SMs must be positive, got {sms}")
        hit = self._groups.get(sms)
        if hit is not None:
            return hit
        if not dist.is_nccl_available():
            raise CommSetupError("hardware.comm=nccl needs a torch build with NCCL (a CUDA build)")
        opts = nccl_options(sms, self.cfg)
        if opts is None:
            raise CommSetupError(NO_NCCL_CONFIG)
        self._groups[sms] = dist.new_group(backend="nccl", pg_options=opts)
        return self._groups[sms]


NO_NCCL_CONFIG = ("hardware.comm=nccl: this torch build exposes no per-communicator NCCL config "
                  "(ProcessGroupNCCL.Options().config.max_ctas: torch built with NCCL 2.17 or later), so the comm "
                  "kernel's SM count cannot vary between candidates; install such a build")


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

    def gather(self, values: Sequence[float], device: Any) -> list[list[float]]:
        return [[float(v) for v in values]]

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
