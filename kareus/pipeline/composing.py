"""The composition stage: residual work and the Megatron reference are measured, then partition
measurements become instruction options, the iteration frontier, and execution plans."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kareus.compose import InstructionOption, IterationFrontier, compose_instruction, pipeline_dag
from kareus.pipeline.context import RunContext
from kareus.registry import COMPOSERS
from kareus.search.base import SearchResult
from kareus.types import SEQUENTIAL, Candidate, Direction, Measurement

OptionKey = tuple[int, Direction]


@dataclass
class Composition:
    options: dict[OptionKey, list[InstructionOption]]
    reference_options: dict[OptionKey, InstructionOption]
    frontier: IterationFrontier
    dag: Any
    reference: Any  # Assignment: Megatron's iteration time and energy on the same hardware
    residual_measurements: int


def reference_candidate(key: str, ctx: RunContext) -> Candidate:
    """Megatron's default: no overlap, the top clock, the comm library's default SM count."""
    return Candidate(key, SEQUENTIAL, int(ctx.gpu.default_comm_sms), int(ctx.gpu.max_mhz))


def measure_fixed_work(ctx: RunContext, profiler: Any, results: Sequence[SearchResult]
                       ) -> tuple[dict[OptionKey, dict[int, tuple[float, float]]], dict[str, Measurement]]:
    """Profile each instruction's residual (non-partition) work at every searched clock, and each
    partition's Megatron reference candidate. Both go through the journal like any measurement."""
    assert ctx.partitioning is not None
    clocks = sorted({int(m.candidate.freq_mhz) for r in results for m in r.measurements if not m.failed}
                    | {int(ctx.gpu.max_mhz)})
    residual: dict[OptionKey, dict[int, tuple[float, float]]] = {}
    for work in ctx.partitioning.work:
        per_clock: dict[int, tuple[float, float]] = {}
        if work.residual:
            for f in clocks:
                m = profiler.profile_ops(work.residual, f)
                if not m.failed:
                    per_clock[f] = (m.time_s, m.dynamic_energy_j)
        residual[(work.stage, work.direction)] = per_clock
    reference: dict[str, Measurement] = {}
    for ptype in ctx.partitioning.types:
        cand = reference_candidate(ptype.key, ctx)
        reference[ptype.key] = profiler.evaluator(ptype)([cand], [{"pass": "reference"}])[0]
    return residual, reference


def compose(ctx: RunContext, results: Sequence[SearchResult], residual: Mapping[OptionKey, Mapping[int, tuple[float, float]]],
            reference: Mapping[str, Measurement]) -> Composition:
    """Instruction options per (stage, direction), the iteration frontier and the reference point."""
    from kareus.compose import fixed_option_iteration

    assert ctx.partitioning is not None
    measured = {r.partition: [m for m in r.measurements if not m.failed] for r in results}
    options: dict[OptionKey, list[InstructionOption]] = {}
    ref_options: dict[OptionKey, InstructionOption] = {}
    top = int(ctx.gpu.max_mhz)
    for work in ctx.partitioning.work:
        key = (work.stage, work.direction)
        options[key] = compose_instruction(work, measured, residual[key])
        ref = compose_instruction(work, {k: [m] for k, m in reference.items()},
                                  {top: residual[key][top]} if top in residual[key] else {})
        ref_options[key] = ref[0]
    p = ctx.parallel
    dag = pipeline_dag(p.schedule, p.pp, p.num_microbatches)
    gpus_per_stage = p.tp * p.cp * p.dp
    composer = COMPOSERS.build(str(ctx.cfg.compose.name), config=ctx.typed["compose"])
    frontier = composer.compose(dag, options, float(ctx.gpu.static_power_w), gpus_per_stage, p.pp)
    ref_point = fixed_option_iteration(dag, ref_options, float(ctx.gpu.static_power_w), gpus_per_stage, p.pp)
    return Composition(options, ref_options, frontier, dag, ref_point,
                       sum(len(v) for v in residual.values()))
