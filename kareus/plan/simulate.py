"""A discrete-event run of a plan: per-stage queues in schedule order, cross-stage hand-offs by rule.

Independent of the composer's critical-path sweep (it never reads the DAG's edge list), so it checks
both the DAG construction and the predicted iteration time. ``duration`` lets the caller execute each
instruction on a hardware backend instead of trusting the plan's predicted times.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Optional

from kareus.plan.model import ExecutionPlan, InstructionPlan
from kareus.registry import SCHEDULES
from kareus.types import Direction

Duration = Callable[[InstructionPlan, int], float]  # (plan entry, microbatch) -> seconds


@dataclass(frozen=True)
class SimulatedIteration:
    time_s: float
    start: dict  # (stage, microbatch, "fwd"|"bwd") -> start time
    finish: dict


def _deps(stage: int, mb: int, d: Direction, num_stages: int) -> list[tuple[int, int, str]]:
    """Cross-stage inputs: activations flow down the stages, gradients flow back up."""
    if d is Direction.FWD:
        return [(stage - 1, mb, "fwd")] if stage > 0 else []
    out = [(stage, mb, "fwd")]
    if stage < num_stages - 1:
        out.append((stage + 1, mb, "bwd"))
    return out


def simulate_plan(plan: ExecutionPlan, duration: Optional[Duration] = None) -> SimulatedIteration:
    """Event-driven execution of one iteration of ``plan``; returns when the last stage finishes."""
    import kareus.compose  # noqa: F401  (registers the schedules)

    schedule = SCHEDULES.build(plan.schedule, config={"name": plan.schedule})
    S, M = plan.num_stages, plan.num_microbatches
    queues = [schedule.stage_order(s, S, M) for s in range(S)]
    head = [0] * S
    busy = [False] * S
    start: dict = {}
    finish: dict = {}
    events: list[tuple[float, int, int]] = []  # (time, stage, queue position)
    # each stage's clock as the previous iteration left it: its last instruction's
    locked = [plan.instruction(q[-1].stage, q[-1].microbatch, q[-1].direction).freq_mhz for q in queues]
    now = 0.0

    def try_start(s: int) -> None:
        if busy[s] or head[s] >= len(queues[s]):
            return
        ins = queues[s][head[s]]
        if any(dep not in finish for dep in _deps(ins.stage, ins.microbatch, ins.direction, S)):
            return
        key = (ins.stage, ins.microbatch, ins.direction.value)
        entry = plan.instruction(ins.stage, ins.microbatch, ins.direction)
        dt = entry.time_s if duration is None else float(duration(entry, ins.microbatch))
        if entry.freq_mhz != locked[s]:  # the executor drains the device and locks the new clock first
            dt += plan.clock_switch_s
        locked[s] = entry.freq_mhz
        start[key] = now
        busy[s] = True
        heapq.heappush(events, (now + dt, s, head[s]))

    for s in range(S):
        try_start(s)
    while events:
        now, s, pos = heapq.heappop(events)
        ins = queues[s][pos]
        finish[(ins.stage, ins.microbatch, ins.direction.value)] = now
        busy[s] = False
        head[s] += 1
        for t in range(S):
            try_start(t)
    if len(finish) != 2 * S * M:
        raise RuntimeError(f"plan simulation deadlocked after {len(finish)} of {2 * S * M} instructions")
    return SimulatedIteration(max(finish.values()), start, finish)


def plan_energy(plan: ExecutionPlan, iteration_time_s: float) -> float:
    """Total energy of a plan at a given iteration time (dynamic from the plan, static over all GPUs)."""
    dyn = sum(ins.dynamic_energy_j * len(ins.microbatches) for st in plan.stages for ins in st.instructions)
    return dyn * plan.gpus_per_stage + plan.static_power_w * plan.gpus_per_stage * plan.num_stages * iteration_time_s
