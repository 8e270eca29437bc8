"""The cuda hardware backend on the CPU: slot/join order, windows, failed energy, config; GPU checks marked."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest

torch = pytest.importorskip("torch")

from kareus.hardware.base import HardwareBackend  # noqa: E402
from kareus.registry import HARDWARE  # noqa: E402
from kareus.runtime import CudaBackend, CudaConfig, launch_points  # noqa: E402
from kareus.runtime.shapes import gemm_shape  # noqa: E402
from kareus.types import SEQUENTIAL, Candidate, Collective, Direction, Link, Op, OpKind, PartitionType, Slot  # noqa: E402
from kareus.workload.ops import comm, gemm, memory  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _partition(join: int | None = None) -> PartitionType:
    ops = (memory("norm", OpKind.NORM, 64 * 64, 4, 2), gemm("qkv", 64, 32, 96),
           Op("attention", OpKind.ATTENTION, flops=4.0 * 64 * 64 / 2 * 64, bytes=2 * 4 * 64 * 64),
           gemm("proj", 64, 32, 32))
    slots = (Slot("norm_0", (0,), "memory"), Slot("linear_0", (1,), "gemm"), Slot("attn_0", (2,), "attention"),
             Slot("linear_1", (3,), "gemm"))
    return PartitionType("fwd_attn", Direction.FWD, ops, comm("ar", Collective.ALL_REDUCE, 4096, 2, Link.NVLINK),
                         slots, join)


class Recorder:
    """A comm backend and compute kernels that log the order in which the backend issues them."""

    name = "recorder"

    def __init__(self) -> None:
        self.log: list[str] = []

    def world_size(self) -> int:
        return 1

    def prepare(self, op, sms, device):
        rec = self

        class Handle:
            def wait(self) -> None:
                rec.log.append("join")

        def launch():
            rec.log.append(f"comm@{sms}")
            return Handle()

        return launch

    def install(self, backend: CudaBackend, partition: PartitionType) -> None:
        backend._compute[partition.key] = [
            (lambda i=i: self.log.append(f"op{i}")) for i in range(len(partition.compute))]


def _cpu(**kw) -> CudaBackend:
    return CudaBackend(CudaConfig(device="cpu", comm="copy", warmup=1, **kw))


@pytest.mark.parametrize("slot,join,order", [
    (SEQUENTIAL, None, ["comm@8", "join", "op0", "op1", "op2", "op3"]),
    ("norm_0", None, ["comm@8", "op0", "op1", "op2", "op3", "join"]),
    ("attn_0", None, ["op0", "op1", "comm@8", "op2", "op3", "join"]),
    ("linear_0", 2, ["op0", "comm@8", "op1", "op2", "join", "op3"]),
    ("linear_1", 3, ["op0", "op1", "op2", "comm@8", "op3", "join"]),
])
def test_comm_launches_before_the_slot_op_and_joins_after_the_join_op(slot, join, order):
    p = _partition(join)
    rec = Recorder()
    b = CudaBackend(CudaConfig(device="cpu"), comm=rec)
    rec.install(b, p)
    b.run_partition(p, slot, 8)
    assert rec.log == order


def test_launch_points_reject_a_join_before_the_launch_and_unknown_slots():
    assert launch_points(_partition(), "attn_0") == (2, 3)
    assert launch_points(_partition(1), SEQUENTIAL) == (None, 1)
    with pytest.raises(ValueError, match="joins after op 1"):
        launch_points(_partition(1), "attn_0")
    with pytest.raises(KeyError, match="no slot"):
        launch_points(_partition(), "attn_9")


def test_cpu_measure_times_the_window_and_marks_energy_failed():
    b = _cpu()
    assert isinstance(b, HardwareBackend)
    p = _partition()
    c = Candidate(p.key, "attn_0", 16, b.gpu.max_mhz)
    assert b.run_once(p, c) > 0
    r = b.measure(p, c, 0.05)
    assert not r.ok and math.isnan(r.energy_j) and "energy is unavailable on device cpu" in r.error
    assert r.time_s > 0 and r.executions >= 1 and r.window_s == pytest.approx(r.time_s * r.executions)
    assert r.window_s >= 0.02  # about the asked window (calibrated from the fastest of three runs)
    ops = b.measure_ops(p.compute, 0.02)
    assert ops.time_s > 0 and not ops.ok


def test_residual_collectives_run_in_order_alone_at_the_default_sms():
    rec = Recorder()
    b = CudaBackend(CudaConfig(device="cpu", comm="copy", warmup=0), comm=rec)
    seen = []
    ops = (gemm("head", 16, 16, 16), comm("pp_send", Collective.SEND_RECV, 1024, 2, Link.NETWORK),
           memory("loss", OpKind.ELEMENTWISE, 16 * 16, 4, 2))
    steps = b.residual_chain(ops)
    assert len(steps) == 3 and b.residual_chain(ops) is steps  # built once per sequence
    for i, step in enumerate(steps):
        out = step()
        seen.append("comm" if out is None else f"op{i}")
    assert seen == ["op0", "comm", "op2"]
    assert rec.log == [f"comm@{b.gpu.default_comm_sms}", "join"]  # waited on before the next op
    r = b.measure_ops(ops, 0.01)
    assert r.time_s > 0 and rec.log.count("join") == rec.log.count(f"comm@{b.gpu.default_comm_sms}") > 2
    bigger = (ops[0], comm("pp_send", Collective.SEND_RECV, 64 << 20, 2, Link.NETWORK), ops[2])
    assert b.residual_chain(bigger) is not steps  # a collective's size is part of what is measured


def test_collectives_whose_sizes_differ_past_six_digits_get_launchers_of_their_own():
    """Two residual sends of 16,777,216 and 16,777,220 bytes: one prepared launcher for both would
    measure the second with the first one's buffers."""
    class Sizes(Recorder):
        def prepare(self, op, sms, device):
            self.sizes = getattr(self, "sizes", []) + [op.message_bytes]
            return super().prepare(op, sms, device)

    rec = Sizes()
    b = CudaBackend(CudaConfig(device="cpu", comm="copy", warmup=0), comm=rec)
    sends = [comm("pp_send", Collective.SEND_RECV, n, 2, Link.NETWORK) for n in (16_777_216, 16_777_220)]
    b.residual_chain((sends[0],))
    b.residual_chain((sends[1],))
    assert rec.sizes == [16_777_216, 16_777_220]


