"""Partitioners: partition types, counts, slots and residual work for TP-only and CP+TP layouts."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

import kareus.partition  # noqa: F401  (registers the partitioners)
from kareus.registry import PARTITIONERS
from kareus.types import SEQUENTIAL, Collective, Direction, ModelSpec, OpKind, ParallelSpec
from kareus.workload import build_workload

QWEN = ModelSpec("qwen3-1.7b", 28, 2048, 6144, 16, 8, 128, 151936, tied_embeddings=True, qk_layernorm=True)
LLAMA = ModelSpec("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256)
TP8 = ParallelSpec(tp=8, pp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096)
CP2 = ParallelSpec(tp=4, pp=2, cp=2, micro_batch_size=8, num_microbatches=8, seq_len=4096)


def partition(model, layout, name="nanobatch", **cfg):
    return PARTITIONERS.build(name, config=cfg).partition(build_workload(model, layout))


def names(ops):
    return [o.name for o in ops]


def test_tp_only_partition_types_and_counts():
    p = partition(QWEN, TP8)
    assert [t.key for t in p.types] == ["fwd_attn", "fwd_mlp", "fwd_trail", "bwd_mlp", "bwd_attn", "bwd_trail"]
    attn = p.type("fwd_attn")
    assert names(attn.compute) == ["mlp_bda", "input_norm", "qkv", "qk_norm", "rope", "attention", "attn_proj"]
    assert attn.comm.collective is Collective.ALL_REDUCE and attn.direction is Direction.FWD
    assert names(p.type("fwd_mlp").compute) == ["attn_bda", "pre_mlp_norm", "fc1", "swiglu", "fc2"]
    fwd = {"fwd_attn": 27, "fwd_mlp": 28, "fwd_trail": 1}  # 14 layers; the first attention of nanobatch 0 is residual
    for stage in (0, 1):
        assert p.instruction(stage, Direction.FWD).counts == fwd
        # full recompute: the backward instruction reruns the forward partitions first
        assert p.instruction(stage, Direction.BWD).counts == fwd | {"bwd_mlp": 27, "bwd_attn": 28, "bwd_trail": 1}


def test_every_comm_op_is_in_exactly_one_partition():
    for layout in (TP8, CP2, replace(CP2, sequence_parallel=True)):
        w = build_workload(QWEN, layout)
        p = PARTITIONERS.build("nanobatch", config={}).partition(w)
        for work in p.work:
            st = w.stage(work.stage)
            block = (st.block_ops(Direction.FWD) if work.direction is Direction.FWD or w.recompute else ()) + (
                st.block_ops(Direction.BWD) if work.direction is Direction.BWD else ())
            comm_in_block = sum(o.is_comm for o in block) * 2
            assert sum(work.counts.values()) == comm_in_block
            assert not any(o.is_comm and o.name.startswith(("attn_", "mlp_", "cp_", "qkv_", "fc1_")) for o in work.residual)


@pytest.mark.parametrize("layout", [TP8, CP2], ids=["tp8", "cp2tp4"])
def test_work_is_conserved(layout):
    """Partitions x counts + residual = both nanobatches' instruction ops (exactly, without merging)."""
    w = build_workload(LLAMA, layout)
    for merge in (False, True):
        p = PARTITIONERS.build("nanobatch", config={"merge_boundary": merge}).partition(w)
        for work in p.work:
            ops = w.instruction_ops(work.stage, work.direction)
            flops = sum(n * sum(o.flops for o in p.type(k).compute) for k, n in work.partitions)
            flops += sum(o.flops for o in work.residual)
            comm = sum(n * p.type(k).comm.message_bytes for k, n in work.partitions)
            comm += sum(o.message_bytes for o in work.residual)
            assert comm == pytest.approx(2 * sum(o.message_bytes for o in ops), rel=1e-12)
            expected = 2 * sum(o.flops for o in ops)
            if merge:  # a stage's first chain is counted with its previous layer's residual add / norm backward
                assert expected <= flops <= expected * 1.0001
            else:
                assert flops == pytest.approx(expected, rel=1e-12)


def test_merge_boundary_off_gives_separate_first_partitions():
    p = partition(QWEN, TP8, merge_boundary=False)
    counts = p.instruction(0, Direction.FWD).counts
    assert counts["fwd_attn"] == 26 and counts["fwd_attn_first"] == 1
    assert names(p.type("fwd_attn_first").compute)[0] == "input_norm"
    assert p.instruction(0, Direction.BWD).counts["bwd_mlp_first"] == 1


