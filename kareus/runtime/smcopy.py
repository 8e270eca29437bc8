"""A comm-like kernel for one GPU: a persistent copy on exactly ``sms`` thread blocks (Triton).

A comm kernel (NCCL) runs one persistent thread block per channel on a fixed number of SMs and
streams bytes through memory. A plain ``tensor.copy_`` launches millions of short blocks, which the
block scheduler dispatches before a kernel launched after it, so it barely overlaps anything; this
kernel has the comm kernel's shape instead: ``sms`` programs, each looping over the buffer.
Triton ships with CUDA builds of torch; without it (or on the CPU) callers fall back to ``copy_``.
"""
from __future__ import annotations

import os
from typing import Any

BLOCK = 4096  # elements one program moves per loop step
MAX_ELEMENTS = 2**31 - 2**26  # offsets are 32-bit: stay clear of overflow with the last stride

_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def sm_copy(src, dst, n, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            for start in range(pid * BLOCK, n, nprog * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        _KERNEL = sm_copy
    return _KERNEL


def available(device: Any) -> bool:
    """Whether the persistent copy can run on ``device`` (a CUDA device with Triton, or Triton's interpreter)."""
    interpret = os.environ.get("TRITON_INTERPRET", "") == "1"
    if getattr(device, "type", str(device)) != "cuda" and not interpret:
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def sm_copy(src: Any, dst: Any, sms: int) -> None:
    """Copy ``src`` into ``dst`` (same numel, contiguous) with ``sms`` persistent programs."""
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"sm_copy needs equal sizes, got {n} and {dst.numel()}")
    if n > MAX_ELEMENTS:
        raise ValueError(f"sm_copy moves at most {MAX_ELEMENTS} elements, got {n}")
    if sms <= 0:
        raise ValueError(f"sm_copy needs a positive SM count, got {sms}")
    _kernel()[(int(sms),)](src, dst, n, BLOCK=BLOCK)