def test_candidate_clock_and_sms_are_checked():
    b = _cpu()
    p = _partition()
    with pytest.raises(ValueError, match="lock it with the frequency controller"):
        b.measure(p, Candidate(p.key, "attn_0", 16, 1005), 0.01)
    b.set_clock(1005)  # the controller's bookkeeping call
    assert b.clock() == 1005
    with pytest.raises(ValueError, match="comm SMs"):
        b.measure(p, Candidate(p.key, "attn_0", b.gpu.sms, 1005), 0.01)
    with pytest.raises(ValueError, match="no locked clock"):
        b.set_clock(1001)


def test_stand_in_kernels_of_a_backend_that_names_no_model_have_the_op_shapes():
    b = _cpu()
    p = _partition()
    outs = [k() for k in b.compute_kernels(p)]
    g = gemm_shape(p.compute[1])
    assert tuple(outs[1].shape) == (g.m, g.n) and g.flops == pytest.approx(p.compute[1].flops, rel=0.3)
    assert outs[2].shape[-1] == 128 and outs[2].shape[-2] % 8 == 0  # attention [batch, heads, seq, head_dim]
    assert outs[0].numel() == math.ceil(p.compute[0].bytes / 6)


def test_stand_in_attention_backward_kernel_runs_autograd_repeatedly():
    b = _cpu()
    bwd = Op("attention_bwd", OpKind.ATTENTION, flops=2.5 * 4.0 * 64 * 64 / 2 * 128, bytes=2 * 2 * 4 * 64 * 128)
    p = PartitionType("bwd_attn", Direction.BWD, (bwd,), comm("ar", Collective.ALL_REDUCE, 1024, 2, Link.NVLINK),
                      (Slot("attn_0", (0,), "attention"),))
    k = b.compute_kernels(p)[0]
    g1, g2 = k(), k()
    assert len(g1) == 3 and torch.equal(g1[0], g2[0])


# -- partitions on the model's own megatron-core layer ---------------------------------------------------------
def _layer_layout():
    from kareus.types import ModelSpec, ParallelSpec

    return (ModelSpec("layer-bench", 4, 64, 128, 4, 2, 16, 128),
            ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=16))


def _layer_partitions(model, parallel):
    import kareus.partition  # noqa: F401  (registers the partitioners)
    from kareus.registry import PARTITIONERS
    from kareus.workload import build_workload

    return {t.key: t for t in PARTITIONERS.build("nanobatch", config={}).partition(build_workload(model, parallel)).types}


def test_a_backend_that_names_the_model_measures_partitions_on_its_megatron_core_layer():
    import torch.distributed as dist

    pytest.importorskip("megatron.core")
    from kareus.errors import KareusError
    from kareus.runtime.backend import with_layout
    from kareus.runtime.layer_kernels import LayerBench

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    model, parallel = _layer_layout()
    parts = _layer_partitions(model, parallel)
    b = CudaBackend(with_layout(CudaConfig(device="cpu", comm="copy", warmup=0, dtype="float32"), model, parallel))
    assert b.cfg.layout() == (model, parallel) and b.partition_problems(list(parts.values())) == []
    try:
        p = parts["fwd_mlp"]
        kernels = b.compute_kernels(p)
        assert len(kernels) == len(p.compute) and b.compute_kernels(p) is kernels  # built once per partition
        assert isinstance(b.layer_bench(), LayerBench) and b.layer_bench().layer.mlp.linear_fc1.weight.shape == (128, 64)
        outs = [k()[0] for k in kernels]  # attn_bda, pre_mlp_norm, fc1, swiglu, fc2 of one nanobatch
        m, k, n = p.compute[2].shape  # fc1: [tokens, hidden] x [hidden, 2 x ffn / tp]
        assert tuple(outs[2].shape) == (16, 2, n) and m == 32 and k == 64
        r = b.measure(p, Candidate(p.key, "linear_1", 8, b.gpu.max_mhz), 0.02)
        assert r.time_s > 0 and r.executions >= 1 and "energy is unavailable" in r.error
        bwd = parts["bwd_attn"]
        assert b.run_once(bwd, Candidate(bwd.key, "attn_0", 8, b.gpu.max_mhz)) > 0
        from kareus.partition import megatron_partitioning
        from kareus.workload import build_workload

        reference = megatron_partitioning(build_workload(model, parallel)).type("megatron:bwd_mlp")  # unsplit
        assert b.partition_problems([reference]) == []
        assert b.run_once(reference, Candidate(reference.key, "linear_3", 8, b.gpu.max_mhz)) > 0
        assert b.layer_bench(dataclasses.replace(parallel, nanobatches=1)).hidden.shape == (16, 4, 64)
        assert b.layer_bench().hidden.shape == (16, 2, 64)  # one nanobatch of two sequences
        other = _layer_partitions(dataclasses.replace(model, hidden_size=128), parallel)["fwd_attn"]
        [line] = b.partition_problems([other])  # refused before any candidate, and at the first one
        assert line.startswith("partition fwd_attn: op mlp_bda has shape") and "another model or layout" in line
        with pytest.raises(KareusError, match="another model or layout"):
            b.compute_kernels(other)
    finally:
        b.close()
    assert not dist.is_initialized()  # the bench's one-rank group is gone with the backend


