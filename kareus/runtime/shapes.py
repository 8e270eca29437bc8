"""Kernel shapes for ops that carry only FLOPs and HBM bytes (pure arithmetic, no torch).

The workload graph records a GEMM ``[m,k] x [k,n]`` as ``2mkn`` FLOPs and ``2(mk+kn+mn)`` bytes, an
attention as its score FLOPs and Q/K/V/O bytes. Those two numbers fix a GEMM's shape up to a
permutation only if two of its dims are equal, so the runtime assumes ``k = n`` unless the op carries
an explicit ``shape`` (an optional attribute: ``(m, k, n)`` for a GEMM, ``(batch, heads, seq,
head_dim[, cp])`` for attention, ``seq`` the query tokens per sequence on this GPU). The derived kernel does the op's FLOPs and moves its bytes to within the
rounding to multiples of 8 that keeps tensor cores busy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kareus.types import Op, OpKind

BF16_BYTES = 2
ATTENTION_BWD_FLOPS = 2.5  # flash-attention backward runs 2.5x the forward's FLOPs (workload convention)


def _round8(x: float) -> int:
    return max(8, int(round(x / 8.0)) * 8)


@dataclass(frozen=True)
class GemmShape:
    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


@dataclass(frozen=True)
class AttentionShape:
    """One GPU's causal attention: ``seq`` query tokens per sequence. Under context parallelism
    (``cp`` > 1) those are two load-balanced chunks of the sequence whose queries score the
    all-gathered keys before them too: ``cp`` times the pairs of a causal ``seq`` x ``seq`` block."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    backward: bool = False
    cp: int = 1

    @property
    def flops(self) -> float:
        """Causal score FLOPs (forward), times 2.5 for the backward kernel."""
        f = 2.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim * self.cp
        return f * ATTENTION_BWD_FLOPS if self.backward else f


def gemm_shape(op: Op) -> GemmShape:
    """``(m, k, n)`` of a GEMM op: its ``shape`` attribute, else solved from FLOPs and bytes with k = n.

    With k = n: ``e3 = mn^2 = flops/2`` and ``e2 = 2mn + n^2 = bytes/2``, so n solves
    ``n^2 + 2 e3 / n = e2``. Of the two roots, the smaller n (a tall GEMM: many tokens, a narrower
    width) is the usual transformer shape. AM-GM guarantees a root for any real GEMM's numbers.
    """
    shape = getattr(op, "shape", None)
    if shape:
        m, k, n = (int(x) for x in shape)
        return GemmShape(m, k, n)
    if op.flops <= 0:
        raise ValueError(f"GEMM op {op.name!r} has no FLOPs; cannot size its kernel")
    e3 = op.flops / 2.0
    e2 = op.bytes / BF16_BYTES if op.bytes > 0 else 3.0 * e3 ** (2.0 / 3.0)
    cube = e3 ** (1.0 / 3.0)

    def f(n: float) -> float:
        return n * n + 2.0 * e3 / n - e2

    if f(cube) >= 0:  # bytes below the cube's (rounding): the cube is the closest shape
        n = cube
    else:  # bisection on (0, cube]: f falls from +inf to f(cube) < 0
        lo, hi = 1e-9, cube
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if f(mid) > 0:
                lo = mid
            else:
                hi = mid
        n = hi
    m = e3 / (n * n)
    return GemmShape(_round8(m), _round8(n), _round8(n))


def attention_shape(op: Op, head_dim: int = 128) -> AttentionShape:
    """``(batch, heads, seq, head_dim)`` of a flash-attention op with as many K/V heads as Q heads.

    Forward: bytes = 2 * 4 * B*S*H*D (read Q, K, V, write O) and FLOPs = 2 B H S^2 D, so
    S = 4 * FLOPs / bytes. Backward ops (name ending ``_bwd``) move twice the bytes and 2.5x FLOPs.
    GQA (fewer K/V heads) makes S come out larger than the true sequence; the FLOPs still match.
    """
    backward = op.name.endswith("_bwd")
    shape = getattr(op, "shape", None)
    if shape:
        b, h, s, d, *cp = (int(x) for x in shape)
        return AttentionShape(b, h, s, d, backward, cp[0] if cp else 1)
    if op.flops <= 0 or op.bytes <= 0:
        raise ValueError(f"attention op {op.name!r} needs FLOPs and bytes to size its kernel")
    flops = op.flops / (ATTENTION_BWD_FLOPS if backward else 1.0)
    nbytes = op.bytes / (2.0 if backward else 1.0)
    tokens_x_width = nbytes / (4.0 * BF16_BYTES)  # B*S*H*D
    seq = max(head_dim, flops / (2.0 * tokens_x_width))
    heads = max(1.0, tokens_x_width / (seq * head_dim))
    return AttentionShape(1, max(1, int(round(heads))), _round8(seq), head_dim, backward)


def memory_elements(op: Op, passes: int = 3, item_bytes: int = BF16_BYTES) -> int:
    """Elements per tensor of a memory-bound kernel that reads two and writes one tensor (op.bytes) of
    ``item_bytes`` each (the kernel's dtype): the op's bytes move whatever the dtype."""
    return max(1, int(math.ceil(op.bytes / (passes * item_bytes))))


def kernel_kind(op: Op) -> str:
    """"gemm", "attention" or "memory": which torch kernel stands in for the op."""
    if op.kind is OpKind.GEMM:
        return "gemm"
    if op.kind is OpKind.ATTENTION:
        return "attention"
    if op.kind is OpKind.COMM:
        raise ValueError(f"op {op.name!r} is a comm op; a comm backend runs it")
    return "memory"