def test_slots_follow_published_naming():
    p = partition(QWEN, TP8)
    attn = p.type("fwd_attn")
    assert attn.slot_labels == (SEQUENTIAL, "norm_0", "linear_0", "rope_0", "attn_0", "linear_1")
    slots = {s.label: s for s in attn.slots}
    assert slots["norm_0"].ops == (0, 1) and slots["norm_0"].kind == "memory"  # residual add + input norm
    assert slots["rope_0"].ops == (3, 4)  # qk-norm and rotary: QKV post-processing
    assert slots["attn_0"].kind == "attention" and slots["linear_1"].kind == "gemm"
    assert attn.slot("attn_0").start == 5 and attn.slot(SEQUENTIAL) is None
    with pytest.raises(KeyError):
        attn.slot("linear_9")
    assert p.type("fwd_mlp").slot_labels == (SEQUENTIAL, "norm_0", "linear_0", "activation_0", "linear_1")
    assert p.type("bwd_mlp").slot_labels == (SEQUENTIAL, "norm_0", "linear_0", "linear_1", "activation_0",
                                             "linear_2", "linear_3")
    llama = partition(LLAMA, TP8).type("fwd_attn")
    assert {s.label: s.ops for s in llama.slots}["rope_0"] == (3,)


def test_residual_contents():
    p = partition(QWEN, TP8)
    first = Counter(names(p.instruction(0, Direction.FWD).residual))
    assert first["embedding"] == 2 and first["embedding_allreduce"] == 2 and first["pp_send"] == 2
    # nanobatch 0's first chain (nothing to overlap yet) and nanobatch 1's trailing residual add
    assert first["qkv"] == 1 and first["attention"] == 1 and first["mlp_bda"] == 1
    assert "fc1" not in first
    last = Counter(names(p.instruction(1, Direction.FWD).residual))
    assert "pp_recv" not in last and last["output"] == 2 and last["cross_entropy"] == 2 and last["final_norm"] == 2
    last_bwd = Counter(names(p.instruction(1, Direction.BWD).residual))
    assert last_bwd["output_dgrad"] == 2 and last_bwd["output_allreduce_bwd"] == 2 and last_bwd["pp_send_grad"] == 2
    assert last_bwd["fc1_dgrad"] == 1 and last_bwd["qkv"] == 1  # first backward chain + recomputed first chain


def test_cp_layout_splits_attention():
    p = partition(QWEN, CP2)
    fwd = [t.key for t in p.types if t.direction is Direction.FWD]
    bwd = [t.key for t in p.types if t.direction is Direction.BWD]
    assert fwd == ["fwd_qkv_ar", "fwd_qkv_ag", "fwd_ao_ag", "fwd_ao_ar", "fwd_mlp", "fwd_trail"]
    assert bwd == ["bwd_mlp", "bwd_o_ar", "bwd_o_ag", "bwd_a_ag", "bwd_a_rs", "bwd_qkv_rs", "bwd_qkv_ar", "bwd_trail"]
    # forward: QKV, attention-output and MLP chains; backward adds the K/V re-gather before attention
    chains = {t.compute for t in p.types if t.direction is Direction.FWD and not t.key.endswith("trail")}
    assert {names(c)[-1] for c in chains} == {"rope", "attn_proj", "fc2"}
    bwd_chains = {t.compute for t in p.types if t.direction is Direction.BWD and not t.key.endswith("trail")}
    assert len(bwd_chains) == 4
    assert p.type("fwd_qkv_ag").comm.group_size == 2 and p.type("fwd_qkv_ar").comm.group_size == 4
    assert p.type("bwd_a_rs").comm.collective is Collective.REDUCE_SCATTER
    assert names(p.type("bwd_a_ag").compute) == ["attention_bwd"]
    assert p.instruction(0, Direction.FWD).counts == {"fwd_qkv_ar": 13, "fwd_qkv_ag": 14, "fwd_ao_ag": 14,
                                                      "fwd_ao_ar": 14, "fwd_mlp": 28, "fwd_trail": 1}


def test_sequential_has_same_structure_without_slots():
    nb = partition(QWEN, CP2)
    seq = partition(QWEN, CP2, name="sequential")
    assert [t.key for t in seq.types] == [t.key for t in nb.types]
    assert [w.partitions for w in seq.work] == [w.partitions for w in nb.work]
    assert all(t.slots == () and t.slot_labels == (SEQUENTIAL,) for t in seq.types)
    assert all(t.compute == nb.type(t.key).compute for t in seq.types)


def test_sequential_single_nanobatch_pairs_own_comm():
    p = partition(QWEN, replace(TP8, nanobatches=1), name="sequential")
    assert p.instruction(0, Direction.FWD).counts == {"fwd_attn": 14, "fwd_mlp": 14}
    assert names(p.instruction(0, Direction.FWD).residual).count("mlp_bda") == 1  # the trailing add
    with pytest.raises(ValueError, match="nanobatches=2"):
        partition(QWEN, replace(TP8, nanobatches=1))


def test_no_recompute_keeps_forward_out_of_backward():
    p = partition(LLAMA, replace(TP8, recompute="none"))
    assert set(p.instruction(0, Direction.BWD).counts) == {"bwd_mlp", "bwd_attn", "bwd_trail"}
    assert not any(o.kind is OpKind.ATTENTION and o.name == "attention" for o in p.instruction(0, Direction.BWD).residual)


