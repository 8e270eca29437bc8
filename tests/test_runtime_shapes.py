"""Kernel shapes derived from op FLOPs and bytes (pure arithmetic: runs without torch)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from kareus.runtime.shapes import attention_shape, gemm_shape, kernel_kind, memory_elements
from kareus.types import Collective, Link, Op, OpKind
from kareus.workload.ops import comm, gemm, memory


@pytest.mark.parametrize("m,k,n", [(4096, 2048, 2048), (8192, 4096, 4096), (2048, 1024, 1024), (1024, 4096, 4096)])
def test_gemm_shape_reproduces_flops_and_bytes_of_square_weight_gemms(m, k, n):
    s = gemm_shape(gemm("g", m, k, n))
    if m >= k:  # k = n and a tall GEMM (more tokens than width): the shape is recovered exactly
        assert (s.m, s.k, s.n) == (m, k, n)
    assert s.flops == pytest.approx(2.0 * m * k * n, rel=0.02)
    assert 2 * (s.m * s.k + s.k * s.n + s.m * s.n) == pytest.approx(2 * (m * k + k * n + m * n), rel=0.02)


@pytest.mark.parametrize("m,k,n", [(4096, 2048, 11008), (4096, 5504, 2048), (512, 4096, 128)])
def test_gemm_shape_keeps_flops_of_rectangular_gemms(m, k, n):
    s = gemm_shape(gemm("g", m, k, n))
    assert s.flops == pytest.approx(2.0 * m * k * n, rel=0.03)
    assert min(s.m, s.k, s.n) >= 8 and s.k % 8 == 0 and s.m % 8 == 0


def test_gemm_shape_uses_an_explicit_shape_attribute():
    @dataclass(frozen=True)
    class ShapedOp(Op):
        shape: tuple = ()

    op = ShapedOp("g", OpKind.GEMM, flops=2.0 * 10 * 20 * 30, bytes=1.0, shape=(10, 20, 30))
    s = gemm_shape(op)
    assert (s.m, s.k, s.n) == (10, 20, 30)


def test_gemm_without_flops_is_an_error():
    with pytest.raises(ValueError, match="no FLOPs"):
        gemm_shape(Op("g", OpKind.GEMM))


def _attention(seq: int, heads: int, d: int = 128, bwd: bool = False) -> Op:
    f = 4.0 * seq * seq / 2 * heads * d
    b = 2 * (2 * seq * heads * d + 2 * seq * heads * d)
    if bwd:
        return Op("attention_bwd", OpKind.ATTENTION, flops=2.5 * f, bytes=2 * b)
    return Op("attention", OpKind.ATTENTION, flops=f, bytes=b)


@pytest.mark.parametrize("bwd", [False, True])
def test_attention_shape_recovers_sequence_and_heads(bwd):
    s = attention_shape(_attention(4096, 16, bwd=bwd))
    assert (s.batch, s.heads, s.seq, s.head_dim, s.backward) == (1, 16, 4096, 128, bwd)
    assert s.flops == pytest.approx(_attention(4096, 16, bwd=bwd).flops, rel=1e-6)


def test_memory_ops_and_comm_ops():
    op = memory("norm", OpKind.NORM, 1000, 4, 3)
    assert kernel_kind(op) == "memory" and memory_elements(op) == 1000
    assert memory_elements(op, item_bytes=4) == 500  # hardware.dtype=float32: the same bytes, half the elements
    assert kernel_kind(gemm("g", 8, 8, 8)) == "gemm"
    with pytest.raises(ValueError, match="comm op"):
        kernel_kind(comm("ar", Collective.ALL_REDUCE, 1e6, 2, Link.NVLINK))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_attention_kernels_do_the_ops_flops_under_context_parallelism(cp):
    """Under cp each GPU's queries also score the all-gathered keys before their chunks."""
    from kareus.types import ModelSpec, ParallelSpec
    from kareus.workload import build_workload

    model = ModelSpec(name="m", num_layers=2, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                      num_kv_heads=4, head_dim=64, vocab_size=32000)
    par = ParallelSpec(tp=2, pp=1, cp=cp, micro_batch_size=2, num_microbatches=2, seq_len=4096)
    ops = [o for stage in build_workload(model, par).stages for o in (*stage.layer_fwd, *stage.layer_bwd)
           if o.kind is OpKind.ATTENTION]
    assert len(ops) == 2
    for op in ops:
        s = attention_shape(op)
        assert s.cp == cp and s.seq == 4096 // cp  # the query tokens of one sequence on this GPU
        assert s.flops == pytest.approx(op.flops, rel=1e-9)


def test_a_context_parallel_attention_kernel_runs_its_chunks_forward_and_backward():
    torch = pytest.importorskip("torch")
    from kareus.runtime.kernels import build_kernel

    for name in ("attention", "attention_bwd"):
        op = Op(name, OpKind.ATTENTION, flops=1.0, bytes=1.0, shape=(1, 2, 64, 16, 2))
        kernel = build_kernel(op, torch.device("cpu"), torch.float32)
        out = kernel()
        assert len(out) == (2 if name == "attention" else 6)  # two calls; backward: dq, dk, dv of each
