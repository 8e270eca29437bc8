"""The composition stage: residual work and Megatron's own layout are measured, then partition
measurements become instruction options, the iteration frontier, and execution plans. An option whose
partitions carry the ``megatron:`` prefix runs the instruction in Megatron's own layout: the
microbatch unsplit, no overlap, the top clock."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kareus.compose import InstructionOption, IterationFrontier, compose_instruction, pipeline_dag
from kareus.pipeline.context import RunContext
from kareus.registry import COMPOSERS
from kareus.search.base import SearchResult
from kareus.types import SEQUENTIAL, Candidate, Direction, Measurement, Partitioning

OptionKey = tuple[int, Direction]


@dataclass
class Composition:
    options: dict[OptionKey, list[InstructionOption]]
    reference_options: dict[OptionKey, InstructionOption]
    frontier: IterationFrontier
    dag: Any
    reference: Any  # Assignment: Megatron's iteration time and energy on the same hardware
    residual_measurements: int


@dataclass
class FixedWork:
    """What composition measures besides the partition searches (all through the journal).

    ``residual``: each instruction's non-partition work at every searched clock. ``anchors``: each
    searched partition at no overlap, the top clock and the default SMs, a configuration the search
    may have skipped; as an option it keeps the fastest plan from trailing the plain schedule.
    ``megatron``: Megatron-LM's own layout (unsplit microbatches, no overlap, top clock, default SMs),
    its partitions and residual work measured once: the reference every plan is compared with.
    """

    residual: dict[OptionKey, dict[int, tuple[float, float]]]
    anchors: dict[str, Measurement]
    megatron: Partitioning
    megatron_partitions: dict[str, Measurement]
    megatron_residual: dict[OptionKey, dict[int, tuple[float, float]]]

    @property
    def residual_measurements(self) -> int:
        return sum(len(v) for v in self.residual.values()) + sum(len(v) for v in self.megatron_residual.values())


def reference_candidate(key: str, ctx: RunContext) -> Candidate:
    """Megatron's default: no overlap, the top clock, the comm library's default SM count."""
    return Candidate(key, SEQUENTIAL, int(ctx.gpu.default_comm_sms), int(ctx.gpu.max_mhz))


def _residual(profiler: Any, work: Any, clocks: Sequence[int]) -> dict[int, tuple[float, float]]:
    """(time, dynamic energy) of one instruction's residual work per clock; failed reads are left out."""
    per_clock: dict[int, tuple[float, float]] = {}
    if work.residual:
        for f in clocks:
            m = profiler.profile_ops(work.residual, f)
            if not m.failed:
                per_clock[f] = (m.time_s, m.dynamic_energy_j)
    return per_clock


def _at_reference(ctx: RunContext, profiler: Any, partitioning: Partitioning) -> dict[str, Measurement]:
    return {t.key: profiler.evaluator(t)([reference_candidate(t.key, ctx)], [{"pass": "reference"}])[0]
            for t in partitioning.types}


def measure_fixed_work(ctx: RunContext, profiler: Any, results: Sequence[SearchResult]) -> FixedWork:
    """Profile the residual work, the anchors and Megatron's layout (see :class:`FixedWork`)."""
    from kareus.partition import megatron_partitioning

    assert ctx.partitioning is not None and ctx.workload is not None
    top = int(ctx.gpu.max_mhz)
    clocks = sorted({int(m.candidate.freq_mhz) for r in results for m in r.measurements if not m.failed} | {top})
    megatron = megatron_partitioning(ctx.workload)
    return FixedWork(
        residual={(w.stage, w.direction): _residual(profiler, w, clocks) for w in ctx.partitioning.work},
        anchors=_at_reference(ctx, profiler, ctx.partitioning),
        megatron=megatron,
        megatron_partitions=_at_reference(ctx, profiler, megatron),
        megatron_residual={(w.stage, w.direction): _residual(profiler, w, [top]) for w in megatron.work})


def compose(ctx: RunContext, results: Sequence[SearchResult], fixed: FixedWork) -> Composition:
    """Instruction options per (stage, direction), the iteration frontier and Megatron's point."""
    from kareus.compose import fixed_option_iteration

    assert ctx.partitioning is not None
    measured = {r.partition: [m for m in r.measurements if not m.failed] for r in results}
    for key, anchor in fixed.anchors.items():
        known = measured.setdefault(key, [])
        if not anchor.failed and all(m.candidate != anchor.candidate for m in known):
            known.append(anchor)
    options = {(w.stage, w.direction): compose_instruction(w, measured, fixed.residual[(w.stage, w.direction)])
               for w in ctx.partitioning.work}
    megatron = {k: [m] for k, m in fixed.megatron_partitions.items()}
    ref_options = {(w.stage, w.direction): compose_instruction(w, megatron, fixed.megatron_residual[(w.stage, w.direction)])[0]
                   for w in fixed.megatron.work}
    for key, ref in ref_options.items():
        # Megatron's own layout is one more way to run an instruction: where splitting the microbatch
        # costs more than overlap saves (host-bound work), the plans keep it and never trail Megatron
        options.setdefault(key, []).append(ref)
    p = ctx.parallel
    dag = pipeline_dag(p.schedule, p.pp, p.num_microbatches)
    gpus_per_stage = p.tp * p.cp * p.dp
    composer = COMPOSERS.build(str(ctx.cfg.compose.name), config=ctx.typed["compose"])
    frontier = composer.compose(dag, options, float(ctx.gpu.static_power_w), gpus_per_stage, p.pp)
    ref_point = fixed_option_iteration(dag, ref_options, float(ctx.gpu.static_power_w), gpus_per_stage, p.pp)
    return Composition(options, ref_options, frontier, dag, ref_point, fixed.residual_measurements)
