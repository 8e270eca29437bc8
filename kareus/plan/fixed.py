"""Plans that were not composed from a frontier: one clock everywhere, each partition's slot and SMs
chosen by a rule. ``mode=train`` runs Megatron's layout as such a plan (every instruction's partitions
are Megatron's, at the top clock), and the executor's checks run random ones. Their predicted times and
energies are placeholders (1.0): such a plan is executed, never saved or reported as a prediction."""
from __future__ import annotations

from typing import Callable

from kareus.plan.model import SCHEMA_VERSION, ExecutionPlan, InstructionPlan, MadeFor, PartitionSetting, StagePlan
from kareus.types import ModelSpec, ParallelSpec, PartitionType

Choose = Callable[[PartitionType], tuple[str, int]]  # a Kareus partition type -> (slot, comm SMs)


def layout_plan(model: ModelSpec, parallel: ParallelSpec, freq_mhz: int, choose: Choose | None,
                megatron_microbatches: tuple[int, ...] = (), megatron_sms: int = 1) -> ExecutionPlan:
    """Every instruction at ``freq_mhz``; microbatches in ``megatron_microbatches`` (all of them when
    ``choose`` is None) run Megatron's layout, each of its comms where Megatron launches it, the others
    the nanobatch partitions at ``choose``'s settings."""
    import kareus.partition  # noqa: F401  (registers the partitioners)
    from kareus.partition.sequential import megatron_partitioning, megatron_slot
    from kareus.registry import PARTITIONERS
    from kareus.workload import build_workload

    workload = build_workload(model, parallel)
    megatron = megatron_partitioning(workload)
    ours = None if choose is None else PARTITIONERS.build("nanobatch", config={}).partition(workload)
    stages = []
    for s in range(parallel.pp):
        entries = []
        for d in ("fwd", "bwd"):
            for mb in range(parallel.num_microbatches):
                layout = megatron if ours is None or mb in megatron_microbatches else ours
                types = {t.key: t for t in layout.types}
                (work,) = [w for w in layout.work if w.stage == s and w.direction.value == d]
                parts = []
                for key, n in work.partitions:
                    slot, sms = (megatron_slot(types[key]), megatron_sms) if layout is megatron else choose(types[key])
                    parts.append(PartitionSetting(key, slot, int(sms), n))
                entries.append(InstructionPlan(s, d, (mb,), int(freq_mhz), 1.0, 1.0, tuple(parts)))
        stages.append(StagePlan(s, tuple(entries)))
    return ExecutionPlan(SCHEMA_VERSION, "fixed", "none", "fixed", parallel.schedule, 0, parallel.pp,
                         parallel.num_microbatches, parallel.tp * parallel.cp, 0.0, 1.0, 1.0, 1.0, tuple(stages),
                         made_for=MadeFor.of(model, parallel))
