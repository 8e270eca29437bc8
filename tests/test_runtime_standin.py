"""The single-device stand-in for the executor's collectives: the values a one-rank collective leaves, the
launch/join interface of CommIssuer, the persistent-block copy where it runs, and a tp layout's block
program run by PlanRuntime(stand_in_tp=True) in megatron-core layers against megatron-core's own."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kareus.runtime import smcopy  # noqa: E402
from kareus.runtime.standin import KINDS, StandInIssuer  # noqa: E402
from kareus.types import ModelSpec, ParallelSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelSpec("t", 2, 64, 128, 4, 2, 16, 128)
TP2 = ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_collective_leaves_the_values_of_one_rank_in_a_new_tensor(kind, dtype):
    issuer = StandInIssuer("cpu")
    x = torch.randn(8, 2, 16).to(dtype)
    before = x.clone()
    out = issuer.join(issuer.launch(kind, x, 8))
    assert out.shape == x.shape and out.dtype == dtype and torch.equal(out, before)
    assert out.data_ptr() != x.data_ptr()  # a copy of the bytes, as a kernel would write them
    assert torch.equal(x, before)  # the input is left as it was
    assert issuer.launches == 1 and issuer.bytes == x.numel() * x.element_size()
    assert dict(issuer.kernels) == {"torch": 1}  # no Triton on the CPU: a plain copy


def test_a_strided_input_comes_back_contiguous_with_its_values():
    issuer = StandInIssuer(torch.device("cpu"))
    x = torch.randn(4, 6, 8).transpose(0, 1)
    out = issuer.join(issuer.launch("all_gather", x, 4))
    assert out.is_contiguous() and torch.equal(out, x)


def test_launches_in_flight_are_joined_in_any_order():
    issuer = StandInIssuer("cpu")
    a, b = torch.randn(5, 3), torch.randn(7, 3)
    pa, pb = issuer.launch("all_reduce", a, 2), issuer.launch("reduce_scatter", b, None)
    assert torch.equal(issuer.join(pb), b) and torch.equal(issuer.join(pa), a)
    assert issuer.launches == 2


def test_refusals_name_what_is_wrong(monkeypatch):
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        StandInIssuer("cpu").launch("broadcast", torch.ones(2), 4)
    with pytest.raises(ValueError, match="kernel must be one of"):
        StandInIssuer("cpu", kernel="nccl")
    with pytest.raises(ValueError, match="default_sms must be positive"):
        StandInIssuer("cpu", default_sms=0)
    monkeypatch.setattr(smcopy, "available", lambda device: False)
    with pytest.raises(ValueError, match="kernel=sm: the persistent copy cannot run on cpu"):
        StandInIssuer("cpu", kernel="sm")


def test_the_copy_runs_on_the_planned_blocks_where_the_persistent_kernel_runs(monkeypatch):
    calls = []

    def sm_copy(src, dst, sms):
        calls.append((src.numel(), sms))
        dst.copy_(src)

    monkeypatch.setattr(smcopy, "available", lambda device: True)
    monkeypatch.setattr(smcopy, "sm_copy", sm_copy)
    issuer = StandInIssuer("cpu", default_sms=12)
    x = torch.randn(6, 4)
    assert torch.equal(issuer.join(issuer.launch("all_reduce", x, 8)), x)
    assert torch.equal(issuer.join(issuer.launch("all_reduce", x, None)), x)  # a comm no partition pairs
    assert calls == [(24, 8), (24, 12)] and dict(issuer.kernels) == {"sm": 2}
    monkeypatch.setattr(smcopy, "MAX_ELEMENTS", 10)  # beyond the kernel's 32-bit offsets: copy_
    issuer.join(issuer.launch("all_reduce", x, 8))
    assert issuer.kernels["torch"] == 1 and len(calls) == 2
    plain = StandInIssuer("cpu", kernel="torch")
    plain.join(plain.launch("all_reduce", x, 8))
    assert dict(plain.kernels) == {"torch": 1} and len(calls) == 2
    no_default = StandInIssuer("cpu")
    no_default.join(no_default.launch("all_reduce", x, None))
    assert dict(no_default.kernels) == {"torch": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_on_a_gpu_the_copy_runs_on_a_side_stream_the_main_stream_waits_for():
    issuer = StandInIssuer(torch.device("cuda", 0), default_sms=8)
    main = torch.cuda.current_stream()
    x = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    y = x * 2  # queued on the main stream: the side stream must wait for it
    pending = issuer.launch("all_reduce", y, 16)
    out = issuer.join(pending)
    assert torch.cuda.current_stream() == main and issuer.side != main
    assert torch.equal(out, x * 2)
    assert issuer.kernels["sm" if smcopy.available(x.device) else "torch"] == 1


# -- PlanRuntime(stand_in_tp=True): one device holding one tp rank's shard ----------------------------------
def _config(**overrides):
    want = dict(num_layers=2, hidden_size=64, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=1,
                kv_channels=16, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, sequence_parallel=False, recompute_granularity=None, num_moe_experts=None)
    return SimpleNamespace(**{**want, **overrides})


def test_a_stand_in_runtime_takes_a_one_device_model_of_one_tp_ranks_shard():
    from kareus.runtime.partitioned import PlanLayoutError, PlanRuntime, config_problems

    runtime = PlanRuntime(MODEL, TP2, stand_in_tp=True)
    runtime.check_model(_config())
    assert runtime.types  # the tp layout's partitions: its block program has collectives to stand in for
    with pytest.raises(PlanLayoutError, match="num_attention_heads: the runtime's layout says 2"):
        runtime.check_model(_config(num_attention_heads=4))  # the whole model's heads: not one rank's shard
    with pytest.raises(PlanLayoutError, match="tensor_model_parallel_size: the runtime's layout says 1"):
        runtime.check_model(_config(tensor_model_parallel_size=2))
    tp3 = ParallelSpec(tp=3, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=16)
    assert config_problems(_config(), MODEL, tp3, None, 2, stand_in_tp=True) == [
        "ffn_hidden_size: 128 does not split over tp=3, so no device holds one tp rank's shard"]


def test_without_the_stand_in_a_runtime_still_wants_the_layouts_own_model():
    from kareus.runtime.partitioned import PlanLayoutError, PlanRuntime

    runtime = PlanRuntime(MODEL, TP2)
    runtime.check_model(_config(ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                                tensor_model_parallel_size=2))
    with pytest.raises(PlanLayoutError, match="ffn_hidden_size: the runtime's layout says 128"):
        runtime.check_model(_config())  # one rank's shard on one device: refused without stand_in_tp


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_a_tp2_block_program_runs_on_one_process_as_megatron_cores_layers_do():
    """device_check's layers section on the CPU: megatron-core at tp=1 with one tp=2 rank's shard, the
    partitioned executor (stand-in collectives) against the local spec, one training step, fp32."""
    pytest.importorskip("megatron.core")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), "--cpu", "--only", "layers"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    layers = summary["checks"]["layers"]
    assert summary["passed"] and set(summary["checks"]) == {"layers"} and layers["ok"], layers
    eq = layers["equivalence"]
    assert eq["ok"] and eq["max_rel_grad_diff"] <= 1e-4 and eq["rel_loss_diff"] <= 1e-4 and not eq["missing_grads"]
    assert eq["partitions_overlapped"] > 0  # the random plan placed comms inside the other nanobatch's chain
    assert layers["stand_in"]["launches"] > 0 and layers["stand_in"]["kernels"] == {"torch": layers["stand_in"]["launches"]}
    keys = {r["partition"] for r in layers["rows"]}
    assert keys == {"fwd_attn", "fwd_mlp", "fwd_trail", "bwd_attn", "bwd_mlp", "bwd_trail"}
    assert all(r["time_ms"] > 0 and r["sequential_ms"] > 0 for r in layers["rows"])
    assert set(layers["block"]["best_slots"]) == keys


def test_binding_a_plan_in_a_process_group_keeps_the_stand_in_for_the_block(monkeypatch):
    """A distributed process (a world of one) would get the TP group's communicators at bind; a stand-in
    runtime builds its stand-in at its first block instead."""
    from kareus.profiler.frequency import UnlockedFrequencyConfig, UnlockedFrequencyController
    from kareus.runtime import partitioned
    from kareus.runtime.equivalence import random_plan
    from kareus.runtime.executor import PlanExecutor

    monkeypatch.setattr(partitioned, "_distributed", lambda: True)
    runtime = partitioned.PlanRuntime(MODEL, TP2, stand_in_tp=True)
    runtime.bind(PlanExecutor(random_plan(MODEL, TP2, 0), UnlockedFrequencyController(UnlockedFrequencyConfig()), 0))
    assert runtime.comm is None
