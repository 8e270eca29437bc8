"""The driver of partition searches on a Ray cluster of several nodes (``launcher=ray``).

Each search is placed where its group fits: on the simulated GPU (or a replayed table) one Ray task of
``launcher.cpus_per_task`` CPUs; on real GPUs a placement group of the tensor-parallel group's GPUs on
one node (STRICT_PACK), one actor per rank. Every measurement reaches the run's journal through the
relay (:mod:`kareus.launch.relay`); the driver shows every search's events to its listeners as they
come (progress, MLflow partition runs, made here: a node cannot reach the driver's MLflow store). A
search that loses its worker or node is placed again (``launcher.max_retries``) and continues from the
journal's rows; its replayed events are not shown twice.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kareus.events import BatchFinished, CandidateMeasured, SearchFinished, SearchStarted
from kareus.launch.launchers import WorkerLost
from kareus.launch.relay import (LINEAGE_KEY, RANK_STOP_S, Mailbox, RelayHub, RelaySpec, run_group, run_key,
                                 run_relayed_search, sweep_node)
from kareus.launch.task import PartitionSearchTask, _close, is_real_gpu
from kareus.profiler.journal import Journal
from kareus.search.base import SearchResult

Listener = Callable[[Any], None]
Need = tuple[int, float, float]  # (ranks, GPUs, CPUs) one search's group holds on one node
FIT_CHECK_S = 1.0  # how often the driver checks that a node which fits every waiting search is alive
SWEEP_TIMEOUT_S = 120.0
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node alone


class SearchLost(WorkerLost):
    """A search lost its worker or node more often than allowed, or no live node fits it any more."""


@dataclass
class Shown:
    """What the driver's listeners have seen of one search: a retry replays its answered candidates
    from the journal, and an event sent again after a reset connection comes twice; each is shown once."""

    started: bool = False
    finished: bool = False
    candidates: int = 0  # CandidateMeasured events shown (they count from 0)
    batch: int = -1  # the last BatchFinished shown

    def admit(self, event: Any) -> bool:
        if isinstance(event, SearchStarted):
            seen, self.started = self.started, True
            return not seen
        if isinstance(event, SearchFinished):
            seen, self.finished = self.finished, True
            return not seen
        if isinstance(event, CandidateMeasured):
            if event.index < self.candidates:
                return False
            self.candidates = event.index + 1
        elif isinstance(event, BatchFinished):
            if event.batch <= self.batch:
                return False
            self.batch = event.batch
        return True


@dataclass
class Search:
    task: PartitionSearchTask
    made: list[Listener]  # the task's own listeners (MLflow partition run), made on the driver
    attempt: int = -1
    ref: Any = None
    pg: Any = None
    result: SearchResult | None = None
    shown: Shown = field(default_factory=Shown)

    @property
    def key(self) -> str:
        return self.task.partition.key


def largest(nodes: Sequence[dict]) -> tuple[float, float]:
    """(GPUs, CPUs) of the node with the most GPUs, then CPUs; (0, 0) without any."""
    return max(((float(n["Resources"].get("GPU", 0.0)), float(n["Resources"].get("CPU", 0.0))) for n in nodes),
               default=(0.0, 0.0))


def fits(node: dict, need: Need) -> bool:
    res = node.get("Resources", {})
    return float(res.get("GPU", 0.0)) >= need[1] and float(res.get("CPU", 0.0)) >= need[2]


def alive(ray: Any) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def group_words(need: Need) -> str:
    ranks, gpus, cpus = need
    return f"a group of {ranks} rank(s) on one node ({gpus:g} GPU(s), {cpus:g} CPU(s))"


class ClusterRun:
    """One run's searches on a cluster of several nodes, every row relayed to the run's journal."""

    def __init__(self, ray: Any, cfg: Any, need: Callable[[PartitionSearchTask], Need],
                 listeners: Sequence[Listener] = ()) -> None:
        self.ray, self.cfg, self.need, self.listeners = ray, cfg, need, list(listeners)
        self.placed: dict[str, str] = {}  # partition -> node id of its running attempt (live)
        self.summary: dict[str, Any] = {}
        self._search_fn = ray.remote(run_relayed_search)
        self._group_fn = ray.remote(run_group)
        self._sweep_fn = ray.remote(sweep_node)

    # -- the run -----------------------------------------------------------------------------------
    def run(self, tasks: Sequence[PartitionSearchTask]) -> list[SearchResult]:
        """Every search's result, in task order, once every row is in the run's journal."""
        journal = Journal.open(tasks[0].journal_path, tasks[0].config_hash)
        try:
            return self._run_into(journal, tasks)
        finally:
            journal.close()

    def _run_into(self, journal: Journal, tasks: Sequence[PartitionSearchTask]) -> list[SearchResult]:
        self.mailbox = self.ray.remote(Mailbox).options(num_cpus=0, max_concurrency=1000,
                                                        scheduling_strategy=self._here()).remote()
        self.hub = RelayHub(self.ray, journal, self.mailbox)
        self.placed = self.hub.placed
        inherited = journal.get_meta(LINEAGE_KEY) is not None  # a resumed run: its predecessor's nodes may hold rows
        self.key = run_key(journal)
        searches = [Search(t, [factory() for factory in t.listener_factories]) for t in tasks]
        ended = "KILLED"  # Ctrl-C, SIGTERM
        try:
            for s in searches:
                self._launch(s)
            self._until_done(searches)
            if inherited or any(s.attempt > 0 for s in searches):  # else no search can have left rows behind
                self._sweep()
            ended = "FINISHED"
        except Exception:
            ended = "FAILED"
            raise
        finally:
            self._stop(searches, ended)
        results = [s.result for s in searches if s.result is not None]
        for result in results:
            result.measured_now, result.measured_now_gpu_seconds = self.hub.measured_now(result)
        self.summary = self._nodes_summary()
        return results

    def _here(self) -> Any:
        """The mailbox's node: the driver's, or the head's for a driver outside the cluster (``ray://``),
        so that it lives as long as the run can (a soft choice let Ray put it on any worker node)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = None
        if not str(self.cfg.address or "").startswith("ray://"):
            node = self.ray.get_runtime_context().get_node_id()
        if node is None:
            node = next((n["NodeID"] for n in alive(self.ray) if HEAD_RESOURCE in n.get("Resources", {})), None)
        return NodeAffinitySchedulingStrategy(node, soft=False) if node else "DEFAULT"

    def _serve(self, wait_s: float) -> list[tuple[str, int, Any]]:
        try:
            return self.hub.serve(wait_s)
        except self.ray.exceptions.RayActorError as err:
            why = " ".join(str(err).split())[:300]
            raise WorkerLost(f"launcher: the run's journal relay (a mailbox actor on the driver's node) died ({why})") \
                from None

    def _until_done(self, searches: list[Search]) -> None:
        checked = time.monotonic()
        while any(s.result is None for s in searches):
            self._show(searches, self._serve(0.05))
            running = [s for s in searches if s.result is None]
            done, _ = self.ray.wait([s.ref for s in running], num_returns=len(running), timeout=0)
            if done:
                self._show(searches, self._serve(0.0))  # its last events are in the mailbox already
                ids = set(done)
                for s in running:
                    if s.ref in ids:
                        self._collect(s)
            if time.monotonic() - checked > FIT_CHECK_S:
                checked = time.monotonic()
                self._require_fit([s for s in searches if s.result is None])

    def _show(self, searches: list[Search], events: list[tuple[str, int, Any]]) -> None:
        """Hand the current attempts' events to the listeners, each once."""
        by_key = {s.key: s for s in searches}
        for partition, attempt, event in events:
            s = by_key.get(partition)
            if s is None or s.result is not None or attempt != s.attempt or not s.shown.admit(event):
                continue
            if isinstance(event, CandidateMeasured) and event.cached and \
                    self.hub.measured_here(partition, event.measurement):
                event = dataclasses.replace(event, cached=False)  # measured in this run, by a lost attempt
            for listener in [*s.made, *self.listeners]:
                listener(event)

    # -- placing, collecting, retrying -------------------------------------------------------------
    def _launch(self, s: Search) -> None:
        s.attempt += 1
        spec = RelaySpec(self.mailbox, self.key, s.key, s.attempt, local_dir=self.cfg.local_dir)
        task = dataclasses.replace(s.task, listener_factories=[])
        ranks, gpus, cpus = self.need(s.task)
        self.hub.begin(s.key, s.attempt)
        if not is_real_gpu(s.task.hardware):
            s.ref = self._search_fn.options(num_cpus=cpus, num_gpus=gpus, max_retries=0).remote(task, spec)
            return
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {k: v / ranks for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0} or {"CPU": 0.01}
        s.pg = placement_group([dict(bundle) for _ in range(ranks)], strategy="STRICT_PACK")
        leader = self._group_fn.options(num_cpus=0, max_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            s.pg, placement_group_bundle_index=0))
        s.ref = leader.remote(task, spec, s.pg, ranks, bundle.get("CPU", 0.0), bundle.get("GPU", 0.0))

    def _collect(self, s: Search) -> None:
        """The finished attempt's result; a lost worker or node places the search again."""
        ray = self.ray
        try:
            s.result = ray.get(s.ref)
        except ray.exceptions.RayTaskError as err:
            cause = _cause(ray, err)
            if not _lost(ray, cause):
                raise cause from None  # the search's own error (one line), as under launcher=local
            self._retry(s, type(cause).__name__)
            return
        except ray.exceptions.RayError as err:
            self._retry(s, type(err).__name__)
            return
        self._release(s)
        for listener in s.made:
            _close(listener, "FINISHED")

    def _retry(self, s: Search, why: str) -> None:
        self._release(s)
        if s.attempt >= self.cfg.max_retries:
            raise SearchLost(f"launcher: partition {s.key}'s search lost its Ray worker or node ({why}) "
                             f"{s.attempt + 1} time(s); launcher.max_retries={self.cfg.max_retries}")
        self._require_fit([s])
        self._launch(s)

    def _release(self, s: Search) -> None:
        self.hub.end(s.key)
        if s.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(s.pg)
            except Exception:  # its node is gone with it
                pass
            s.pg = None

    def _require_fit(self, searches: Sequence[Search]) -> None:
        """Stop with one line when no live node fits a waiting search's group: it would wait forever."""
        if not searches:
            return
        nodes = alive(self.ray)
        for s in searches:
            need = self.need(s.task)
            if not any(fits(n, need) for n in nodes):
                gpus, cpus = largest(nodes)
                raise SearchLost(f"launcher: no live node of the Ray cluster fits partition {s.key}'s search, "
                                 f"{group_words(need)}; the largest has {gpus:g} GPU(s) and {cpus:g} CPU(s)")

    # -- the end of the run ------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Collect what searches that died left on the nodes still alive (their rows count if new)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        spec = RelaySpec(self.mailbox, self.key, "", -1, local_dir=self.cfg.local_dir)
        config_hash = self.hub.journal.config_hash
        refs = [self._sweep_fn.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(spec, config_hash) for n in alive(self.ray)]
        deadline = time.monotonic() + SWEEP_TIMEOUT_S
        pending = list(refs)
        while pending and time.monotonic() < deadline:  # a node that died meanwhile keeps its rows
            self._serve(0.05)
            _, pending = self.ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in pending:
            self.ray.cancel(ref, force=True)

    def _stop(self, searches: list[Search], ended: str) -> None:
        """Stop what still runs (a failure, Ctrl-C, SIGTERM), end the listeners, free the mailbox. A
        group's leader is interrupted, not killed, so that its ranks reset their GPUs' clocks."""
        unfinished = [s for s in searches if s.result is None and s.ref is not None]
        for s in unfinished:
            try:
                self.ray.cancel(s.ref, force=s.pg is None)
            except Exception:  # already gone
                pass
        groups = [s.ref for s in unfinished if s.pg is not None]
        if groups:
            self.ray.wait(groups, num_returns=len(groups), timeout=RANK_STOP_S + 5.0)
        for s in searches:
            if s.result is None:
                self._release(s)
                for listener in s.made:
                    _close(listener, ended)
        try:
            self.ray.kill(self.mailbox)
        except Exception:  # pragma: no cover - gone with its node
            pass

    def _nodes_summary(self) -> dict[str, Any]:
        """Per node: searches placed there (retries included), candidates it measured, their GPU-hours."""
        return {"nodes": {label: {"searches": share.searches, "measured_now": share.measured,
                                  "measured_now_gpu_seconds": share.gpu_seconds, "gpu_hours": share.gpu_seconds / 3600}
                          for label, share in sorted(self.hub.nodes.items())}}


def _cause(ray: Any, err: Any) -> BaseException:
    """The error a task raised, through the layers Ray wraps around it (a group's leader re-raises its
    rank's)."""
    cause: Any = err
    while isinstance(cause, ray.exceptions.RayTaskError):
        inner = getattr(cause, "cause", None)
        if not isinstance(inner, BaseException):
            return cause
        cause = inner
    return cause


def _lost(ray: Any, cause: BaseException) -> bool:
    """Whether an attempt ended because its worker, actor or node went away (not by its own error)."""
    return isinstance(cause, ray.exceptions.RayError) and not isinstance(cause, ray.exceptions.RayTaskError)