def test_yaml_options_compose():
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from kareus.config.store import store_all

    store_all()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for name in ("nanobatch", "sequential"):
            cfg = compose(config_name=f"partitioner/{name}")
            section = cfg.partitioner if "partitioner" in cfg else cfg
            assert section.name == name
            assert PARTITIONERS.build(name, config=section).partition(build_workload(LLAMA, TP8)).types
        with pytest.raises(Exception, match="merge_boundary"):  # typed by the schema
            compose(config_name="partitioner/nanobatch", overrides=["partitioner.merge_boundary=maybe"])


def test_describe_prints_partitions():
    from rich.console import Console

    from kareus.describe import describe

    w = build_workload(QWEN, CP2)
    p = PARTITIONERS.build("nanobatch", config={}).partition(w)
    console = Console(record=True, width=250)
    describe(console, w, p, {t.key: 1000 + i for i, t in enumerate(p.types)})
    text = console.export_text()
    for needle in ("fwd_qkv_ag", "bwd_a_rs", "cp_kv_allgather", "attention_bwd", "1,013", "total search space"):
        assert needle in text


def test_random_layouts_conserve_work_and_slots_cover_chains():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    model = ModelSpec("tiny", 4, 256, 512, 8, 4, 32, 1000, qk_layernorm=True)

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 4]),
           sp=st.booleans(), recompute=st.sampled_from(["full", "none"]), nb=st.sampled_from([1, 2]))
    def check(tp, cp, pp, sp, recompute, nb):
        layout = ParallelSpec(tp=tp, cp=cp, pp=pp, micro_batch_size=4, num_microbatches=4, seq_len=256,
                              sequence_parallel=sp, recompute=recompute, nanobatches=nb)
        w = build_workload(model, layout)
        p = PARTITIONERS.build("sequential" if nb == 1 else "nanobatch", config={"merge_boundary": False}).partition(w)
        assert len({t.key for t in p.types}) == len(p.types)
        for t in p.types:
            covered = [i for s in t.slots for i in s.ops]
            assert covered == (list(range(len(t.compute))) if nb == 2 else [])
        for work in p.work:
            ops = w.instruction_ops(work.stage, work.direction)
            got = sum(n * (sum(o.flops for o in p.type(k).compute) + p.type(k).comm.message_bytes)
                      for k, n in work.partitions) + sum(o.flops + o.message_bytes for o in work.residual)
            assert got == pytest.approx(nb * sum(o.flops + o.message_bytes for o in ops), rel=1e-12)

    check()


@pytest.mark.parametrize("layout", [TP8, CP2], ids=["tp8", "cp2tp4"])
def test_megatron_reference_is_the_unsplit_layout_with_the_same_work(layout):
    """The reference runs each microbatch unsplit: the same FLOPs and comm bytes per instruction as
    the two nanobatches together, half as many (twice as large) partitions, none overlapped but the
    input-gradient all-reduces megatron-core runs wgrad under (one slot, at that wgrad)."""
    from kareus.partition import MEGATRON_PREFIX, megatron_partitioning

    w = build_workload(LLAMA, layout)
    nb = PARTITIONERS.build("nanobatch", config={"merge_boundary": False}).partition(w)
    meg = megatron_partitioning(w, merge_boundary=False)
    assert all(t.key.startswith(MEGATRON_PREFIX) for t in meg.types)
    for t in meg.types:
        if t.comm.name in ("fc1_allreduce_bwd", "qkv_allreduce_bwd"):
            assert len(t.slots) == 1 and t.compute[t.slots[0].ops[0]].name == t.comm.name.split("_")[0] + "_wgrad"
        else:
            assert t.slots == ()

    def totals(p, work):
        flops = sum(n * sum(o.flops for o in p.type(k).compute) for k, n in work.partitions)
        comm = sum(n * p.type(k).comm.message_bytes for k, n in work.partitions)
        return (flops + sum(o.flops for o in work.residual), comm + sum(o.message_bytes for o in work.residual))

    for work in nb.work:
        unsplit = meg.instruction(work.stage, work.direction)
        assert totals(meg, unsplit) == pytest.approx(totals(nb, work), rel=1e-9)
        assert 2 * sum(unsplit.counts.values()) == sum(work.counts.values())


@pytest.mark.parametrize("layout", [replace(TP8, sequence_parallel=True), replace(CP2, sequence_parallel=True)])
def test_megatron_overlaps_the_sp_regather_with_dgrad_and_the_reduce_scatter_with_wgrad(layout):
    """megatron-core launches the re-gather of a column-parallel input with dgrad and its input
    gradient's reduce-scatter with wgrad; every other comm of Megatron's layout runs after its compute."""
    from kareus.partition.sequential import megatron_partitioning, megatron_slot

    types = megatron_partitioning(build_workload(QWEN, layout)).types
    at = {t.comm.name: [o.name for o in t.compute][t.slots[0].ops[0]] for t in types if megatron_slot(t) != SEQUENTIAL}
    assert at == {"fc1_regather_bwd": "fc1_dgrad", "fc1_reducescatter_bwd": "fc1_wgrad",
                  "qkv_regather_bwd": "qkv_dgrad", "qkv_reducescatter_bwd": "qkv_wgrad"}
