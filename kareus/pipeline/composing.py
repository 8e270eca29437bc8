"""The composition stage: residual work and Megatron's own layout are measured, then partition
measurements become instruction options, the iteration frontier, and execution plans. An option whose
partitions carry the ``megatron:`` prefix runs the instruction in Megatron's own layout: the
microbatch unsplit, no overlap but Megatron's own (see ``megatron_partitioning``), the comm
library's default SMs, at the option's clock.

Megatron's layout at the top clock is the reference point. With ``plan.compare_perseus`` it is
measured at every clock of the search space too: composed alone, those options are Perseus' space (one clock
per instruction over Megatron's layout), and its iteration frontier is the baseline every plan is
compared with at equal time; they are also options of Kareus' own, so no plan trails Perseus."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kareus.compose import InstructionOption, IterationFrontier, compose_instruction, pipeline_dag
from kareus.errors import KareusError
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
    perseus: IterationFrontier | None = None  # Megatron + Perseus: Megatron's layout, a clock per instruction


@dataclass
class FixedWork:
    """What composition measures besides the partition searches (all through the journal).

    ``residual``: each instruction's non-partition work at every searched clock. ``anchors``: each
    searched partition at no overlap, the top clock and the default SMs, a configuration the search
    may have skipped; as an option it keeps the fastest plan from trailing the plain schedule.
    ``megatron``: Megatron-LM's own layout (unsplit microbatches, its own overlap only, default SMs), its
    partitions and residual work measured at the top clock (the reference every plan is compared
    with) and, with ``perseus``, at every clock of the search space (Perseus' space).
    """

    residual: dict[OptionKey, dict[int, tuple[float, float]]]
    anchors: dict[str, Measurement]
    megatron: Partitioning
    megatron_partitions: dict[str, list[Measurement]]  # one per measured clock
    megatron_residual: dict[OptionKey, dict[int, tuple[float, float]]]
    perseus: bool = False

    @property
    def residual_measurements(self) -> int:
        return sum(len(v) for v in self.residual.values()) + sum(len(v) for v in self.megatron_residual.values())


def reference_candidate(key: str, ctx: RunContext, freq_mhz: int | None = None, slot: str = SEQUENTIAL) -> Candidate:
    """Megatron's default: the comm library's default SM count, no overlap unless ``slot`` says where
    Megatron launches it (see ``megatron_slot``); the top clock unless given."""
    return Candidate(key, slot, int(ctx.gpu.default_comm_sms), int(freq_mhz or ctx.gpu.max_mhz))


def _residual(profiler: Any, work: Any, clocks: Sequence[int]) -> dict[int, tuple[float, float]]:
    """(time, dynamic energy) of one instruction's residual work per clock; failed reads are left out."""
    per_clock: dict[int, tuple[float, float]] = {}
    if work.residual:
        for f in clocks:
            m = profiler.profile_ops(work.residual, f)
            if not m.failed:
                per_clock[f] = (m.time_s, m.dynamic_energy_j)
    return per_clock


def _at_reference(ctx: RunContext, profiler: Any, partitioning: Partitioning, clocks: Sequence[int],
                  megatron: bool = False) -> dict[str, list[Measurement]]:
    """Each partition type at Megatron's default (default SMs) at each of ``clocks``: with no overlap,
    or (``megatron``: Megatron's own partitions) where Megatron launches each comm."""
    from kareus.partition.sequential import megatron_slot

    return {t.key: profiler.evaluator(t)([reference_candidate(t.key, ctx, f, megatron_slot(t) if megatron else SEQUENTIAL)
                                          for f in clocks], [{"pass": "reference"} for _ in clocks])
            for t in partitioning.types}


def measure_fixed_work(ctx: RunContext, profiler: Any, results: Sequence[SearchResult]) -> FixedWork:
    """Profile the residual work, the anchors and Megatron's layout at the top clock (see
    :class:`FixedWork`); :func:`measure_perseus_space` adds Megatron's layout at the other clocks."""
    from kareus.partition import megatron_partitioning

    assert ctx.partitioning is not None and ctx.workload is not None
    top = int(ctx.gpu.max_mhz)
    clocks = sorted({int(m.candidate.freq_mhz) for r in results for m in r.per_setting() if not m.failed} | {top})
    megatron = megatron_partitioning(ctx.workload)
    return FixedWork(
        residual={(w.stage, w.direction): _residual(profiler, w, clocks) for w in ctx.partitioning.work},
        anchors={k: ms[0] for k, ms in _at_reference(ctx, profiler, ctx.partitioning, [top]).items()},
        megatron=megatron,
        megatron_partitions=_at_reference(ctx, profiler, megatron, [top], megatron=True),
        megatron_residual={(w.stage, w.direction): _residual(profiler, w, [top]) for w in megatron.work})


def perseus_clocks(ctx: RunContext) -> list[int]:
    """Perseus' clocks: the search space's clock grid (``search.space.freq_mhz``) and the top clock,
    whatever clocks a search happened to measure, so the baseline is the same for every searcher."""
    from kareus.search.space import clocks

    return sorted(set(clocks(ctx.typed["search"].space, ctx.gpu)) | {int(ctx.gpu.max_mhz)})


def measure_perseus_space(ctx: RunContext, profiler: Any, fixed: FixedWork) -> FixedWork:
    """``fixed`` with Megatron's layout measured at every clock of :func:`perseus_clocks` too: its
    partitions and its residual work. Measured after the top-clock reference, which therefore reads
    the same with or without it."""
    others = [f for f in perseus_clocks(ctx) if f != int(ctx.gpu.max_mhz)]
    extra = _at_reference(ctx, profiler, fixed.megatron, others, megatron=True)
    return dataclasses.replace(
        fixed, perseus=True,
        megatron_partitions={k: ms + extra[k] for k, ms in fixed.megatron_partitions.items()},
        megatron_residual={(w.stage, w.direction): {**fixed.megatron_residual[(w.stage, w.direction)],
                                                    **_residual(profiler, w, others)}
                           for w in fixed.megatron.work})


def _options(work: Any, measurements: Mapping[str, Sequence[Measurement]],
             residual: Mapping[int, tuple[float, float]], what: str, per_clock: bool) -> list[InstructionOption]:
    """``compose_instruction``, its refusal (every reading at every clock failed) as one error line."""
    try:
        return compose_instruction(work, measurements, residual, per_clock=per_clock)
    except ValueError as err:
        raise KareusError(f"{what}: {err}; failed measurements stay in the journal, so a resume fails alike: "
                          "start a new run") from None


def compose(ctx: RunContext, results: Sequence[SearchResult], fixed: FixedWork) -> Composition:
    """Instruction options per (stage, direction), the iteration frontier, Megatron's point and
    (``fixed.perseus``) the Megatron + Perseus frontier."""
    from kareus.compose import fixed_option_frontier

    assert ctx.partitioning is not None
    measured = {r.partition: [m for m in r.per_setting() if not m.failed] for r in results}  # re-read: its mean
    for key, anchor in fixed.anchors.items():
        known = measured.setdefault(key, [])
        if not anchor.failed and all(m.candidate != anchor.candidate for m in known):
            known.append(anchor)
    per_clock = float(ctx.gpu.clock_switch_s) > 0  # priced switches: an option's own clock matters
    options = {(w.stage, w.direction): _options(w, measured, fixed.residual[(w.stage, w.direction)], "compose",
                                                per_clock)
               for w in ctx.partitioning.work}
    top = int(ctx.gpu.max_mhz)
    megatron = {k: [m for m in ms if not m.failed] for k, ms in fixed.megatron_partitions.items()}
    at_top = {k: [m for m in ms if m.candidate.freq_mhz == top] for k, ms in megatron.items()}
    ref_options, perseus_options = {}, {}
    for w in fixed.megatron.work:
        key = (w.stage, w.direction)
        residual = fixed.megatron_residual[key]
        ref_options[key] = _options(w, at_top, {f: v for f, v in residual.items() if f == top},
                                    "Megatron's reference (its layout at the top clock)", False)[0]
        perseus_options[key] = (_options(w, megatron, residual, "Megatron + Perseus", per_clock) if fixed.perseus
                                else [ref_options[key]])
        if ref_options[key] not in perseus_options[key]:
            perseus_options[key].append(ref_options[key])
        # Megatron's own layout is one more way to run an instruction: where splitting the microbatch
        # costs more than overlap saves (host-bound work), the plans keep it and never trail Megatron
        # (nor, at its other clocks, Perseus)
        if ctx.typed["plan"].megatron_layout:
            options.setdefault(key, []).extend(perseus_options[key])
    p = ctx.parallel
    dag = pipeline_dag(p.schedule, p.pp, p.num_microbatches)
    gpus_per_stage = p.tp * p.cp * p.dp
    P = float(ctx.gpu.static_power_w)
    composer = COMPOSERS.build(str(ctx.cfg.compose.name), config=ctx.typed["compose"])
    switch_s = float(ctx.gpu.clock_switch_s)
    reference = fixed_option_frontier(dag, ref_options, P, gpus_per_stage, p.pp, switch_s, "Megatron's reference")
    ref_point = reference.assignments()[0]
    # the times plans are asked for get solves of their own: the user's deadline, Megatron's time and
    # (below) each Perseus point's, so plan selection and the equal-time comparison are exact there;
    # Perseus gets the same solves at the user's deadline and Megatron's time, or the saving quoted
    # there would compare a plan solved at that time with Perseus' nearest faster sweep point
    asked = [t for t in (ctx.typed["plan"].deadline_s, ref_point.time_s) if t is not None]
    perseus = None
    if fixed.perseus:
        perseus = composer.compose(dag, perseus_options, P, gpus_per_stage, p.pp, deadlines=asked,
                                   clock_switch_s=switch_s)
        asked += [a.time_s for a in perseus.frontier]
    budget = ctx.typed["plan"].energy_budget_j  # an energy budget gets a bisection of its own
    frontier = composer.compose(dag, options, P, gpus_per_stage, p.pp, deadlines=asked,
                                energy_budgets=[budget] if budget is not None else [], clock_switch_s=switch_s)
    if ctx.typed["plan"].megatron_layout:
        if perseus is not None:
            # Perseus' plans are Kareus plans too: its points join the frontier, their choices index its options
            perseus = perseus.in_options_of(frontier.model)
            frontier = frontier.joined(perseus)
        # so is Megatron's reference: a composer is a heuristic and may miss it and every plan that beats
        # it; Perseus' sweep holds it, but that is optional (plan.compare_perseus)
        frontier = frontier.joined(reference)
    return Composition(options, ref_options, frontier, dag, ref_point, fixed.residual_measurements, perseus)
