"""One transformer layer's forward and backward kernels, in the order Megatron-core launches them.

Forward: input norm, QKV GEMM (column-parallel), [qk-norm], rotary, [CP all-gather of K/V],
causal flash attention, output projection (row-parallel), [TP all-reduce | reduce-scatter under SP],
bias-dropout-add, pre-MLP norm, FC1 (column-parallel; SwiGLU: 2*ffn wide, GELU: ffn), the activation,
FC2 (row-parallel), [TP all-reduce | reduce-scatter], bias-dropout-add. Under sequence parallelism an
all-gather precedes each column-parallel GEMM. The norms are RMSNorm or LayerNorm (``model.norm``).

Backward runs the reverse; each GEMM becomes dgrad then wgrad, and the column-parallel input gradient
is all-reduced (reduce-scattered under SP) after both. Context parallelism (all-gather flavour, as
Transformer Engine runs it) gathers K/V again before the attention backward and reduce-scatters dK/dV.
Under SP a column-parallel GEMM's forward kept only its sequence shard of the input, so its backward
all-gathers the input again for wgrad (``<gemm>_regather_bwd``). megatron-core launches that gather
before dgrad and waits for it before wgrad; the op list puts it after dgrad, the GEMM its wait
follows, which is the only dependency this order adds. megatron-core then runs wgrad under the input
gradient's collective; the Megatron reference launches the re-gather at dgrad and that collective at
wgrad (partition.sequential.megatron_slot).
"""
from __future__ import annotations

from kareus.types import Collective, Link, ModelSpec, Op, OpKind
from kareus.workload.ops import ACTIVATIONS, NORM_FLOPS, comm, gemm, memory, mlp_width
from kareus.workload.shapes import BYTES, Shard

ATTENTION_BWD_FACTOR = 2.5  # flash attention backward: 5 matmuls against the forward's 2


def _tp_out(name: str, s: Shard, sp: bool, link: Link) -> list[Op]:
    """The collective after a row-parallel GEMM (forward) or a column-parallel dgrad (backward)."""
    if s.tp == 1:
        return []
    if sp:
        return [comm(f"{name}_reducescatter", Collective.REDUCE_SCATTER, s.sp_tokens * s.hidden * BYTES, s.tp, link)]
    return [comm(f"{name}_allreduce", Collective.ALL_REDUCE, s.tokens * s.hidden * BYTES, s.tp, link)]


def _sp_in(name: str, s: Shard, sp: bool, link: Link) -> list[Op]:
    """The all-gather before a column-parallel GEMM (forward) or a row-parallel dgrad (backward) under SP."""
    if s.tp == 1 or not sp:
        return []
    return [comm(f"{name}_allgather", Collective.ALL_GATHER, s.sp_tokens * s.hidden * BYTES, s.tp, link)]


