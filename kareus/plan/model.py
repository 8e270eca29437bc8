"""Execution plans: what every pipeline instruction runs (clock, each partition's slot and SMs).

One plan per iteration-frontier point. Instructions of one (stage, direction) that run the same
option are grouped; their ``microbatches`` list says which microbatches they cover.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from kareus.compose.iteration import IterationFrontier
from kareus.types import Direction, ModelSpec, ParallelSpec, Partitioning

SCHEMA_VERSION = 3  # 2: clock_switch_s; 3: made_for


@dataclass(frozen=True)
class MadeFor:
    """The model and layout a plan was composed for: an executor refuses to run it on any other (its
    partition keys, counts and predicted times are that layout's)."""

    model: ModelSpec
    parallel: ParallelSpec

    @classmethod
    def of(cls, model: ModelSpec, parallel: ParallelSpec) -> "MadeFor":
        return cls(model, parallel)

    def differences(self, other: "MadeFor") -> list[str]:
        """``section.key: plan's value != other's`` for every field that differs."""
        import dataclasses

        return [f"{section}.{f.name}: plan {getattr(mine, f.name)!r} != {getattr(theirs, f.name)!r}"
                for section, mine, theirs in (("model", self.model, other.model),
                                              ("parallel", self.parallel, other.parallel))
                for f in dataclasses.fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]


@dataclass(frozen=True)
class PartitionSetting:
    partition: str
    slot: str
    sms: int
    count: int = 0  # occurrences per instruction (0 = not recorded)


@dataclass(frozen=True)
class InstructionPlan:
    stage: int
    direction: str  # "fwd" | "bwd"
    microbatches: tuple[int, ...]
    freq_mhz: int
    time_s: float  # predicted, per instruction
    dynamic_energy_j: float  # predicted, per instruction and GPU
    partitions: tuple[PartitionSetting, ...] = ()


@dataclass(frozen=True)
class StagePlan:
    stage: int
    instructions: tuple[InstructionPlan, ...]

    def switches(self, plan: "ExecutionPlan") -> int:
        """Clock changes per iteration on this stage, in the schedule's order (cyclic: iterations repeat)."""
        from kareus.registry import SCHEDULES

        order = SCHEDULES.build(plan.schedule, config={"name": plan.schedule}).stage_order(
            self.stage, plan.num_stages, plan.num_microbatches)
        clocks = [plan.instruction(i.stage, i.microbatch, i.direction).freq_mhz for i in order]
        return sum(a != b for a, b in zip(clocks, clocks[-1:] + clocks[:-1]))


@dataclass(frozen=True)
class ExecutionPlan:
    schema_version: int
    config_hash: str
    hardware: str
    composer: str
    schedule: str
    index: int  # position on its run's iteration frontier (0 = fastest); the plan's name is ``id``
    num_stages: int
    num_microbatches: int
    gpus_per_stage: int
    static_power_w: float
    predicted_time_s: float
    predicted_energy_j: float
    predicted_dynamic_energy_j: float
    stages: tuple[StagePlan, ...]
    clock_switch_s: float = 0.0  # GPU idle time per clock change, priced into the predicted time
    made_for: MadeFor | None = None  # None: a plan saved before schema 3 (it names no model or layout)

    @functools.cached_property
    def id(self) -> str:
        """The plan's name in tables, CSVs, file names and summaries: 8 hex digits of a hash of what it
        runs (each instruction's clock and each partition's slot and SMs). A position on the frontier
        would shift whenever a run's frontier gains a point (a deadline asked for adds solves); this
        names the same plan alike in every run, whatever else its frontier holds."""
        return plan_id(self.stages)

    @property
    def switches(self) -> int:
        """Clock changes per iteration over all stages (a stage's first instruction follows its last)."""
        return sum(st.switches(self) for st in self.stages)

    def instruction(self, stage: int, microbatch: int, direction: Direction | str) -> InstructionPlan:
        """The plan entry covering one instruction (KeyError if the plan does not cover it)."""
        d = Direction(direction).value
        if not 0 <= stage < self.num_stages:  # a negative index would find another stage's entry
            raise KeyError((stage, microbatch, d))
        for ins in self.stages[stage].instructions:
            if ins.direction == d and microbatch in ins.microbatches:
                return ins
        raise KeyError((stage, microbatch, d))


PLAN_ID_DIGITS = 8


def plan_settings(stages: Sequence[StagePlan]) -> list[list]:
    """What a plan runs, one microbatch's instruction at a time, in order: its clock and each partition's
    slot and SMs (neither the predicted numbers nor how instructions are grouped)."""
    return sorted([ins.stage, ins.direction, mb, ins.freq_mhz,
                   sorted([p.partition, p.slot, p.sms] for p in ins.partitions)]
                  for st in stages for ins in st.instructions for mb in ins.microbatches)


def plan_id(stages: Sequence[StagePlan]) -> str:
    """8 hex digits of a SHA-256 over :func:`plan_settings`."""
    import hashlib
    import json

    text = json.dumps(plan_settings(stages), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:PLAN_ID_DIGITS]


def make_plans(frontier: IterationFrontier, partitioning: Partitioning | Sequence[Partitioning] | None = None, *,
               config_hash: str, hardware: str, made_for: MadeFor | None = None) -> list[ExecutionPlan]:
    """One ExecutionPlan per iteration-frontier point, fastest first (each named by its ``id``).

    ``partitioning`` (optional; several, e.g. the nanobatch one and Megatron's own) adds each
    partition type's occurrence count per instruction.
    """
    dag, options = frontier.dag, frontier.options
    counts: dict[tuple[int, str], dict[str, int]] = {}
    layouts = [] if partitioning is None else [partitioning] if isinstance(partitioning, Partitioning) else partitioning
    for layout in layouts:
        for w in layout.work:
            counts.setdefault((w.stage, w.direction.value), {}).update(dict(w.partitions))
    plans = []
    for index, point in enumerate(frontier):
        a = point.payload
        groups: dict[tuple[int, Direction, int], list[int]] = {}
        for node, c in zip(dag.nodes, a.choice):
            groups.setdefault((node.stage, node.direction, c), []).append(node.microbatch)
        stages = []
        for s in range(dag.num_stages):
            entries = []
            for (stage, direction, c), mbs in groups.items():
                if stage != s:
                    continue
                o = options[(stage, direction)][c]
                cnt = counts.get((stage, direction.value), {})
                parts = tuple(PartitionSetting(k, cand.slot, int(cand.sms), int(cnt.get(k, 0)))
                              for k, cand in sorted(o.choices.items()))
                entries.append(InstructionPlan(stage, direction.value, tuple(sorted(mbs)), int(o.freq_mhz),
                                               float(o.time_s), float(o.dynamic_energy_j), parts))
            entries.sort(key=lambda ins: (ins.direction != "fwd", ins.microbatches[0]))
            stages.append(StagePlan(s, tuple(entries)))
        plans.append(ExecutionPlan(
            schema_version=SCHEMA_VERSION, config_hash=config_hash, hardware=hardware, composer=frontier.composer,
            schedule=dag.schedule, index=index, num_stages=dag.num_stages, num_microbatches=dag.num_microbatches,
            gpus_per_stage=int(frontier.model.gpus_per_stage), static_power_w=float(frontier.model.static_power_w),
            predicted_time_s=float(a.time_s), predicted_energy_j=float(a.energy_j),
            predicted_dynamic_energy_j=float(a.dynamic_energy_j), stages=tuple(stages),
            clock_switch_s=float(frontier.model.clock_switch_s), made_for=made_for))
    return plans

