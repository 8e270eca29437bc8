"""The partitioned executor in real megatron-core layers: the same loss, gradients and training
trajectory as plain megatron-core (CPU, gloo), with comms really placed at their planned slots; plans,
layouts and configs it cannot run are refused with one line naming the key."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kareus.plan.model import MadeFor
from kareus.runtime.equivalence import MODEL, VARIANTS, launch, layout, random_plan
from kareus.runtime.partitioned import PlanLayoutError, PlanRuntime, check_plan, config_problems

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

TOL = 1e-5


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_executor_equals_plain_megatron_core(variant):
    """A random plan (every slot, sequential included, random SMs; Megatron's layout for the last
    microbatch): step-0 loss and every gradient, and 10 SGD steps' losses, within 1e-5 relative."""
    r = launch(variant)
    assert r["max_rel_grad_diff"] < TOL and r["max_rel_loss_diff"] < TOL, r
    assert r["partitions_overlapped"] > 0 and r["partitions_sequential"] > 0
    assert r["losses"][-1] < r["losses"][0]  # it trains: the same data every step


def _runtime(**parallel):
    return PlanRuntime(MODEL, dataclasses.replace(layout("tp2"), **parallel))


def test_context_parallel_is_refused_naming_what_is_missing():
    with pytest.raises(PlanLayoutError, match=r"^parallel.cp: the partitioned executor runs cp=1 only, got 2;"):
        _runtime(cp=2)


def test_a_micro_batch_that_does_not_split_is_refused():
    with pytest.raises(PlanLayoutError, match=r"^parallel.micro_batch_size: 3 does not split into 2 nanobatches"):
        _runtime(micro_batch_size=3)


def test_a_plan_for_another_layout_or_model_is_refused_naming_the_key():
    rt = _runtime()
    plan = random_plan(MODEL, dataclasses.replace(layout("tp2"), seq_len=32), seed=0)
    with pytest.raises(PlanLayoutError, match=r"made for another model or layout: parallel.seq_len: plan 32 != 16"):
        check_plan(plan, rt.model, rt.parallel, set(rt.types), 0, 0)
    other = dataclasses.replace(MODEL, name="other", hidden_size=128)
    plan = dataclasses.replace(random_plan(MODEL, layout("tp2"), 0), made_for=MadeFor.of(other, layout("tp2")))
    with pytest.raises(PlanLayoutError, match=r"model.name: plan 'other' != 'equivalence'"):
        check_plan(plan, rt.model, rt.parallel, set(rt.types), 0, 0)
    with pytest.raises(PlanLayoutError, match=r"names no model or layout \(made_for"):
        check_plan(dataclasses.replace(plan, made_for=None), rt.model, rt.parallel, set(rt.types), 0, 0)


def test_an_unknown_partition_key_is_refused():
    rt = _runtime()
    plan = random_plan(MODEL, layout("tp2"), seed=0)
    ins = plan.stages[0].instructions[0]
    bad = dataclasses.replace(ins, partitions=(dataclasses.replace(ins.partitions[0], partition="fwd_bogus"),))
    stage = dataclasses.replace(plan.stages[0], instructions=(bad,) + plan.stages[0].instructions[1:])
    with pytest.raises(PlanLayoutError, match=r"names partition 'fwd_bogus', which this layout does not have; it has: "):
        check_plan(dataclasses.replace(plan, stages=(stage,)), rt.model, rt.parallel, set(rt.types), 0, 0)
    check_plan(plan, rt.model, rt.parallel, set(rt.types), 0, 0)  # the plan itself fits


def test_a_megatron_config_the_layout_does_not_describe_is_named():
    good = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                kv_channels=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                context_parallel_size=1, sequence_parallel=False, recompute_granularity=None, num_moe_experts=None)
    assert config_problems(SimpleNamespace(**good), MODEL, layout("tp2"), 4, 4) == []
    bad = config_problems(SimpleNamespace(**{**good, "hidden_size": 96, "recompute_granularity": "full"}),
                          MODEL, layout("tp2"), 4, 4)
    assert bad[0].startswith("hidden_size: the runtime's layout says 64, the megatron-core config 96")
    assert bad[1].startswith("recompute_granularity: the partitioned executor recomputes as parallel.recompute says")
