"""The search stage: one task per partition type, run by the configured launcher, outputs written."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from kareus.launch import PartitionSearchTask
from kareus.pipeline.context import RunContext
from kareus.registry import HARDWARE, LAUNCHERS
from kareus.search import build_space
from kareus.types import PartitionType


def partition_types(ctx: RunContext, backend: Any) -> list[PartitionType]:
    """The partitions to search: the workload's, or (replay without a model) the table's."""
    if ctx.partitioning is not None:
        return list(ctx.partitioning.types)
    return list(backend.partitions())


def space_sizes(ctx: RunContext, backend: Any, partitions: Sequence[PartitionType]) -> dict[str, int]:
    """Each partition's space size; a ``search.space`` that leaves one empty is a config error (exit 2)."""
    from kareus.errors import KareusError
    from kareus.search.space import slot_problems

    space_cfg = ctx.typed["search"].space
    problems = slot_problems(partitions, space_cfg)
    if problems:
        raise KareusError(problems[0])
    unmeasurable = getattr(backend, "partition_problems", lambda ps: [])(partitions)  # a real GPU's process group
    if unmeasurable:
        more = f" (and {len(unmeasurable) - 1} more partitions alike)" if len(unmeasurable) > 1 else ""
        raise KareusError(f"hardware: {unmeasurable[0]}{more}")
    fixed = {p.key: backend.space(p) for p in partitions}
    unlockable = sorted({int(c.freq_mhz) for space in fixed.values() for c in space or ()
                         if not ctx.gpu.supports_clock(int(c.freq_mhz))})
    if unlockable:  # every candidate at such a clock would fail to lock, each one charged to the budget
        more = f" and {len(unlockable) - 6} more" if len(unlockable) > 6 else ""
        shown = ", ".join(map(str, unlockable[:6])) + more
        raise KareusError(f"hardware: {ctx.hardware_name} recorded clocks {shown} MHz, which "
                          f"{ctx.gpu.name} cannot lock "
                          f"({ctx.gpu.min_mhz}..{ctx.gpu.max_mhz} in {ctx.gpu.step_mhz} MHz steps); describe the GPU "
                          f"the table was recorded on with hardware.gpu, hardware.min_mhz, hardware.max_mhz and "
                          f"hardware.step_mhz")
    too_many = sorted({int(c.sms) for space in fixed.values() for c in space or () if c.sms >= ctx.gpu.sms})
    if too_many:  # a comm on every SM leaves the compute none: not a setting of this GPU
        raise KareusError(f"hardware: {ctx.hardware_name} recorded comm SM counts {', '.join(map(str, too_many[:6]))}, "
                          f"which {ctx.gpu.name} with {ctx.gpu.sms} SMs cannot give a comm kernel (1..{ctx.gpu.sms - 1}); "
                          f"describe the GPU the table was recorded on with hardware.gpu and hardware.sms")
    missing = [k for k, space in fixed.items() if space is not None and not space]
    if missing:  # a recorded table that lacks this workload's partitions: nothing to search or compose
        raise KareusError(f"hardware: {ctx.hardware_name} holds no measurements of partition(s) {', '.join(missing)}; "
                          f"record them, or search the table's own partitions with mode=search and no +model")
    try:
        sizes = {p.key: len(build_space(p, ctx.gpu, space_cfg, fixed=fixed[p.key])) for p in partitions}
    except ValueError as err:
        raise KareusError(str(err)) from None
    emptied = [k for k, n in sizes.items() if n == 0 and fixed[k]]
    if emptied:  # a generated space cannot be empty once validated; a recorded one can be filtered bare
        raise KareusError(f"search.space: keeps none of the settings hardware={ctx.hardware_name} recorded for "
                          f"partition(s) {', '.join(emptied)}; "
                          f"{_recorded_ranges([c for k in emptied for c in fixed[k]])}")
    return sizes


def _recorded_ranges(cands: Sequence[Any]) -> str:
    """What a recorded table holds, in the words of ``search.space``."""
    sms, mhz = sorted({c.sms for c in cands}), sorted({c.freq_mhz for c in cands})
    return (f"they hold sms {sms[0]}..{sms[-1]} and freq_mhz {mhz[0]}..{mhz[-1]} "
            f"(slots: {', '.join(sorted({c.slot for c in cands}))})")


def _takes_layout(hardware: Any) -> bool:
    """Whether a hardware config names the model and layout it measures (``cuda``: its partitions run
    on the model's own megatron-core layer)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(hardware)} if dataclasses.is_dataclass(hardware) else set(hardware)
    return {"model", "parallel"} <= names


def hardware_config(ctx: RunContext) -> Any:
    """The typed hardware config a backend is built from, with the run's model and layout where it takes them."""
    import dataclasses

    from kareus.config.schema import ModelConfig, ParallelConfig
    from kareus.registry import to_dataclass

    hw = ctx.typed["hardware"]
    if ctx.model is None or not _takes_layout(hw):
        return hw
    return dataclasses.replace(hw, model=to_dataclass(ModelConfig, ctx.cfg.model),
                               parallel=to_dataclass(ParallelConfig, ctx.cfg.parallel))


def hardware_section(ctx: RunContext) -> dict[str, Any]:
    """The hardware section as plain data (a worker's backend is built from it), with the run's model and
    layout where the backend takes them."""
    hardware = ctx.section("hardware")
    if ctx.model is not None and _takes_layout(hardware):
        hardware["model"], hardware["parallel"] = ctx.section("model"), ctx.section("parallel")
    return hardware


def make_backend(ctx: RunContext, seed: int | None = None) -> Any:
    """The run's backend; ``seed`` (default: the run's) keys a simulated GPU's reading noise."""
    seed = int(ctx.cfg.seed) if seed is None else int(seed)
    return HARDWARE.build(ctx.hardware_name, config=hardware_config(ctx), seed=seed)


@contextmanager
def opened_backend(ctx: RunContext, seed: int | None = None) -> Iterator[Any]:
    """The run's own backend (space sizes, residual work, the reference), closed on the way out so a
    real GPU's NVML handle and comm groups are released also when the run fails."""
    backend = make_backend(ctx, seed)
    try:
        yield backend
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()


def make_tasks(ctx: RunContext, partitions: Sequence[PartitionType],
               listener_factories: Callable[[PartitionType], list[Any]],
               prior: dict[str, list[Any]] | None = None) -> list[PartitionSearchTask]:
    """One task per partition; ``prior``: the warm-start prior points per partition key (plain rows in the task)."""
    from kareus.search.warm import to_rows

    hardware, search, profiler = hardware_section(ctx), ctx.section("search"), ctx.section("profiler")
    journal = str(ctx.journal_path)
    return [PartitionSearchTask(partition=p, hardware=hardware, search=search, profiler=profiler,
                                seed=int(ctx.cfg.seed), journal_path=journal, config_hash=ctx.config_hash,
                                listener_factories=listener_factories(p),
                                prior=to_rows(prior.get(p.key, [])) if prior else None)
            for p in partitions]


def checked_launcher(ctx: RunContext, partitions: Sequence[PartitionType]) -> Any:
    """The configured launcher, once it has checked it can run a search of each partition (Ray: the
    cluster's GPUs, CPUs and nodes): before the run is recorded, so a refusal writes nothing."""
    launcher = LAUNCHERS.build(str(ctx.cfg.launcher.name), config=ctx.typed["launcher"])
    launcher.check(make_tasks(ctx, partitions, lambda p: []))
    return launcher
