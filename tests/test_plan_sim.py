"""A plan's predicted iteration time equals running its instructions on the simulated GPU.

Partition types are measured on the noise-free simulated GPU, composed into instruction options and
an iteration frontier; then every plan is executed instruction by instruction on a fresh simulated
GPU (clock set, each partition run with the plan's slot and SMs, the residual ops run) in
dependency order by the event simulation. Numbers here are simulated.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kareus.compose import KareusComposer, KareusComposerConfig, compose_instruction, pipeline_dag
from kareus.plan import make_plans, simulate_plan
from kareus.registry import HARDWARE
from kareus.types import (
    SEQUENTIAL, Candidate, Collective, Direction, InstructionWork, Link, Measurement, Op, OpKind, Partitioning,
    PartitionType, Slot,
)

F, B = Direction.FWD, Direction.BWD
CLOCKS = (1410, 1200, 1005, 810)
WINDOW_S = 0.5


def _sim():
    import kareus.hardware  # noqa: F401  (registers the backends)

    if "sim" not in HARDWARE:
        pytest.skip("simulated GPU backend not available")
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "hardware" / "a100_sim.yaml")
    conf.pop("defaults", None)
    conf.time_noise = 0.0
    conf.power_noise = 0.0
    return HARDWARE.build("sim", config=conf, seed=0)


def _ptype(key: str, direction: Direction, scale: float) -> PartitionType:
    h, s = 2048, 4096
    compute = (
        Op("norm", OpKind.NORM, flops=5 * s * h, bytes=4 * s * h),
        Op("qkv", OpKind.GEMM, flops=scale * 2 * s * h * 1536, bytes=2 * (s * h + h * 1536 + s * 1536)),
        Op("attn", OpKind.ATTENTION, flops=scale * 4 * s * s * 1024, bytes=8 * s * 1024),
        Op("proj", OpKind.GEMM, flops=scale * 2 * s * 1024 * h, bytes=2 * (s * 1024 + 1024 * h + s * h)),
    )
    comm = Op("allreduce", OpKind.COMM, collective=Collective.ALL_REDUCE, message_bytes=2 * s * h, group_size=2,
              link=Link.NVLINK)
    slots = (Slot("linear_0", (1,), "gemm"), Slot("attn_0", (2,), "attention"))
    return PartitionType(key, direction, compute, comm, slots)


def _measure(sim, ptype, cand: Candidate) -> Measurement:
    sim.set_clock(cand.freq_mhz)
    r = sim.measure(ptype, cand, WINDOW_S)
    static = sim.gpu.static_power_w
    return Measurement(cand, r.time_s, r.energy_j, r.energy_j - static * r.time_s, static, r.temperature_c,
                       r.freq_mhz, 1)


def test_plan_time_equals_execution_on_the_simulated_gpu():
    sim = _sim()
    types = {"fwd_attn": _ptype("fwd_attn", F, 1.0), "bwd_attn": _ptype("bwd_attn", B, 2.0)}
    residual_ops = (Op("loss", OpKind.ELEMENTWISE, flops=1e8, bytes=2e8),)
    S, M = 2, 4
    works = tuple(InstructionWork(s, d, ((f"{d.value}_attn", 3),), residual_ops if s == S - 1 else ())
                  for s in range(S) for d in (F, B))
    partitioning = Partitioning(tuple(types.values()), works)
    measurements = {k: [_measure(sim, t, Candidate(k, slot, sms, f)) for f in CLOCKS
                        for slot in (SEQUENTIAL, "linear_0", "attn_0") for sms in (8, 16, 24)]
                    for k, t in types.items()}
    options = {}
    for w in works:
        residual = {}
        if w.residual:
            for f in CLOCKS:
                sim.set_clock(f)
                r = sim.measure_ops(w.residual, WINDOW_S)
                residual[f] = (r.time_s, r.energy_j - sim.gpu.static_power_w * r.time_s)
        options[(w.stage, w.direction)] = compose_instruction(w, measurements, residual)
    dag = pipeline_dag("1f1b", S, M)
    frontier = KareusComposer(KareusComposerConfig(num_deadlines=8)).compose(
        dag, options, sim.gpu.static_power_w, 2, S)
    plans = make_plans(frontier, partitioning, config_hash="test", hardware=sim.name)
    assert len(plans) >= 2

    runner = _sim()  # a fresh GPU executes the plans

    def execute(ins, microbatch: int) -> float:
        runner.set_clock(ins.freq_mhz)
        t = sum(p.count * runner.run_once(types[p.partition], Candidate(p.partition, p.slot, p.sms, ins.freq_mhz))
                for p in ins.partitions)
        work = partitioning.instruction(ins.stage, Direction(ins.direction))
        if work.residual:
            t += runner.measure_ops(work.residual, WINDOW_S).time_s
        return t

    for plan in plans:
        ran = simulate_plan(plan, duration=execute)
        assert ran.time_s == pytest.approx(plan.predicted_time_s, rel=1e-9)
    # the frontier really trades time for energy: its plans differ in clocks
    assert len({i.freq_mhz for p in plans for st in p.stages for i in st.instructions}) > 1
