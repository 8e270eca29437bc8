"""Real torch kernels standing in for workload ops at their shapes (torch imported lazily).

The ``cuda`` backend measures partitions on the model's own megatron-core layer
(:mod:`kareus.runtime.layer_kernels`); these stand-ins run the residual work that no layer op covers
(embedding, output layer, loss: ``CudaBackend.residual_chain``) and the partitions of a backend whose
config names no model (scripts that check the runtime itself, such as a GEMM chain beside a copy).

A kernel is a zero-argument callable with its tensors allocated once, so a measurement window
launches kernels only. GEMMs run ``torch.matmul`` in bf16, attention runs causal
``scaled_dot_product_attention`` (its backward through autograd for ``_bwd`` ops), memory-bound ops
(norms, elementwise, rope) run an add over the op's bytes.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from kareus.runtime.shapes import attention_shape, gemm_shape, kernel_kind, memory_elements
from kareus.types import Op

Kernel = Callable[[], Any]


def torch_dtype(name: str) -> Any:
    import torch

    try:
        return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use bfloat16, float16 or float32") from None


def build_kernel(op: Op, device: Any, dtype: Any, head_dim: int = 128, scale: float = 1.0) -> Kernel:
    """The kernel for one compute op; ``scale`` (0, 1] shrinks every dim for quick CPU runs."""
    import torch

    kind = kernel_kind(op)
    if kind == "gemm":
        s = gemm_shape(op)
        m, k, n = (max(1, int(x * scale)) for x in (s.m, s.k, s.n))
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)
        return lambda: torch.matmul(a, b, out=c)
    if kind == "attention":
        return _attention(op, device, dtype, head_dim, scale)
    numel = max(1, int(memory_elements(op, item_bytes=dtype.itemsize) * scale))
    x = torch.randn(numel, device=device, dtype=dtype)
    y = torch.randn(numel, device=device, dtype=dtype)
    z = torch.empty(numel, device=device, dtype=dtype)
    return lambda: torch.add(x, y, out=z)


def _attention(op: Op, device: Any, dtype: Any, head_dim: int, scale: float) -> Kernel:
    """Causal flash attention at the op's shape. Under context parallelism (all-gathered K/V, two
    load-balanced query chunks of c tokens per sequence) each chunk scores its own c x c causal block
    and the keys of the chunks before it; here that is one causal call on both chunks and one
    unmasked call of their queries against (2 cp - 1) c / 2 keys each: the same pairs, the same FLOPs."""
    import torch
    import torch.nn.functional as F

    s = attention_shape(op, head_dim)
    seq = max(8, int(s.seq * scale))
    heads = max(1, int(s.heads * scale)) if scale < 1 else s.heads
    if s.cp > 1:
        c = max(8, seq // 2)
        chunks = (2 * s.batch, heads, c, s.head_dim)
        before = (2 * s.batch, heads, (2 * s.cp - 1) * c // 2, s.head_dim)
        calls = [(chunks, chunks, True), (chunks, before, False)]
    else:
        shape = (s.batch, heads, seq, s.head_dim)
        calls = [(shape, shape, True)]
    grad = s.backward
    tensors = [(torch.randn(q, device=device, dtype=dtype, requires_grad=grad),
                torch.randn(kv, device=device, dtype=dtype, requires_grad=grad),
                torch.randn(kv, device=device, dtype=dtype, requires_grad=grad), causal) for q, kv, causal in calls]
    if not grad:
        def forward() -> Any:
            outs = [F.scaled_dot_product_attention(q, k, v, is_causal=causal) for q, k, v, causal in tensors]
            return outs[0] if len(outs) == 1 else outs

        return forward
    outs = [F.scaled_dot_product_attention(q, k, v, is_causal=causal) for q, k, v, causal in tensors]
    grads = [torch.randn_like(o) for o in outs]
    inputs = [t for q, k, v, _ in tensors for t in (q, k, v)]
    # retain_graph keeps the saved tensors, so each call runs only the backward kernels
    return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)


def build_chain(ops: Sequence[Op], device: Any, dtype: Any, head_dim: int = 128, scale: float = 1.0) -> list[Kernel]:
    return [build_kernel(op, device, dtype, head_dim, scale) for op in ops]