def test_sequence_parallel_partitions_are_measured_and_context_parallel_ones_refused():
    import torch.distributed as dist

    from kareus.runtime.backend import with_layout

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    model, parallel = _layer_layout()
    sp = dataclasses.replace(parallel, sequence_parallel=True)
    parts = _layer_partitions(model, sp)
    b = CudaBackend(with_layout(CudaConfig(device="cpu", comm="copy", warmup=0, dtype="float32"), model, sp))
    try:
        assert b.cfg.problems() == [] and b.partition_problems(list(parts.values())) == []
        for key, slot in (("fwd_attn_ag", "sequential"), ("bwd_qkvw_rs", None)):
            p = parts[key]
            c = Candidate(p.key, slot or p.slot_labels[-1], 4, b.gpu.max_mhz)
            assert b.run_once(p, c) > 0, key
        assert b.layer_bench().hidden.shape[0] == sp.seq_len // sp.tp  # one rank's sequence shard
    finally:
        b.close()
    cp = dataclasses.replace(parallel, cp=2)
    lines = CudaBackend(with_layout(CudaConfig(device="cpu", comm="copy"), model, cp)).cfg.problems()
    assert len(lines) == 1 and lines[0].startswith("parallel.cp: the cuda backend measures partitions on one "
                                                    "megatron-core layer at cp=1 only")


def test_the_pipeline_builds_cuda_backends_with_the_runs_model_and_layout(compose, tmp_path):
    import kareus.runtime  # noqa: F401  (registers the cuda schema)
    from kareus.config.validate import validate
    from kareus.pipeline.context import build_context
    from kareus.pipeline.searching import hardware_section, make_backend, make_tasks

    cfg = compose("+model=tiny", "parallel=pp1_tp2", "hardware=a100_cuda", "hardware.device=cpu",
                  "hardware.comm=copy")
    ctx = build_context(cfg, validate(cfg), tmp_path)
    backend = make_backend(ctx)
    try:
        assert backend.cfg.layout() == (ctx.model, ctx.parallel)
    finally:
        backend.close()
    [task] = make_tasks(ctx, ctx.partitioning.types[:1], lambda p: [])  # what a worker builds its backend from
    assert task.hardware == hardware_section(ctx)
    assert HARDWARE.build_config("cuda", task.hardware).layout() == (ctx.model, ctx.parallel)
    sim = compose("+model=tiny", "parallel=pp1_tp2")  # a backend without the fields gets none
    assert "model" not in hardware_section(build_context(sim, validate(sim), tmp_path / "sim"))


@pytest.mark.parametrize("option,sms", [("a100_cuda", 108), ("h100_cuda", 132), ("h200_cuda", 132)])
def test_registered_config_composes_and_validates(compose, option, sms):
    import kareus.runtime  # noqa: F401  (registers the cuda schema)

    cfg = compose("+model=tiny", f"hardware={option}")
    hw = HARDWARE.build_config("cuda", cfg.hardware)
    assert isinstance(hw, CudaConfig) and hw.comm == "nccl" and hw.energy == "nvml" and hw.sms == sms
    assert hw.problems() == []
    bad = CudaConfig(device="tpu", comm="mpi", energy="rapl", scale=2.0)
    text = "\n".join(bad.problems())
    for word in ("hardware.device", "hardware.comm", "hardware.energy", "hardware.scale"):
        assert word in text


def test_device_cuda_without_a_gpu_says_how_to_run_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="device=cpu"):
        CudaBackend(CudaConfig(device="cuda", comm="copy"))


@pytest.mark.gpu
@gpu
def test_gpu_window_reads_positive_energy_and_a_side_stream_overlap():
    from _hw_helpers import shipped_gpu_config

    b = CudaBackend(shipped_gpu_config())
    p = _partition()
    c = Candidate(p.key, "norm_0", 16, b.gpu.max_mhz)
    r = b.measure(p, c, 0.2)
    assert r.ok and r.energy_j > 0 and r.time_s > 0


