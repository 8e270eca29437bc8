"""The single-GPU stand-in for the partitioned executor's tensor-parallel collectives.

One GPU has no tensor-parallel peer, so a tp layout's block program cannot issue its collectives there.
``StandInIssuer`` takes their place: it has ``CommIssuer``'s interface (``launch(kind, tensor, sms)``
returns a pending handle, ``join(pending)`` the result), so ``PlanRuntime(comm=...)`` runs it unchanged,
and each collective becomes a device-local copy of the message's bytes that leaves the values a
one-rank collective would: an all-reduce leaves them unchanged, and so do an all-gather and a
reduce-scatter along dim 0 over one rank. The result is a new tensor (the copy), never the input.

On a GPU the copy runs on a side stream that first waits for the main stream (the producer and the ops
before the planned slot), on ``sms`` persistent thread blocks (:mod:`kareus.runtime.smcopy`, the comm
kernel's shape, as the ``copy`` comm backend runs it) where Triton runs, else a plain ``copy_``; the
join makes the main stream wait for the copy's event. On the CPU the copy runs at once, in the caller's
thread. ``PlanRuntime(..., stand_in_tp=True)`` builds one for a model that holds one tensor-parallel
rank's shard on a single device.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
KERNELS = ("auto", "sm", "torch")


class StandInIssuer:
    """Stands in for ``CommIssuer`` on one device: each collective is a copy of its message's bytes.

    ``kernel``: ``auto`` copies on ``sms`` persistent blocks where Triton runs on the device (else
    ``copy_``), ``sm`` always does (refused where it cannot run), ``torch`` always uses ``copy_`` (which
    ignores the SM count). ``default_sms``: the blocks of a launch whose SM count is None (a comm that no
    partition pairs; None: ``copy_``). ``launches``, ``bytes`` and ``kernels`` (launches per kernel)
    count what ran since the issuer was built.
    """

    def __init__(self, device: Any, kernel: str = "auto", default_sms: int | None = None) -> None:
        import torch

        from kareus.runtime import smcopy

        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.device = torch.device(device)
        if kernel == "sm" and not smcopy.available(self.device):
            raise ValueError(f"kernel=sm: the persistent copy cannot run on {self.device} (it needs Triton and a "
                             "CUDA device, or TRITON_INTERPRET=1)")
        if default_sms is not None and default_sms <= 0:
            raise ValueError(f"default_sms must be positive, got {default_sms}")
        self.kernel = kernel
        self.default_sms = default_sms
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._sm = kernel == "sm" or (kernel == "auto" and smcopy.available(self.device))
        self.launches = 0
        self.bytes = 0
        self.kernels: Counter[str] = Counter()

    def launch(self, kind: str, tensor: Any, sms: int | None) -> Any:
        """Start the stand-in of collective ``kind`` of ``tensor`` on ``sms`` blocks; a handle for ``join``."""
        import torch

        if kind not in KINDS:
            raise ValueError(f"unknown collective {kind!r}")
        if not self.cuda:
            return self._copy(tensor, sms), None
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            out = self._copy(tensor, sms)
            done = torch.cuda.Event()
            done.record(self.side)
        tensor.record_stream(self.side)  # the input's memory is not reused before the copy has read it
        return out, done

    def join(self, pending: Any) -> Any:
        """The collective's result; on a GPU the current stream first waits for the copy."""
        import torch

        out, done = pending
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            out.record_stream(current)  # allocated on the side stream, consumed on this one
        return out

    def _copy(self, tensor: Any, sms: int | None) -> Any:
        """A copy of ``tensor`` (same shape, dtype, values; contiguous) on the current stream."""
        from kareus.runtime import smcopy

        src = tensor.contiguous()
        out = src.new_empty(src.shape)
        blocks = self.default_sms if sms is None else int(sms)
        n = src.numel()
        use_sm = self._sm and blocks is not None and 0 < n <= smcopy.MAX_ELEMENTS
        if self.kernel == "sm" and not use_sm and n > 0:
            raise ValueError(f"kernel=sm needs an SM count for every launch and at most {smcopy.MAX_ELEMENTS} "
                             f"elements (got sms={sms}, {n} elements)")
        if use_sm:
            smcopy.sm_copy(src, out, blocks)
        else:
            out.copy_(src)
        self.launches += 1
        self.bytes += n * src.element_size()
        self.kernels["sm" if use_sm else "torch"] += 1
        return out


__all__ = ["KERNELS", "KINDS", "StandInIssuer"]
