"""Partition kernels on one real megatron-core layer (CPU, fp32, tiny shapes): one repeatable kernel per
op of every partition, the executor's ops reproducing megatron-core's own layer forward and backward, and
partitions or layouts the layer cannot stand in for refused with one line."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from kareus.runtime.layer_kernels import (LayerBench, LayerBenchError, bench_problems, layer_kernels,  # noqa: E402
                                          partition_layout, partition_problem)
from kareus.types import ModelSpec, ParallelSpec  # noqa: E402

MODEL = ModelSpec("layer-bench", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=128)
PARALLEL = ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=16)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _partitions(model: ModelSpec = MODEL, parallel: ParallelSpec = PARALLEL, merge_boundary: bool = True):
    import kareus.partition  # noqa: F401  (registers the partitioners)
    from kareus.registry import PARTITIONERS
    from kareus.workload import build_workload

    config = {} if merge_boundary else {"merge_boundary": False}
    return PARTITIONERS.build("nanobatch", config=config).partition(build_workload(model, parallel)).types


@pytest.fixture(scope="module")
def bench():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    b = LayerBench(MODEL, PARALLEL, "cpu", torch.float32, seed=0)
    yield b
    b.close()
    assert not dist.is_initialized()  # the one-rank group it started is gone with it


def _clone(outs):
    return tuple(t.detach().clone() for t in outs)


def test_every_partition_gets_one_repeatable_kernel_per_compute_op(bench):
    types = {t.key: t for t in (*_partitions(), *_partitions(merge_boundary=False))}
    assert {"fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp", "fwd_attn_first", "bwd_mlp_first"} <= set(types)
    for p in types.values():
        kernels = layer_kernels(p, bench)
        assert len(kernels) == len(p.compute), p.key
        for op, kernel in zip(p.compute, kernels):
            first = _clone(kernel())
            second = kernel()
            assert first and len(first) == len(second), (p.key, op.name)
            for a, b in zip(first, second):
                assert torch.equal(a, b), (p.key, op.name)  # the same inputs, the same result: nothing consumed


def test_kernels_run_the_workload_graphs_shapes(bench):
    p = {t.key: t for t in _partitions()}["bwd_attn"]
    outs = {op.name: k() for op, k in zip(p.compute, layer_kernels(p, bench))}
    shape = {op.name: op.shape for op in p.compute}
    m, k, n = shape["attn_proj_wgrad"]  # a wgrad is [in, tokens] x [tokens, out]: the weight's shape, transposed
    assert outs["attn_proj_wgrad"][0].shape == (n, k) and m == 16 * 2
    tokens, out_width, in_width = shape["qkv_dgrad"]
    assert outs["qkv_dgrad"][0].shape == (16, 2, in_width) and tokens == 32 and out_width == (4 + 2 * 2) // 2 * 16
    batch, heads, seq, head_dim, _ = shape["attention_bwd"]
    dq = outs["attention_bwd"][0]
    assert dq.shape == (seq, batch, heads, head_dim)  # [sequence, batch, heads, head dim], one GPU's heads


def test_the_executors_ops_reproduce_megatron_cores_layer_forward(bench):
    ref, _ = bench.layer(hidden_states=bench.hidden, attention_mask=bench.call.mask, rotary_pos_emb=bench.call.rotary)
    torch.testing.assert_close(bench.output, ref.detach(), rtol=1e-5, atol=1e-5)  # the ops chained, layer 0
    env = bench.forward_state.env
    for p in _partitions():  # each forward kernel computes what the chain computed at its place
        if p.direction.value != "fwd":
            continue
        for op, kernel in zip(p.compute, layer_kernels(p, bench)):
            entry = bench.table[op.name]
            names = (entry.out,) if hasattr(entry, "out") else entry.outs
            for name, got in zip(names, kernel()):
                assert torch.equal(got, env[(0, name)]), (p.key, op.name, name)
    trail = {t.key: t for t in _partitions()}["fwd_trail"]  # the layer's last op, run alone
    torch.testing.assert_close(layer_kernels(trail, bench)[0]()[0], ref.detach(), rtol=1e-5, atol=1e-5)


def test_the_executors_backward_ops_reproduce_megatron_cores_gradients(bench):
    layer = bench.layer
    x = bench.hidden.detach().clone().requires_grad_()
    try:
        out, _ = layer(hidden_states=x, attention_mask=bench.call.mask, rotary_pos_emb=bench.call.rotary)
        out.backward(bench.grad_output)
        torch.testing.assert_close(bench.input_grad, x.grad, rtol=1e-5, atol=1e-5)
        for name, param in layer.named_parameters():
            torch.testing.assert_close(bench.param_grads[name], param.grad, rtol=1e-5, atol=1e-5, msg=name)
    finally:
        for param in layer.parameters():
            param.grad = None
    trail = {t.key: t for t in _partitions()}["bwd_trail"]  # input_norm_bwd: the layer's input gradient
    assert torch.equal(layer_kernels(trail, bench)[0]()[0], bench.input_grad)


def test_a_partition_of_another_model_or_not_of_the_layer_is_refused(bench):
    from kareus.types import Op, OpKind

    wider = dataclasses.replace(MODEL, hidden_size=128)
    other = {t.key: t for t in _partitions(wider)}["fwd_mlp"]
    with pytest.raises(LayerBenchError, match=r"^partition fwd_mlp: op attn_bda has shape .* the partition is of "
                                              r"another model or layout$"):
        layer_kernels(other, bench)
    mine = {t.key: t for t in _partitions()}["fwd_mlp"]
    bogus = dataclasses.replace(mine, compute=mine.compute[:-1] + (Op("bogus", OpKind.ELEMENTWISE),))
    assert "op 'bogus' is not a fwd op of the model's transformer layer" in partition_problem(bogus, MODEL, PARALLEL)
    assert partition_problem(mine, MODEL, PARALLEL) == ""
    from kareus.partition import megatron_partitioning
    from kareus.workload import build_workload

    reference = megatron_partitioning(build_workload(MODEL, PARALLEL)).type("megatron:fwd_mlp")  # microbatch unsplit
    assert partition_problem(reference, MODEL, PARALLEL) != ""
    assert partition_layout(reference, MODEL, PARALLEL) == dataclasses.replace(PARALLEL, nanobatches=1)
    assert partition_layout(mine, MODEL, PARALLEL) == PARALLEL
    with pytest.raises(LayerBenchError, match="^partition fwd_mlp: op attn_bda has shape"):
        partition_layout(other, MODEL, PARALLEL)


@pytest.mark.parametrize("change,key", [({"sequence_parallel": True, "seq_len": 15}, "parallel.seq_len: "),
                                        ({"cp": 2}, "parallel.cp: "), ({"micro_batch_size": 3}, "parallel.micro_batch_size: ")])
def test_layouts_one_layer_cannot_stand_in_for_are_refused_with_one_line(change, key):
    parallel = dataclasses.replace(PARALLEL, **change)
    problems = bench_problems(MODEL, parallel)
    assert problems and problems[0].startswith(key) and "\n" not in problems[0]
    with pytest.raises(LayerBenchError, match="^" + key):
        LayerBench(MODEL, parallel, "cpu", torch.float32)
    assert bench_problems(MODEL, PARALLEL) == []


def test_a_sequence_parallel_layer_runs_a_shard_through_norms_and_the_gathered_sequence_through_gemms():
    """Under sequence parallelism one rank's shard goes in; its output equals megatron-core's layer on that
    shard alone (the all-gather's stand-in repeats the shard, and causal attention over the first copy
    sees the same tokens at the same positions); every partition's kernels run at the graph's shapes."""
    parallel = dataclasses.replace(PARALLEL, sequence_parallel=True)
    b = LayerBench(MODEL, parallel, "cpu", torch.float32, seed=2)
    try:
        shard = PARALLEL.seq_len // PARALLEL.tp
        assert b.hidden.shape == (shard, 2, MODEL.hidden_size)
        ref, _ = b.layer(hidden_states=b.hidden, attention_mask=b.call.mask[..., :shard, :shard],
                         rotary_pos_emb=b.call.rotary[:shard])
        torch.testing.assert_close(b.output, ref.detach(), rtol=1e-5, atol=1e-5)
        types = {t.key: t for t in _partitions(MODEL, parallel)}
        assert {"fwd_attn_ag", "fwd_attn_rs", "fwd_mlp_ag", "fwd_mlp_rs", "bwd_attn", "bwd_qkvw_rs"} <= set(types)
        for p in types.values():
            outs = {op.name: _clone(k()) for op, k in zip(p.compute, layer_kernels(p, b))}
            for op in p.compute:
                want = b.expected_shape(op)
                if want is not None and op.name in ("qkv", "fc1", "attn_proj", "fc2"):
                    assert outs[op.name][0].shape[:2] == (PARALLEL.seq_len, 2), (p.key, op.name)  # the gathered sequence
            for name in ("input_norm", "pre_mlp_norm"):
                if name in outs:
                    assert outs[name][0].shape[0] == shard, (p.key, name)  # the shard
            for op, kernel in zip(p.compute, layer_kernels(p, b)):
                assert all(torch.equal(x, y) for x, y in zip(outs[op.name], kernel())), (p.key, op.name)
    finally:
        b.close()


def test_layer_variants_build_and_reproduce_megatron_core():
    """qk-layernorm, LayerNorm and GELU layers, at TP 4 with recorded forwards (``recompute: none``)."""
    model = dataclasses.replace(MODEL, qk_layernorm=True, norm="layernorm", activation="gelu", num_attention_heads=8,
                                num_kv_heads=4)
    parallel = dataclasses.replace(PARALLEL, tp=4, recompute="none")
    b = LayerBench(model, parallel, "cpu", torch.float32, seed=1)
    try:
        ref, _ = b.layer(hidden_states=b.hidden, attention_mask=b.call.mask, rotary_pos_emb=b.call.rotary)
        torch.testing.assert_close(b.output, ref.detach(), rtol=1e-5, atol=1e-5)
        for p in _partitions(model, parallel):
            for op, kernel in zip(p.compute, layer_kernels(p, b)):
                first = _clone(kernel())
                assert all(torch.equal(x, y) for x, y in zip(first, kernel())), (p.key, op.name)
    finally:
        b.close()


@pytest.mark.gpu
@gpu
def test_gpu_layer_kernels_reproduce_megatron_core_in_bf16_and_repeat():
    b = LayerBench(MODEL, PARALLEL, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, seed=0)
    try:
        ref, _ = b.layer(hidden_states=b.hidden, attention_mask=b.call.mask, rotary_pos_emb=b.call.rotary)
        torch.testing.assert_close(b.output.float(), ref.detach().float(), rtol=2e-2, atol=2e-2)
        for p in _partitions():
            kernels = layer_kernels(p, b)
            for _ in range(3):
                for k in kernels:
                    k()
            torch.cuda.synchronize()
    finally:
        b.close()


@pytest.mark.gpu
@gpu
def test_gpu_backend_measures_a_layer_partition_with_energy():
    from _hw_helpers import shipped_gpu_config

    from kareus.runtime.backend import CudaBackend, with_layout
    from kareus.types import Candidate

    b = CudaBackend(with_layout(shipped_gpu_config(), MODEL, PARALLEL))
    try:
        for key, slot in (("fwd_attn", "attn_0"), ("bwd_mlp", "linear_1")):
            p = {t.key: t for t in _partitions()}[key]
            r = b.measure(p, Candidate(key, slot, 16, b.gpu.max_mhz), 0.2)
            assert r.ok and r.energy_j > 0 and r.time_s > 0, r
    finally:
        b.close()
