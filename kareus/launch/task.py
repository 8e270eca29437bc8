"""One partition search as a picklable task, and the function any worker runs to carry it out.

A task holds plain data only (the partition, config sections as dicts, seed, journal path), so the
``local``, ``process`` and ``ray`` launchers all run exactly the same code: each worker builds its own
backend, frequency controller, cooldown, journal handle, profiler and searcher from the task.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from kareus.events import SearchFinished, SearchStarted
from kareus.search.base import SearchResult
from kareus.types import Candidate, Collective, Direction, Link, Op, OpKind, PartitionType, Slot

ListenerFactory = Callable[[], Callable[[Any], None]]


@dataclass
class PartitionSearchTask:
    """Everything one partition search needs, as plain picklable data."""

    partition: PartitionType
    hardware: dict[str, Any]  # the hardware config section, with its ``name``
    search: dict[str, Any]  # the searcher config section, with its ``name``
    profiler: dict[str, Any]  # the profiler config section
    seed: int
    journal_path: str
    config_hash: str
    # zero-arg picklable callables, each returning an event listener built inside the worker
    listener_factories: list[ListenerFactory] = field(default_factory=list)
    initial: list[Candidate] | None = None  # a shared initial design, if any
    prior: list[list[Any]] | None = None  # search.warm_start's prior points (kareus.search.warm.to_rows), if any


def is_real_gpu(hardware: dict[str, Any]) -> bool:
    """Whether the backend measures a physical GPU (needs GPUs reserved) rather than a model or a table."""
    return str(hardware.get("name", "")) not in {"sim", "replay"}


def gpus_needed(task: PartitionSearchTask) -> int:
    """GPUs one measurement occupies: the comm kernel's group (the TP group) on real GPUs, else 0."""
    if not is_real_gpu(task.hardware):
        return 0
    return max(1, int(task.partition.comm.group_size))


def run_search_task(task: PartitionSearchTask, listeners: Sequence[Callable[[Any], None]] = (),
                    journal: Any = None) -> SearchResult:
    """Build backend, profiler and searcher from ``task`` and run the search (journal first, always).

    ``journal``: an open journal to record into instead of ``task.journal_path`` (a remote search's
    node-local one, which relays each row to the run's journal); closed when the search ends."""
    import kareus.hardware  # noqa: F401  (registers backends)
    import kareus.profiler  # noqa: F401  (registers cooldowns and frequency controllers)
    import kareus.runtime  # noqa: F401  (registers the cuda backend in a fresh worker; torch only when used)
    import kareus.search  # noqa: F401  (registers searchers)
    from kareus.events import EventBus
    from kareus.registry import HARDWARE

    bus = EventBus()
    made = [factory() for factory in task.listener_factories]
    for listener in [*made, *listeners]:
        bus.subscribe(listener)

    hw = dict(task.hardware)
    ended = "KILLED"  # what a listener's run ends as if the search stops unfinished: Ctrl-C, SIGTERM
    try:
        backend = HARDWARE.build(hw["name"], config=hw, seed=task.seed)
        try:
            result = _search(task, backend, bus, journal)
        finally:
            _close(backend)  # a real GPU backend's NCCL communicators hold GPU memory and threads
        ended = "FINISHED"  # a run its listener could not end itself (a failed write) ends as the search did
        return result
    except Exception:
        ended = "FAILED"  # an error, not a signal: MLflow's FAILED filter must find it
        raise
    finally:
        for listener in made:
            _close(listener, ended)


def _close(obj: Any, *status: str) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        close(*status)


def thermal_device(task: PartitionSearchTask, backend: Any) -> str:
    """Which GPU's learned thermal state (cooldown anchors, fits) this search shares in the journal.

    A physical GPU's: searches that run on it, one after another, share what it taught. Each task
    builds a fresh simulated GPU (or a CPU stand-in, ``device: cpu``), so there the state is the
    task's own; shared, it would make a parallel launcher's frontiers depend on which worker
    journaled first.
    """
    return thermal_device_of(task.hardware, task.partition.key, backend)


def thermal_device_of(hardware: dict[str, Any], partition: str, backend: Any) -> str:
    """``thermal_device`` from the hardware section and the partition's key (a drift check names it too)."""
    if is_real_gpu(hardware) and hardware.get("device", "cuda") != "cpu":
        return str(getattr(backend, "device_id", "") or backend.name)
    return f"{backend.name}/{partition}"