class _FakeCuda:
    """Stands in for torch.cuda so the GPU branch's stream/event order is checked on the CPU."""

    def __init__(self, log: list[str]) -> None:
        import contextlib
        import time

        self.log = log
        outer = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = None

            def record(self, stream) -> None:
                self.t = time.perf_counter()
                outer.log.append(f"record:{stream.name}")

            def synchronize(self) -> None:
                outer.log.append("event_sync")

            def elapsed_time(self, other) -> float:
                return (other.t - self.t) * 1e3

        @contextlib.contextmanager
        def stream(s):
            outer.log.append(f"enter:{s.name}")
            yield
            outer.log.append(f"exit:{s.name}")

        self.Event = Event
        self.stream = stream
        self.synchronize = lambda device=None: outer.log.append("sync")


class _FakeStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name}.wait_stream({other.name})")

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name}.wait_event")


class _Meter:
    name = "fake"

    def begin(self) -> None:
        pass

    def end(self) -> float:
        return 6.0


@pytest.mark.gpu
@gpu
def test_a_hardware_config_of_another_gpu_model_is_refused_on_a_gpu():
    from kareus.errors import KareusError
    from kareus.runtime.backend import gpu_model

    other = "A100-SXM4-40GB" if gpu_model(torch.cuda.get_device_name(0)) != "A100" else "H100-SXM5-80GB"
    with pytest.raises(KareusError, match=r"hardware\.gpu: .* but this GPU is"):
        CudaBackend(CudaConfig(device="cuda", comm="copy", gpu=other))