def attention_shape(model: ModelSpec, s: Shard) -> tuple[int, int, int, int, int]:
    """(sequences, query heads, query tokens per sequence, head dim, cp) of one GPU's attention
    kernel; under cp its queries also score the all-gathered keys of the chunks before theirs."""
    return (s.sequences, s.heads_local, s.tokens // s.sequences, model.head_dim, s.cp)


def attention_flops(s: Shard) -> float:
    """Causal flash-attention forward FLOPs of one nanobatch on one GPU."""
    return 4.0 * s.causal_pairs * s.q_local


def layer_forward(model: ModelSpec, s: Shard, sp: bool, tp_link: Link, cp_link: Link) -> tuple[Op, ...]:
    T, Ts, h = s.tokens, s.sp_tokens, s.hidden
    qk = s.q_local + s.kv_local
    norm = NORM_FLOPS[model.norm][0]
    (act_flops, act_passes), _ = ACTIVATIONS[model.activation]
    ops: list[Op] = [memory("input_norm", OpKind.NORM, Ts * h, norm, 2)]
    ops += _sp_in("attn", s, sp, tp_link)
    ops.append(gemm("qkv", T, h, s.q_local + 2 * s.kv_local))
    if model.qk_layernorm:
        ops.append(memory("qk_norm", OpKind.NORM, T * qk, norm, 2))
    ops.append(memory("rope", OpKind.ROPE, T * qk, 3, 2))
    if s.cp > 1:
        ops.append(comm("cp_kv_allgather", Collective.ALL_GATHER, 2 * T * s.kv_local * BYTES, s.cp, cp_link))
    ops.append(Op("attention", OpKind.ATTENTION, flops=attention_flops(s),
                  bytes=float(BYTES * (2 * T * s.q_local + 2 * s.kv_tokens * s.kv_local)),
                  shape=attention_shape(model, s)))
    ops.append(gemm("attn_proj", T, s.q_local, h))
    ops += _tp_out("attn", s, sp, tp_link)
    ops.append(memory("attn_bda", OpKind.ELEMENTWISE, Ts * h, 2, 3))
    ops.append(memory("pre_mlp_norm", OpKind.NORM, Ts * h, norm, 2))
    ops += _sp_in("mlp", s, sp, tp_link)
    ops.append(gemm("fc1", T, h, mlp_width(model.activation) * s.ffn_local))
    ops.append(memory(model.activation, OpKind.ELEMENTWISE, T * s.ffn_local, act_flops, act_passes))
    ops.append(gemm("fc2", T, s.ffn_local, h))
    ops += _tp_out("mlp", s, sp, tp_link)
    ops.append(memory("mlp_bda", OpKind.ELEMENTWISE, Ts * h, 2, 3))
    return tuple(ops)


def _grads(name: str, m: int, k: int, n: int) -> list[Op]:
    """dgrad and wgrad of the forward GEMM ``[m,k] x [k,n]``."""
    return [gemm(f"{name}_dgrad", m, n, k), gemm(f"{name}_wgrad", k, m, n)]


def layer_backward(model: ModelSpec, s: Shard, sp: bool, tp_link: Link, cp_link: Link) -> tuple[Op, ...]:
    T, Ts, h = s.tokens, s.sp_tokens, s.hidden
    qk = s.q_local + s.kv_local
    norm = NORM_FLOPS[model.norm][1]
    _, (act_flops, act_passes) = ACTIVATIONS[model.activation]
    ops: list[Op] = [memory("mlp_bda_bwd", OpKind.ELEMENTWISE, Ts * h, 1, 2)]
    ops += [_rename(o, "_bwd") for o in _sp_in("mlp", s, sp, tp_link)]
    ops += _grads("fc2", T, s.ffn_local, h)
    ops.append(memory(f"{model.activation}_bwd", OpKind.ELEMENTWISE, T * s.ffn_local, act_flops, act_passes))
    ops += _column_grads("fc1", T, h, mlp_width(model.activation) * s.ffn_local, s, sp, tp_link)
    ops.append(memory("pre_mlp_norm_bwd", OpKind.NORM, Ts * h, norm, 4))
    ops.append(memory("attn_bda_bwd", OpKind.ELEMENTWISE, Ts * h, 1, 2))
    ops += [_rename(o, "_bwd") for o in _sp_in("attn", s, sp, tp_link)]
    ops += _grads("attn_proj", T, s.q_local, h)
    if s.cp > 1:
        ops.append(comm("cp_kv_allgather_bwd", Collective.ALL_GATHER, 2 * T * s.kv_local * BYTES, s.cp, cp_link))
    ops.append(Op("attention_bwd", OpKind.ATTENTION, flops=ATTENTION_BWD_FACTOR * attention_flops(s),
                  bytes=float(BYTES * (4 * T * s.q_local + 4 * s.kv_tokens * s.kv_local)),
                  shape=attention_shape(model, s)))
    if s.cp > 1:
        ops.append(comm("cp_dkv_reducescatter", Collective.REDUCE_SCATTER, 2 * T * s.kv_local * BYTES, s.cp, cp_link))
    ops.append(memory("rope_bwd", OpKind.ROPE, T * qk, 3, 2))
    if model.qk_layernorm:
        ops.append(memory("qk_norm_bwd", OpKind.NORM, T * qk, norm, 3))
    ops += _column_grads("qkv", T, h, s.q_local + 2 * s.kv_local, s, sp, tp_link)
    ops.append(memory("input_norm_bwd", OpKind.NORM, Ts * h, norm, 4))
    return tuple(ops)


def _column_grads(name: str, m: int, k: int, n: int, s: Shard, sp: bool, link: Link) -> list[Op]:
    """Backward of a column-parallel GEMM: dgrad, [SP: re-gather of its input], wgrad, then the
    input gradient's all-reduce (reduce-scatter under SP)."""
    dgrad, wgrad = _grads(name, m, k, n)
    regather = [] if s.tp == 1 or not sp else [
        comm(f"{name}_regather_bwd", Collective.ALL_GATHER, s.sp_tokens * s.hidden * BYTES, s.tp, link)]
    return [dgrad, *regather, wgrad, *(_rename(o, "_bwd") for o in _tp_out(name, s, sp, link))]


def _rename(op: Op, suffix: str) -> Op:
    from dataclasses import replace

    return replace(op, name=op.name + suffix)
