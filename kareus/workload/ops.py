"""Op constructors with the FLOP and HBM-byte conventions of the workload graph.

Conventions (bf16, 2 bytes an element):
- GEMM ``[m,k] x [k,n]``: ``2*m*k*n`` FLOPs; bytes read A and B and write C. dgrad and wgrad are
  separate GEMMs with the forward GEMM's FLOPs each.
- Flash attention: ``4 * query-key pairs * head_dim * heads`` FLOPs forward (QK^T and PV), 2.5x that
  backward (it recomputes QK^T); bytes read Q, K, V (and O, dO backward) and write the outputs.
- Memory-bound ops (norm, residual add, rope, SwiGLU): a few FLOPs an element; bytes read + written.
- Comm ops carry ``message_bytes`` with NCCL's count convention: all-reduce the full tensor, all-gather
  the shard each GPU sends, reduce-scatter the shard each GPU receives, send/recv the tensor sent.
"""
from __future__ import annotations

from kareus.types import Collective, Link, Op, OpKind
from kareus.workload.shapes import BYTES


def gemm(name: str, m: int, k: int, n: int) -> Op:
    return Op(name, OpKind.GEMM, flops=2.0 * m * k * n, bytes=float(BYTES * (m * k + k * n + m * n)),
              shape=(m, k, n))


# the MLP's activation over tokens x ffn: (FLOPs an element, tensor passes) forward, then backward
ACTIVATIONS = {
    "swiglu": ((5, 3), (8, 5)),  # gate and up in, out; the gradient, gate and up in, both gradients out
    "gelu": ((8, 2), (12, 3)),  # tanh approximation: in, out; the gradient and the input in, one out
}
NORM_FLOPS = {"rmsnorm": (4, 8), "layernorm": (5, 10)}  # FLOPs an element forward, backward (+ the mean)


def mlp_width(activation: str) -> int:
    """FC1's width in units of ffn: SwiGLU's gate and up projections are one GEMM twice as wide."""
    return 2 if activation == "swiglu" else 1


def memory(name: str, kind: OpKind, elements: float, flops_per_element: float, passes: float) -> Op:
    """A memory-bound op over ``elements`` values touching ``passes`` tensors of that size."""
    return Op(name, kind, flops=flops_per_element * elements, bytes=float(BYTES * passes * elements))


def comm(name: str, collective: Collective, message_bytes: float, group_size: int, link: Link) -> Op:
    return Op(name, OpKind.COMM, collective=collective, message_bytes=float(message_bytes),
              group_size=group_size, link=link)