@pytest.mark.parametrize("spec,device,model", [
    ("A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "A100"), ("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3", "H100"),
    ("H200-SXM-141GB", "NVIDIA H200", "H200"), ("A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "A100")])
def test_gpu_models_match_across_naming_styles(spec, device, model):
    from kareus.runtime.backend import gpu_model, gpu_model_problem

    assert gpu_model(spec) == gpu_model(device) == model
    assert gpu_model_problem(spec, device) == ""


def test_another_gpu_model_names_the_config_to_choose():
    from kareus.runtime.backend import gpu_model_problem

    msg = gpu_model_problem("A100-SXM4-40GB", "NVIDIA H200")
    assert msg.startswith("hardware.gpu: ") and "choose hardware=h200_cuda" in msg and "\n" not in msg
    assert "a hardware config for it" in gpu_model_problem("H100-SXM5-80GB", "NVIDIA GeForce RTX 4090")


@pytest.mark.parametrize("device,sms,top,key", [
    ("NVIDIA H100 PCIe", 114, 1755.0, "hardware.sms: 132"),  # the SXM config on the PCIe card
    ("NVIDIA H100 NVL", 132, 1785.0, "hardware.max_mhz: 1980"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 16, 1980.0, "hardware.sms: 132"),
    ("NVIDIA H100 80GB HBM3", 132, 1980.0, ""), ("NVIDIA H100 80GB HBM3", 132, None, "")])
def test_a_config_of_another_variant_of_the_same_model_is_refused(device, sms, top, key):
    from kareus.runtime.backend import gpu_mismatch, shipped_cuda_config

    msg = gpu_mismatch(shipped_cuda_config("H100"), device, sms, top)
    assert msg.startswith(key) if key else msg == ""
    if key:
        assert "write a hardware config for it" in msg and "h100_cuda.yaml" in msg


def test_shipped_cuda_config_reads_the_models_yaml_and_refuses_unknown_models():
    from kareus.errors import KareusError
    from kareus.runtime.backend import SHIPPED_CUDA_MODELS, shipped_cuda_config

    assert set(SHIPPED_CUDA_MODELS) >= {"a100", "h100", "h200"}
    cfg = shipped_cuda_config("NVIDIA H200", device="cpu", comm="copy")
    assert (cfg.gpu, cfg.sms, cfg.max_mhz, cfg.device) == ("H200-SXM-141GB", 132, 1980, "cpu")
    with pytest.raises(KareusError, match="no shipped hardware config"):
        shipped_cuda_config("Tesla V100-SXM2-32GB")


def test_calibration_sizes_the_window_from_batches_not_one_launch():
    """A fixed cost per timed batch (launch, cold caches) must not shrink the window to a fraction of the ask."""
    b = _cpu()
    batches: list[int] = []

    def timed(run, n):  # 2 ms per batch plus 0.2 ms per execution
        batches.append(n)
        return (2e-3 + n * 2e-4) / n

    b._timed = timed
    per_run = b._calibrate(lambda: None, 0.5)
    assert per_run <= 1.25 * 2e-4  # one lone execution would have read 2.2e-4 + 2e-3, 11x the rate
    assert max(batches) * per_run >= 0.05 * 0.5 and len(batches) <= 10


def test_gpu_branch_orders_streams_and_events():
    from types import SimpleNamespace

    p = _partition()
    rec = Recorder()
    b = CudaBackend(CudaConfig(device="cpu", warmup=0), comm=rec)
    rec.install(b, p)
    log = rec.log
    b.cuda = True
    b._torch = SimpleNamespace(cuda=_FakeCuda(log))
    b.main, b.side = _FakeStream("main", log), _FakeStream("side", log)
    b.energy = _Meter()
    b.nvml = SimpleNamespace(sm_clock_mhz=lambda: log.append("nvml_clock") or 1410.0)
    b.run_partition(p, "attn_0", 8)
    assert log == ["op0", "op1", "side.wait_stream(main)", "enter:side", "comm@8", "record:side", "exit:side",
                   "op2", "op3", "join", "main.wait_event"]
    log.clear()
    r = b.measure(p, Candidate(p.key, "attn_0", 8, b.gpu.max_mhz), 0.0)
    assert r.ok and r.executions == 1 and r.energy_j == pytest.approx(6.0) and r.time_s >= 0
    last_sync = len(log) - 1 - log[::-1].index("sync")
    window = log[last_sync:]  # the measured window: sync, begin event, one execution, end event
    assert window[:2] == ["sync", "record:main"]
    # the end marker is queued before the host samples the clock: the sample's latency is not timed
    assert window[-3:] == ["record:main", "nvml_clock", "event_sync"]
    assert window.count("comm@8") == 1 and window.count("op3") == 1


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_device_check_dry_run_on_cpu_writes_its_summary(tmp_path, monkeypatch, capsys):
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"
    spec = importlib.util.spec_from_file_location("device_check", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["device_check.py", "--cpu", "--window", "0.02"])
    assert mod.main() == 0
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert summary["passed"] and summary["mode"] == "cpu"
    assert {"partitions", "overlap"} <= set(summary["checks"])
    assert summary["checks"]["partitions"]["backend"].startswith("cpu:")  # the thermal anchors' key
    assert summary["checks"]["e2e"]["simulated"] is True  # the run's own label travels with its numbers
    assert summary["gemm_beside_copy"]["gemm"] == "64^3 x 4"  # what ran: --cpu scales every dimension by 1/8
    train = summary["checks"]["train"]  # mode=train at tp=1: both layouts timed, no energy on the CPU
    if not train.get("skipped"):  # skipped without megatron-core
        assert train["device"] == "cpu" and train["iterations"] == 8
        assert [[b["block"] for b in train["blocks"][k]] for k in ("plan", "megatron")] == [[0, 1], [0, 1]]
        assert train["comparison"]["measured_time_saving"] is not None
        assert train["comparison"]["measured_energy_saving"] is None
    rows = summary["checks"]["partitions"]["rows"]  # no GPU to read a clock or a temperature from
    assert rows and all(r["sm_clock_mhz"] is None and r["temperature_c"] is None for r in rows)
    assert json.loads(capsys.readouterr().out)["checks"]["partitions"]["ok"]
    if not torch.cuda.is_available():  # without --cpu, a machine with no GPU fails the check
        monkeypatch.setattr("sys.argv", ["device_check.py", "--window", "0.02"])
        assert mod.main() == 1
        failed = json.loads((tmp_path / "device_check.json").read_text())
        assert not failed["passed"] and not failed["checks"]["cuda"]["ok"]
    # a config the backend refuses (another variant of the GPU) still ends in a summary that says why
    import kareus.runtime.backend as backend_mod
    from kareus.errors import KareusError

    def refuse(cfg, comm=None, seed=0):
        raise KareusError("hardware.sms: 132 in the config, but 'NVIDIA H100 PCIe' has 114 SMs")

    monkeypatch.setattr(backend_mod, "CudaBackend", refuse)
    monkeypatch.setattr("sys.argv", ["device_check.py", "--cpu", "--window", "0.02"])
    assert mod.main() == 1
    refused = json.loads((tmp_path / "device_check.json").read_text())
    assert not refused["passed"] and refused["checks"]["hardware"]["error"].startswith("hardware.sms")


# -- the clock NVML reads during a window against the locked one -------------------------------------------
class _FakeNVML:
    """NVML telemetry of a GPU whose SM clock the test sets."""

    def __init__(self, mhz: float) -> None:
        self.mhz = mhz
        self.closed = False

    def sm_clock_mhz(self) -> float:
        return float(self.mhz)

    def temperature_c(self) -> float:
        return 50.0

    def close(self) -> None:
        self.closed = True


class NVMLError_NotSupported(Exception):  # noqa: N801  (nvidia-ml-py's name for it)
    pass


class _NoCounterNVML(_FakeNVML):
    """A GPU whose NVML lacks the total-energy counter (pre-Volta, some virtual GPUs), or fails to read it."""

    def __init__(self, mhz: float, error: Exception | None = None) -> None:
        super().__init__(mhz)
        self.error = error or NVMLError_NotSupported("Not Supported")

    def energy_j(self) -> float:
        raise self.error


def _metered(mhz: float) -> CudaBackend:
    b = CudaBackend(CudaConfig(device="cpu", comm="copy", warmup=0))
    b.energy, b.nvml = _Meter(), _FakeNVML(mhz)
    return b


def test_a_window_above_the_locked_clock_is_a_failed_read_and_throttling_stands():
    p = _partition()
    b = _metered(1200)
    top = Candidate(p.key, "attn_0", 8, b.gpu.max_mhz)
    assert b.measure(p, top, 0.0).ok  # nothing locked (device_check): the GPU boosts as it likes
    b.set_clock(1005)  # a frequency controller locked 1005 MHz, yet NVML reads 1200: the lock did not hold
    c = Candidate(p.key, "attn_0", 8, 1005)
    r = b.measure(p, c, 0.0)
    assert not r.ok and r.freq_mhz == 1200 and "clock: NVML read 1200 MHz during the window, above the 1005" in r.error
    b.nvml.mhz = 1020  # one 15 MHz step above: accepted
    assert b.measure(p, c, 0.0).ok
    b.nvml.mhz = 1035
    assert not b.measure(p, c, 0.0).ok
    b.nvml.mhz = 900  # throttled below the lock (power cap): what training at this lock meets too
    r = b.measure(p, c, 0.0)
    assert r.ok and r.freq_mhz == 900
    b.nvml.mhz = 1200
    b.release_clock()  # the controller reset the clocks: nothing to compare with
    assert b.measure(p, c, 0.0).ok


def test_the_profiler_retries_then_fails_a_candidate_measured_off_its_clock():
    from kareus.profiler import Profiler, ProfilerConfig

    p = _partition()
    b = _metered(1200)
    cfg = ProfilerConfig(target_window_s=0.01, min_window_s=0.0, settle_s=0, warmup_runs=0, calibration_runs=1,
                         retries=1, cooldown={"name": "none"}, frequency={"name": "sim"})
    m = Profiler(cfg, b).measure(p, Candidate(p.key, "attn_0", 8, 1005))
    assert m.failed and m.flags[0].startswith("read failed after 2 tries: clock: NVML read 1200 MHz")
    ok = Profiler(cfg, b).measure(p, Candidate(p.key, "attn_0", 8, 1200))
    assert not ok.failed and ok.freq_mhz == 1200


def test_a_real_controller_releases_the_clock_check_when_it_resets(monkeypatch):
    import sys
    import types

    from kareus.registry import FREQUENCY_CONTROLLERS

    fake = types.ModuleType("pynvml")
    for fn in ("nvmlInit", "nvmlShutdown", "nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks"):
        setattr(fake, fn, lambda *a: None)
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    b = _metered(1410)
    with FREQUENCY_CONTROLLERS.build("nvml", b, config={"devices": [0]}) as ctl:
        ctl.set(1005)
        assert b.clock() == 1005 and b._clock_problem(1410.0)
    assert not b._clock_problem(1410.0)


# -- process groups: started or refused at backend start, the comm's own groups destroyed on close ----------
def test_a_dist_comm_without_a_process_group_is_refused_when_the_backend_starts(monkeypatch):
    import torch.distributed as dist

    from kareus.errors import KareusError
    from kareus.runtime.comm import CommSetupError

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(CommSetupError, match="torchrun --nproc-per-node") as err:
        CudaBackend(CudaConfig(device="cpu", comm="gloo"))
    assert isinstance(err.value, KareusError)  # the CLI prints it as one line and stops
    with pytest.raises(CommSetupError, match="nccl"):
        CudaBackend(CudaConfig(device="cpu", comm="nccl"))


def test_nccl_cta_limits_in_the_environment_are_refused(monkeypatch):
    """NCCL lets NCCL_MIN/MAX_CTAS (and the channel bounds) override each communicator's config, so
    with one exported every SM count of the search would run the same kernel."""
    from kareus.runtime import comm
    from kareus.runtime.comm import NCCL_CTA_ENV, CommSetupError, NCCLBackend, NCCLConfig

    for key in NCCL_CTA_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(comm, "nccl_conf_files", lambda: [])
    monkeypatch.setenv("NCCL_MIN_CTAS", "32")
    with pytest.raises(CommSetupError, match=r"NCCL_MIN_CTAS=32 in the environment overrides the comm SMs"):
        NCCLBackend(NCCLConfig()).check_ready("cuda")
    monkeypatch.delenv("NCCL_MIN_CTAS")
    with pytest.raises(CommSetupError) as err:  # without the knob: refused only for what this build lacks
        NCCLBackend(NCCLConfig()).check_ready("cpu")
    assert "environment" not in str(err.value)


def test_a_torch_build_without_per_communicator_nccl_config_is_refused_before_any_group(monkeypatch):
    """Without ProcessGroupNCCL's config, NCCL_MIN/MAX_CTAS are the only knob, and NCCL reads them once,
    at the first communicator: torch makes the default one eagerly, so writing them for a comm group
    comes too late and every SM count would run NCCL's default CTAs under its own label."""
    import torch.distributed as dist

    from kareus.runtime import comm
    from kareus.runtime.comm import CommSetupError, NCCLBackend, NCCLConfig

    for key in comm.NCCL_CTA_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(comm, "nccl_conf_files", lambda: [])
    monkeypatch.setattr(comm, "nccl_options", lambda sms, cfg: None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    made = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw))
    backend = NCCLBackend(NCCLConfig())
    with pytest.raises(CommSetupError, match=r"no per-communicator NCCL config .* SM count cannot vary"):
        backend.check_ready(torch.device("cuda", 0))
    with pytest.raises(CommSetupError, match="no per-communicator NCCL config"):
        backend.group(8)
    assert made == [] and not any(k in os.environ for k in comm.NCCL_CTA_ENV)


def test_nccl_cta_limits_in_nccl_config_files_are_refused(monkeypatch, tmp_path):
    """NCCL also loads its environment from $NCCL_CONF_FILE, ~/.nccl.conf and /etc/nccl.conf: a site-wide
    NCCL_MAX_CTAS there fixes every communicator's CTAs as surely as an exported one."""
    from kareus.runtime import comm
    from kareus.runtime.comm import CommSetupError, NCCLBackend, NCCLConfig, nccl_cta_overrides

    for key in comm.NCCL_CTA_ENV:
        monkeypatch.delenv(key, raising=False)
    site = tmp_path / "nccl.conf"
    site.write_text("# site defaults\nNCCL_DEBUG=WARN\n#NCCL_MIN_CTAS=2\n NCCL_MAX_CTAS = 4 \n")
    monkeypatch.setenv("NCCL_CONF_FILE", str(site))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.nccl.conf
    assert comm.nccl_conf_files()[0] == site
    found = nccl_cta_overrides([site, tmp_path / "absent.conf"])
    assert found == [f"NCCL_MAX_CTAS=4 in {site}"]  # the commented line is not read
    monkeypatch.setattr(comm, "nccl_conf_files", lambda: [site])
    with pytest.raises(CommSetupError, match=rf"NCCL_MAX_CTAS=4 in {site} overrides the comm SMs"):
        NCCLBackend(NCCLConfig()).check_ready("cuda")
    monkeypatch.setenv("NCCL_MAX_CTAS", "8")  # the environment wins over the file, as in NCCL
    assert nccl_cta_overrides([site]) == ["NCCL_MAX_CTAS=8 in the environment"]


def test_close_destroys_the_comm_groups_the_backend_created(monkeypatch):
    import torch.distributed as dist

    from kareus.runtime.comm import GlooBackend, GlooConfig, NCCLBackend, NCCLConfig

    destroyed = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: destroyed.append(group))
    b = CudaBackend(CudaConfig(device="cpu"), comm=Recorder())
    nvml = b.nvml = _FakeNVML(1410)
    nccl = NCCLBackend(NCCLConfig())
    nccl._groups = {4: "pg4", 16: "pg16"}  # one communicator per comm SM count
    b.comm = nccl
    b.close()
    assert destroyed == ["pg4", "pg16"] and nccl._groups == {} and nvml.closed
    b.close()
    assert destroyed == ["pg4", "pg16"]  # nothing twice
    gloo = GlooBackend(GlooConfig())
    gloo._group, gloo._owned = "world", False  # the default group: not the backend's to destroy
    gloo.close()
    gloo._group, gloo._owned = "side", True
    gloo.close()
    assert destroyed == ["pg4", "pg16", "side"]


def test_config_validation_asks_for_a_controller_that_locks_a_real_gpu():
    from kareus.config.validate import validate_clock_control
    from kareus.profiler import ProfilerConfig

    sim, nvml = ProfilerConfig(frequency={"name": "sim"}), ProfilerConfig(frequency={"name": "nvml"})
    assert "does not lock a real GPU's clock" in validate_clock_control(CudaConfig(), sim)[0]
    assert validate_clock_control(CudaConfig(), nvml) == []
    assert validate_clock_control(CudaConfig(), ProfilerConfig(frequency={"name": "zeus"})) == []
    assert validate_clock_control(CudaConfig(device="cpu"), sim) == []  # a CPU check has no clock to lock


def test_the_unlocked_controller_leaves_the_clock_to_the_gpu_and_measures_at_the_top_clock_alone(compose):
    """For users who may not lock clocks: valid on a real GPU, it never touches the GPU, holds windows to
    no lock, and refuses any clock but the top one (the space must be the top clock alone)."""
    from kareus.config.validate import ConfigError, validate, validate_clock_control
    from kareus.errors import KareusError
    from kareus.profiler import ProfilerConfig
    from kareus.registry import FREQUENCY_CONTROLLERS

    unlocked = ProfilerConfig(frequency={"name": "unlocked"})
    assert validate_clock_control(CudaConfig(), unlocked) == []
    assert validate_clock_control(CudaConfig(device="cpu"), unlocked) == []
    b = _cpu()
    ctl = FREQUENCY_CONTROLLERS.build("unlocked", b, config={"name": "unlocked"})
    with ctl:
        ctl.set(b.gpu.max_mhz)
        assert b.clock() == b.gpu.max_mhz and not b._clock_locked  # bookkeeping, no lock to check windows by
        with pytest.raises(KareusError, match="no_clock_search"):
            ctl.set(b.gpu.max_mhz - b.gpu.step_mhz)
    executor_side = FREQUENCY_CONTROLLERS.build("unlocked", None, config={"name": "unlocked"})
    executor_side.set(1410)
    executor_side.reset()
    with pytest.raises(KareusError, match="not 1200 MHz"):  # a plan of several clocks cannot run unlocked
        executor_side.set(1200)
    base = ("+model=tiny", "parallel=pp2_tp2", "hardware=a100_cuda", "profiler/frequency=unlocked")
    with pytest.raises(ConfigError, match=r"search\.space\.freq_mhz: profiler\.frequency=unlocked"):
        validate(compose(*base))
    validate(compose(*base, "+experiment=no_clock_search"))
    with pytest.raises(ConfigError, match="'compensated' probes other clocks"):
        validate(compose(*base, "+experiment=no_clock_search", "profiler/cooldown=compensated"))
    with pytest.raises(ConfigError, match=r"profiler\.cooldown\.reference_mhz: .* set 0"):
        validate(compose(*base, "+experiment=no_clock_search", "profiler/cooldown=thermal",
                         "profiler.cooldown.reference_mhz=1200"))
    validate(compose(*base, "+experiment=no_clock_search", "profiler/cooldown=thermal"))


def test_config_validation_keeps_worker_processes_off_a_real_gpu():
    from kareus.config.validate import ValidationContext
    from kareus.launch.launchers import ProcessLauncherConfig

    def ctx(real: bool) -> ValidationContext:
        return ValidationContext(gpu=None, parallel=None, model=None, mode="run", real_gpu=real)

    [line] = ProcessLauncherConfig().problems(ctx(True))
    assert line.startswith("launcher: process runs partition searches in worker processes") and "launcher=local" in line
    assert ProcessLauncherConfig().problems(ctx(False)) == []


def test_zeus_that_cannot_open_the_gpu_leaves_readings_failed_with_its_reason(monkeypatch):
    import sys
    import types

    from kareus.runtime.telemetry import EnergyUnavailable, energy_meter

    def get_gpus():  # Zeus parses CUDA_VISIBLE_DEVICES entries as integers
        raise ValueError("invalid literal for int() with base 10: 'GPU-5f2a'")

    device, monitor = types.ModuleType("zeus.device"), types.ModuleType("zeus.monitor")
    device.get_gpus, monitor.ZeusMonitor = get_gpus, object
    for name, mod in (("zeus", types.ModuleType("zeus")), ("zeus.device", device), ("zeus.monitor", monitor)):
        monkeypatch.setitem(sys.modules, name, mod)
    meter = energy_meter("zeus", None, 0)
    meter.begin()
    with pytest.raises(EnergyUnavailable, match=r"Zeus could not open cuda:0 \(ValueError: invalid literal"):
        meter.end()


def test_the_idle_temperature_is_read_once_per_gpu_per_process(monkeypatch):
    """Every partition search opens a backend of its own; one opened after a search would read that
    search's heat as idle."""
    import kareus.runtime.backend as backend_mod

    monkeypatch.setattr(backend_mod, "_IDLE_C", {})
    gpu = _FakeNVML(1410)
    assert backend_mod._idle_reading("node:GPU-a", gpu, 35.0) == 50.0
    gpu.temperature_c = lambda: 78.0  # hot from the first search
    assert backend_mod._idle_reading("node:GPU-a", gpu, 35.0) == 50.0
    assert backend_mod._idle_reading("node:GPU-b", gpu, 35.0) == 78.0  # another GPU reads its own

    def lost() -> float:
        raise OSError("NVML_ERROR_UNKNOWN")

    gpu.temperature_c = lost  # a failed first read must not stop one rank of a group: the fallback stands
    assert backend_mod._idle_reading("node:GPU-c", gpu, 35.0) == 35.0 and "node:GPU-c" not in backend_mod._IDLE_C


@pytest.mark.parametrize("energy,nvml,why", [
    ("none", _FakeNVML(1410), "hardware.energy: energy metering is off (hardware.energy=none); no candidate can be "
                              "measured on cuda:x without energy; allowed: nvml, zeus"),
    ("nvml", None, "hardware.energy: no NVML device: energy needs an NVIDIA GPU and nvidia-ml-py (NVMLError: "
                   "no library); no candidate can be measured on cuda:x without energy; allowed: nvml, zeus"),
    ("nvml", _NoCounterNVML(1410), "hardware.energy: this GPU's NVML has no total-energy counter "
                                   "(NVMLError_NotSupported: Not Supported); no candidate can be measured on cuda:x "
                                   "without energy; allowed: nvml, zeus"),
    ("nvml", _NoCounterNVML(1410, OSError("Insufficient Permissions")),  # not a missing counter: say so
     "hardware.energy: this GPU's NVML could not read its total-energy counter (OSError: Insufficient Permissions); "
     "no candidate can be measured on cuda:x without energy; allowed: nvml, zeus"),
])
def test_a_gpu_without_an_energy_meter_is_refused_when_the_backend_starts(energy, nvml, why):
    """It would run every window in full and fail it, three times per candidate, for no frontier."""
    b = object.__new__(CudaBackend)
    b.cuda, b.name, b.nvml, b._nvml_error = True, "cuda:x", nvml, "" if nvml else "NVMLError: no library"
    b.cfg = CudaConfig(device="cpu", energy=energy)
    meter, problem = b._open_meter(0)
    assert problem == why
    b.cuda = False  # the CPU checks the logic: readings fail with the reason instead
    assert b._open_meter(0)[1] == ""