def _search(task: PartitionSearchTask, backend: Any, bus: Any, journal: Any = None) -> SearchResult:
    """The search on a built backend: profiler (clocks reset on the way out), searcher, journal."""
    from kareus.profiler import Journal, Profiler, ProfilerConfig
    from kareus.registry import SEARCHERS, to_dataclass
    from kareus.search import SearchProblem, budget_for, build_space
    from kareus.search.common import result_reference
    from kareus.search.warm import from_rows

    entry = SEARCHERS.get(task.search["name"])
    scfg = to_dataclass(entry.config_cls, task.search) if entry.config_cls is not None else None
    pcfg = to_dataclass(ProfilerConfig, task.profiler)
    part = task.partition
    journal = journal if journal is not None else Journal.open(task.journal_path, task.config_hash)
    try:
        with Profiler(pcfg, backend, journal, bus.emit, device_id=thermal_device(task, backend)) as profiler:
            space_cfg = getattr(scfg, "space", None)
            if space_cfg is None:
                from kareus.search import SpaceConfig

                space_cfg = SpaceConfig()
            space = build_space(part, backend.gpu, space_cfg, fixed=backend.space(part))
            budget = budget_for(scfg, len(space)) if scfg is not None else len(space)
            bus.emit(SearchStarted(part.key, len(space), budget, task.search["name"]))
            searcher = SEARCHERS.build(task.search["name"], config=scfg)
            result = searcher.run(SearchProblem(
                partition=part, space=space, evaluate=profiler.evaluator(part), budget=budget,
                seed=int(getattr(scfg, "seed", task.seed)),
                static_power_w=float(backend.gpu.static_power_w), initial=list(task.initial or []),
                emit=bus.emit, prior=from_rows(part.key, task.prior or [])))
            if hasattr(result, "gpu_seconds") and not result.gpu_seconds:
                result.gpu_seconds = profiler.gpu_seconds(part.key)
            ok = [m for m in result.measurements if not m.failed]
            ref = result_reference(result)  # the live values' reference: the final value continues them
            hv = result.frontier.hypervolume(ref) if ref is not None and len(result.frontier) else 0.0
            result.gpu_seconds = profiler.gpu_seconds(part.key)
            result.measured_now, result.measured_now_gpu_seconds = profiler.measured_now(part.key)
            bus.emit(SearchFinished(part.key, result.frontier, len(result.measurements),
                                    len(result.measurements) - len(ok), result.gpu_seconds, hv, reference=ref))
    finally:
        journal.close()
    return result


# -- plain-JSON form of a task (for the subprocess driver; listener factories are not carried) ------
def task_to_dict(task: PartitionSearchTask) -> dict[str, Any]:
    d = asdict(task)
    d.pop("listener_factories")
    return json.loads(json.dumps(d, default=lambda o: o.value if hasattr(o, "value") else str(o)))


def _op(d: dict[str, Any]) -> Op:
    return Op(name=d["name"], kind=OpKind(d["kind"]), flops=d["flops"], bytes=d["bytes"],
              collective=Collective(d["collective"]) if d.get("collective") else None,
              message_bytes=d["message_bytes"], group_size=d["group_size"],
              link=Link(d["link"]) if d.get("link") else None,
              shape=tuple(d["shape"]) if d.get("shape") else None)


def partition_from_dict(d: dict[str, Any]) -> PartitionType:
    return PartitionType(
        key=d["key"], direction=Direction(d["direction"]), compute=tuple(_op(o) for o in d["compute"]),
        comm=_op(d["comm"]), slots=tuple(Slot(s["label"], tuple(s["ops"]), s["kind"]) for s in d["slots"]),
        join=d.get("join"))


def task_from_dict(d: dict[str, Any]) -> PartitionSearchTask:
    initial = d.get("initial")
    return PartitionSearchTask(
        partition=partition_from_dict(d["partition"]), hardware=d["hardware"], search=d["search"],
        profiler=d["profiler"], seed=int(d["seed"]), journal_path=d["journal_path"], config_hash=d["config_hash"],
        initial=[Candidate(**c) for c in initial] if initial is not None else None, prior=d.get("prior"))
