"""Workload graph: op shapes, FLOPs against Megatron's own formula, comm ops and stage layout."""
from __future__ import annotations

import pytest

from kareus.types import Collective, Direction, Link, ModelSpec, OpKind, ParallelSpec
from kareus.workload import ATTENTION_BWD_FACTOR, build_workload, padded_vocab_size, pp_link

QWEN = ModelSpec("qwen3-1.7b", 28, 2048, 6144, 16, 8, 128, 151936, tied_embeddings=True, qk_layernorm=True)
LLAMA = ModelSpec("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256, tied_embeddings=False)
TP8 = ParallelSpec(tp=8, pp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096)
CP2 = ParallelSpec(tp=4, pp=2, cp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096)


def ops_by_name(ops):
    out = {o.name: o for o in ops}
    assert len(out) == len(ops), "op names within one layer are unique"
    return out


def test_layer_forward_order_qwen_tp8():
    w = build_workload(QWEN, TP8)
    names = [o.name for o in w.stage(0).layer_fwd]
    assert names == ["input_norm", "qkv", "qk_norm", "rope", "attention", "attn_proj", "attn_allreduce", "attn_bda",
                     "pre_mlp_norm", "fc1", "swiglu", "fc2", "mlp_allreduce", "mlp_bda"]
    assert "qk_norm" not in [o.name for o in build_workload(LLAMA, TP8).stage(0).layer_fwd]


def test_qwen_tp8_op_sizes():
    w = build_workload(QWEN, TP8)
    T = 8 // 2 * 4096  # tokens of one nanobatch on one GPU
    assert w.shard.tokens == T and w.shard.sequences == 4
    f = ops_by_name(w.stage(0).layer_fwd)
    q, kv = 16 // 8 * 128, 8 // 8 * 128
    assert f["qkv"].flops == 2 * T * 2048 * (q + 2 * kv)
    assert f["qkv"].bytes == 2 * (T * 2048 + 2048 * (q + 2 * kv) + T * (q + 2 * kv))
    assert f["attn_proj"].flops == 2 * T * q * 2048
    assert f["fc1"].flops == 2 * T * 2048 * 2 * (6144 // 8)
    assert f["fc2"].flops == 2 * T * (6144 // 8) * 2048
    # causal: half of the 4 x 4096 x 4096 query-key pairs, QK^T and PV
    assert f["attention"].flops == 4 * (4 * 4096 * 4096 / 2) * q
    ar = f["attn_allreduce"]
    assert (ar.kind, ar.collective, ar.group_size, ar.link) == (OpKind.COMM, Collective.ALL_REDUCE, 8, Link.NVLINK)
    assert ar.message_bytes == T * 2048 * 2
    assert f["rope"].kind is OpKind.ROPE and f["input_norm"].kind is OpKind.NORM
    assert f["input_norm"].bytes == 2 * 2 * T * 2048


def test_backward_flops_relations():
    w = build_workload(LLAMA, TP8)
    f = ops_by_name(w.stage(0).layer_fwd)
    b = ops_by_name(w.stage(0).layer_bwd)
    for g in ("qkv", "attn_proj", "fc1", "fc2"):
        assert b[f"{g}_dgrad"].flops == f[g].flops == b[f"{g}_wgrad"].flops
    assert b["attention_bwd"].flops == pytest.approx(ATTENTION_BWD_FACTOR * f["attention"].flops)
    for name in ("fc1_allreduce_bwd", "qkv_allreduce_bwd"):
        assert b[name].collective is Collective.ALL_REDUCE and b[name].message_bytes == f["attn_allreduce"].message_bytes
    names = [o.name for o in w.stage(0).layer_bwd]
    # the column-parallel input gradient is reduced after its GEMM's dgrad and wgrad
    assert names.index("fc1_allreduce_bwd") == names.index("fc1_wgrad") + 1
    assert names.index("qkv_allreduce_bwd") == names.index("qkv_wgrad") + 1


def test_llama_tp8_shapes():
    w = build_workload(LLAMA, TP8)
    f = ops_by_name(w.stage(0).layer_fwd)
    T = 16384
    assert f["qkv"].flops == 2 * T * 3072 * (3 * 128 + 2 * 128)
    assert f["fc1"].flops == 2 * T * 3072 * 2 * 1024
    out = ops_by_name(w.stage(1).post_fwd)["output"]
    assert out.flops == 2 * T * 3072 * padded_vocab_size(128256, 8) // 8
    assert padded_vocab_size(128256, 8) == 129024 and padded_vocab_size(151936, 8) == 152576


def test_cross_entropy_moves_megatron_cores_unfused_bytes_per_logit():
    """fp32 cast, max, subtract and exp in place, sum, divide (38 B); backward scale and cast (14 B)."""
    w = build_workload(LLAMA, TP8)
    logits = 16384 * padded_vocab_size(128256, 8) // 8
    assert ops_by_name(w.stage(1).post_fwd)["cross_entropy"].bytes == 38 * logits
    assert ops_by_name(w.stage(1).pre_bwd)["cross_entropy_bwd"].bytes == 14 * logits
    assert [o.name for o in w.stage(1).post_fwd if o.name.startswith("loss_")] == [
        "loss_max_allreduce", "loss_target_allreduce", "loss_sumexp_allreduce"]


def test_fused_cross_entropy_reads_the_logits_twice_and_gathers_three_numbers_per_token():
    """parallel.cross_entropy_fusion (Transformer Engine's kernels): 6 B per logit forward, 4 B backward,
    one all-gather of each shard's max, sum and target logit instead of three all-reduces."""
    from dataclasses import replace

    w = build_workload(LLAMA, replace(TP8, cross_entropy_fusion=True))
    logits = 16384 * padded_vocab_size(128256, 8) // 8
    post = ops_by_name(w.stage(1).post_fwd)
    assert post["cross_entropy"].bytes == 6 * logits
    assert ops_by_name(w.stage(1).pre_bwd)["cross_entropy_bwd"].bytes == 4 * logits
    assert [o.name for o in w.stage(1).post_fwd if o.name.startswith("loss_")] == ["loss_stats_allgather"]
    assert post["loss_stats_allgather"].collective is Collective.ALL_GATHER
    assert post["loss_stats_allgather"].message_bytes == 16384 * 3 * 4
    unfused = build_workload(LLAMA, TP8)
    assert [o.name for o in w.stage(0).layer_fwd] == [o.name for o in unfused.stage(0).layer_fwd]  # the loss alone


def test_sequence_parallel_backward_gathers_each_column_parallel_input_again_for_wgrad():
    """Under SP the forward kept only the sequence shard of the qkv and fc1 inputs: the backward
    all-gathers each again, after dgrad (where megatron-core waits for it) and before wgrad."""
    sp = build_workload(QWEN, ParallelSpec(tp=8, pp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096,
                                           sequence_parallel=True))
    names = [o.name for o in sp.stage(0).layer_bwd]
    b = ops_by_name(sp.stage(0).layer_bwd)
    for gemm in ("fc1", "qkv"):
        i = names.index(f"{gemm}_regather_bwd")
        assert names[i - 1] == f"{gemm}_dgrad" and names[i + 1] == f"{gemm}_wgrad"
        assert names[i + 2] == f"{gemm}_reducescatter_bwd"
        op = b[f"{gemm}_regather_bwd"]
        assert op.collective is Collective.ALL_GATHER and op.message_bytes == 16384 // 8 * 2048 * 2
    out = [o.name for o in sp.stage(1).pre_bwd]
    assert out[out.index("output_regather_bwd") - 1:][:3] == ["output_dgrad", "output_regather_bwd", "output_wgrad"]
    plain = build_workload(QWEN, TP8)
    assert not any("regather" in o.name for o in plain.stage(0).layer_bwd + plain.stage(1).pre_bwd)


def test_cp2_tp4_comm_and_attention():
    w = build_workload(QWEN, CP2)
    T = 4 * 4096 // 2
    assert w.shard.tokens == T
    f = ops_by_name(w.stage(0).layer_fwd)
    b = ops_by_name(w.stage(0).layer_bwd)
    kv = 8 // 4 * 128
    ag = f["cp_kv_allgather"]
    assert (ag.collective, ag.group_size, ag.link) == (Collective.ALL_GATHER, 2, Link.NVLINK)
    assert ag.message_bytes == 2 * T * kv * 2  # this GPU's K and V shard
    assert b["cp_dkv_reducescatter"].collective is Collective.REDUCE_SCATTER
    assert b["cp_dkv_reducescatter"].message_bytes == ag.message_bytes
    assert b["cp_kv_allgather_bwd"].collective is Collective.ALL_GATHER
    assert f["attn_allreduce"].group_size == 4 and f["attn_allreduce"].message_bytes == T * 2048 * 2
    # each cp rank scores half of the causal pairs
    assert f["attention"].flops == 4 * (4 * 4096 * 4096 / 2 / 2) * (16 // 4 * 128)
    names = [o.name for o in w.stage(0).layer_fwd]
    assert names.index("rope") < names.index("cp_kv_allgather") < names.index("attention")


def test_stages_and_links():
    w = build_workload(QWEN, TP8)
    assert [s.layers for s in w.stages] == [14, 14] and [s.first_layer for s in w.stages] == [0, 14]
    assert all(s.gpus == 8 for s in w.stages)
    s0, s1 = w.stages
    assert [o.name for o in s0.pre_fwd] == ["embedding", "embedding_allreduce"]
    assert s0.post_fwd[0].name == "pp_send" and s0.post_fwd[0].link is Link.NETWORK  # tp*cp == 8
    assert s0.post_fwd[0].collective is Collective.SEND_RECV and s0.post_fwd[0].message_bytes == 16384 * 2048 * 2
    # a transfer is one exchange, charged to its sender: the receiver starts when the send ends, and a
    # recv of its own would put the same transfer on the critical path twice
    assert s1.pre_fwd == () and all(o.collective is not Collective.SEND_RECV for o in s0.pre_bwd)
    assert [o.name for o in s1.post_fwd][:3] == ["final_norm", "output", "cross_entropy"]
    assert [o.name for o in s1.pre_bwd][:3] == ["cross_entropy_bwd", "output_dgrad", "output_wgrad"]
    assert s0.post_bwd[-1].name == "embedding_bwd" and s1.post_bwd[-1].name == "pp_send_grad"
    # four stages of tp=2 fit one node; tp=4: the boundary between stage 1 and 2 crosses nodes
    p2 = ParallelSpec(tp=2, pp=4, micro_batch_size=2, num_microbatches=4, seq_len=1024)
    assert [pp_link(p2, b) for b in range(3)] == [Link.NVLINK] * 3
    p4 = ParallelSpec(tp=4, pp=4, micro_batch_size=2, num_microbatches=4, seq_len=1024)
    assert [pp_link(p4, b) for b in range(3)] == [Link.NVLINK, Link.NETWORK, Link.NVLINK]


def test_layer_split_and_recompute():
    p = ParallelSpec(tp=8, pp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096, layer_split=(13, 15))
    w = build_workload(QWEN, p)
    assert [s.layers for s in w.stages] == [13, 15]
    bwd = w.instruction_ops(0, Direction.BWD)
    # full recompute reruns the forward layers (their comm included) before the backward layers
    assert sum(o.name == "attention" for o in bwd) == 13 and sum(o.name == "attention_bwd" for o in bwd) == 13
    assert sum(o.name == "attn_allreduce" for o in bwd) == 13
    w2 = build_workload(QWEN, ParallelSpec(tp=8, pp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096, recompute="none"))
    assert not any(o.name == "attention" for o in w2.instruction_ops(0, Direction.BWD))


def test_sequence_parallel_variant():
    p = ParallelSpec(tp=8, pp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096, sequence_parallel=True)
    w = build_workload(QWEN, p)
    f = ops_by_name(w.stage(0).layer_fwd)
    assert "attn_allreduce" not in f
    assert f["attn_allgather"].collective is Collective.ALL_GATHER
    assert f["attn_reducescatter"].collective is Collective.REDUCE_SCATTER
    assert f["attn_allgather"].message_bytes == 16384 // 8 * 2048 * 2
    assert f["input_norm"].bytes == build_workload(QWEN, TP8).stage(0).layer_fwd[0].bytes / 8
    gemm_attn = (OpKind.GEMM, OpKind.ATTENTION)
    assert w.microbatch_flops(gemm_attn) == build_workload(QWEN, TP8).microbatch_flops(gemm_attn)


@pytest.mark.parametrize("bad, message", [
    (dict(micro_batch_size=3), "nanobatches"),
    (dict(tp=3), "divisible by tp"),
    (dict(layer_split=(10, 10)), "layers per stage"),
    (dict(recompute="selective"), "recompute"),
])
def test_invalid_layouts_are_explained(bad, message):
    kw = dict(tp=8, pp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096) | bad
    with pytest.raises(ValueError, match=message):
        build_workload(QWEN, ParallelSpec(**kw))


# --- Megatron's num_floating_point_operations (megatron/training/training.py), dense GQA + SwiGLU case ---
def megatron_flops(model: ModelSpec, parallel: ParallelSpec, batch_size: int) -> float:
    """Reimplementation of Megatron's transformer_flops() for a dense GQA SwiGLU model (no MoE/MTP/MLA)."""
    s, h, L = parallel.seq_len, model.hidden_size, model.num_layers
    fwd_bwd, fma, ffn_factor = 3, 2, 3  # 3x: fwd + wgrad + dgrad; SwiGLU stacks h->2f and f->h
    q = model.head_dim * model.num_attention_heads
    kv = model.head_dim * model.num_kv_heads
    attn = fwd_bwd * fma * (h * (q + kv + kv) + q * s / 2 * 2 + q * h)  # causal: half the mask
    mlp = fwd_bwd * fma * h * model.ffn_hidden_size * ffn_factor
    logits = fwd_bwd * fma * h * padded_vocab_size(model.vocab_size, parallel.tp)
    return batch_size * s * (mlp * L + attn * L + logits)


def forward_terms(model: ModelSpec, parallel: ParallelSpec, batch_size: int) -> tuple[float, float]:
    """Forward FLOPs of the layers' GEMMs and of core attention, from the same formula's terms."""
    s, h, L = parallel.seq_len, model.hidden_size, model.num_layers
    q, kv = model.head_dim * model.num_attention_heads, model.head_dim * model.num_kv_heads
    gemm = 2 * (h * (q + 2 * kv) + q * h + 3 * h * model.ffn_hidden_size)
    attn = 2 * (q * s / 2 * 2)
    return batch_size * s * L * gemm, batch_size * s * L * attn


@pytest.mark.parametrize("model", [QWEN, LLAMA], ids=["qwen", "llama"])
@pytest.mark.parametrize("layout", [TP8, CP2], ids=["tp8", "cp2tp4"])
def test_flops_match_megatron_formula(model, layout):
    from dataclasses import replace

    kinds = (OpKind.GEMM, OpKind.ATTENTION)
    B = layout.micro_batch_size
    mg = megatron_flops(model, layout, B)
    layer_gemm, attn = forward_terms(model, layout, B)
    # Megatron counts attention backward as 2x forward; flash attention runs 2.5x
    ours = build_workload(model, replace(layout, recompute="none")).microbatch_flops(kinds)
    assert ours == pytest.approx(mg + (ATTENTION_BWD_FACTOR - 2) * attn, rel=1e-9)
    # full recompute reruns the layers' forward (not the output layer): hardware FLOPs, not model FLOPs
    ours_rc = build_workload(model, replace(layout, recompute="full")).microbatch_flops(kinds)
    assert ours_rc == pytest.approx(mg + layer_gemm + (ATTENTION_BWD_FACTOR - 1) * attn, rel=1e-9)
    # everything else (norms, rope, activations, loss) is a small share
    total = build_workload(model, layout).microbatch_flops()
    assert 0 < total - ours_rc < 0.01 * total


def test_kernel_shapes_are_carried_for_the_runtime():
    """GEMMs carry (m, k, n) and attention (batch, heads, seq, head_dim, cp), consistent with their FLOPs."""
    w = build_workload(LLAMA, ParallelSpec(tp=2, pp=2, micro_batch_size=4, num_microbatches=4, seq_len=2048))
    ops = ops_by_name(w.stages[0].layer_fwd)
    m, k, n = ops["qkv"].shape
    assert (m, k) == (2 * 2048, 3072) and n == (24 // 2 + 2 * 8 // 2) * 128
    assert ops["qkv"].flops == 2.0 * m * k * n
    b, heads, seq, d, cp = ops["attention"].shape
    assert (b, heads, seq, d, cp) == (2, 12, 2048, 128, 1)
    assert ops["attention"].flops == pytest.approx(4.0 * b * heads * d * seq * seq / 2)


def test_a_gelu_layernorm_model_gets_its_own_mlp_and_norms():
    """``model.activation=gelu`` and ``model.norm=layernorm`` were accepted and ignored: the graph built
    SwiGLU's double-width FC1 (MLP GEMMs 1.5x too many FLOPs) and RMSNorm whatever the config said."""
    from dataclasses import replace

    from kareus.partition.slots import slot_group
    from kareus.workload.memory import layer_parameters

    gpt = replace(LLAMA, activation="gelu", norm="layernorm")
    w, base = build_workload(gpt, TP8).stage(0), build_workload(LLAMA, TP8).stage(0)
    fwd, bfwd = ops_by_name(w.layer_fwd), ops_by_name(base.layer_fwd)
    bwd, bbwd = ops_by_name(w.layer_bwd), ops_by_name(base.layer_bwd)
    assert fwd["fc1"].flops == pytest.approx(bfwd["fc1"].flops / 2)
    assert bwd["fc1_dgrad"].flops == pytest.approx(bbwd["fc1_dgrad"].flops / 2)
    assert "gelu" in fwd and "gelu_bwd" in bwd and "swiglu" not in fwd and "swiglu_bwd" not in bwd
    assert slot_group(fwd["gelu"]) == slot_group(bfwd["swiglu"]) == "activation"
    assert fwd["gelu"].bytes == pytest.approx(bfwd["swiglu"].bytes * 2 / 3)  # in and out, not gate, up and out
    for name, ops, ref in (("input_norm", fwd, bfwd), ("input_norm_bwd", bwd, bbwd)):
        assert ops[name].flops > ref[name].flops and ops[name].bytes == ref[name].bytes  # the mean besides
    h, ffn = LLAMA.hidden_size, LLAMA.ffn_hidden_size
    (split, replicated), (bsplit, breplicated) = layer_parameters(gpt), layer_parameters(LLAMA)
    assert bsplit - split == h * ffn and replicated == 2 * breplicated  # one MLP matrix less; biases
    qwen_ln = replace(QWEN, norm="layernorm")  # qk-norms are built with the same normalization
    assert layer_parameters(qwen_ln)[1] == 2 * layer_parameters(QWEN)[1] == 2 * (2 * 2048 + 2 * 128)
    qk, bqk = (ops_by_name(build_workload(m, TP8).stage(0).layer_fwd)["qk_norm"] for m in (qwen_ln, QWEN))
    assert qk.flops > bqk.flops


def test_parameters_per_gpu_add_up_to_the_published_model_sizes():
    """Llama-3.2-3B has 3.21 B parameters (tied embeddings), Llama-3.1-8B 8.03 B (untied); split over
    tp and pp, each GPU holds its share, and an embedding tied across stages is held twice."""
    from kareus.workload.memory import stage_parameters

    one = ParallelSpec(tp=1, pp=1, micro_batch_size=1, num_microbatches=1, seq_len=4096)
    llama3b = ModelSpec("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256, tied_embeddings=True)
    llama8b = ModelSpec("llama3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256)
    assert sum(stage_parameters(llama3b, one)) == pytest.approx(3.21e9, rel=0.005)
    assert sum(stage_parameters(llama8b, one)) == pytest.approx(8.03e9, rel=0.005)
    split = stage_parameters(llama8b, ParallelSpec(tp=4, pp=2, micro_batch_size=1, num_microbatches=2, seq_len=4096))
    assert len(split) == 2 and sum(split) * 4 == pytest.approx(8.03e9, rel=0.005)
    tied = stage_parameters(llama3b, ParallelSpec(tp=1, pp=2, micro_batch_size=1, num_microbatches=2, seq_len=4096))
    assert sum(tied) - sum(stage_parameters(llama3b, one)) == pytest.approx(128256 * 3072, rel=0.01)
