"""A nested MLflow run per partition search, fed by search events, in whichever process searches.

The factory is a small frozen dataclass (picklable): a launcher ships it to a worker process, calls
it there, and subscribes the returned listener to that process's event bus. Logging goes through
``MlflowClient`` with an explicit run id, so any number of searches can log at once.
"""
from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kareus.events import BatchFinished, CandidateMeasured, SearchFinished, SearchStarted
from kareus.tracking import records
from kareus.tracking.store import client_for, retry

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"
KIND_TAG = "kareus.kind"


def _ignore(event: Any) -> None:
    """The listener of a disabled tracker."""


@dataclass(frozen=True)
class PartitionListenerFactory:
    """Zero-argument, picklable: ``factory()`` makes the event listener for one partition search."""

    partition: str
    uri: str | None  # None: tracking disabled, the listener ignores events
    experiment_id: str = ""
    parent_run_id: str | None = None
    run_name: str | None = None
    slot_labels: tuple[str, ...] = ()  # fixes knob.slot_index; empty: order of first appearance
    candidates: bool = True
    plots: bool = True
    telemetry: bool = False
    note: str | None = None  # shown under plot titles, e.g. "hardware: sim (simulated)"
    flush_interval_s: float = 1.0  # candidate metrics are written at most this often (0: each at once)
    tags: tuple[tuple[str, str], ...] = ()
    simulated: bool | None = True  # GPU-hours from the simulated GPU (named so)

    def __call__(self) -> Callable[[Any], None]:
        return PartitionRunListener(self) if self.uri else _ignore


class PartitionRunListener:
    """Logs one partition search into its own nested run; events of other partitions are ignored."""

    def __init__(self, spec: PartitionListenerFactory) -> None:
        self.spec = spec
        self.run_id: str | None = None
        self.rows: list[dict[str, Any]] = []
        self.hv: list[tuple[int, float]] = []  # (profiled, hypervolume_ratio) after each batch
        self.reference: tuple[float, float] | None = None  # the search's one hypervolume reference
        self.budget: int | None = None
        self.finished = False
        self.errors = 0
        self._slots: dict[str, int] = {s: i for i, s in enumerate(spec.slot_labels)}
        self._client = None
        self._pending: list[Any] = []  # candidate metrics not yet written
        self._pending_params: list[Any] = []  # params whose write failed: the next flush retries them
        self._last_flush = time.monotonic()

    # ---- event dispatch -------------------------------------------------------------------
    def __call__(self, event: Any) -> None:
        if getattr(event, "partition", None) != self.spec.partition or self.finished:
            return
        handler = {SearchStarted: self._started, CandidateMeasured: self._measured,
                   BatchFinished: self._batch, SearchFinished: self._finished}.get(type(event))
        if handler is None:
            return
        try:
            handler(event)
        except Exception:  # tracking must never stop a search; warn and go on
            self.errors += 1
            log.warning("MLflow logging failed for partition %s (%s)", self.spec.partition,
                        type(event).__name__, exc_info=True)

    @property
    def client(self):
        if self._client is None:
            self._client = client_for(self.spec.uri, self.spec.telemetry)
        return self._client

    def _ensure_run(self) -> str:
        if self.run_id is None:
            tags = {KIND_TAG: "partition", "partition": self.spec.partition, **dict(self.spec.tags)}
            if self.spec.parent_run_id:
                tags[PARENT_TAG] = self.spec.parent_run_id
            run = retry(self.client.create_run, self.spec.experiment_id,
                        run_name=self.spec.run_name or self.spec.partition, tags=tags)
            self.run_id = run.info.run_id
            if self.spec.slot_labels:
                self._log(params={"slot_labels": ",".join(self.spec.slot_labels)})
        return self.run_id

    def _log(self, metrics: dict[str, float] | None = None, step: int = 0,
             params: dict[str, Any] | None = None, buffered: bool = False) -> None:
        """Write metrics/params; ``buffered`` candidate metrics wait up to ``flush_interval_s``.

        Each SQLite write commits to disk (tens of ms); a fast simulated search would spend more time
        logging than searching if every candidate were its own transaction.
        """
        from mlflow.entities import Metric, Param

        ts = int(time.time() * 1000)
        self._pending.extend(Metric(records.clean_key(k), float(v), ts, step) for k, v in (metrics or {}).items()
                             if records.finite(v))
        ps = [Param(records.clean_key(k), records.truncate(str(v), records.MAX_PARAM_VALUE))
              for k, v in (params or {}).items()]
        if buffered and not ps and time.monotonic() - self._last_flush < self.spec.flush_interval_s:
            return
        self.flush(ps)

    def flush(self, params: list[Any] | None = None) -> None:
        """Write buffered metrics now (in chunks within MLflow's batch limit). What a failed write held
        goes back to the buffer for the next flush or ``close``: a store that is busy once (a lock
        that outlasted the retries, a server's 5xx) leaves no hole in a candidate's history."""
        ms, self._pending = self._pending, []
        ps, self._pending_params = [*self._pending_params, *(params or [])], []
        self._last_flush = time.monotonic()
        if not ms and not ps:
            return
        written = 0
        try:
            run_id = self._ensure_run()
            for i in range(0, max(len(ms), 1), 1000):
                retry(self.client.log_batch, run_id, metrics=ms[i:i + 1000], params=ps if i == 0 else [])
                written = i + 1000
        except BaseException:
            self._pending[:0] = ms[written:]
            if not written:
                self._pending_params[:0] = ps
            raise

    # ---- handlers -------------------------------------------------------------------------
    def _started(self, ev: SearchStarted) -> None:
        self.budget = ev.budget
        self._ensure_run()
        self._log(params={"space_size": ev.space_size, "budget": ev.budget, "searcher": ev.searcher})

    def _slot_index(self, slot: str) -> int:
        return self._slots.setdefault(slot, len(self._slots))

    def _measured(self, ev: CandidateMeasured) -> None:
        row = records.candidate_row(ev)
        self.rows.append(row)
        self._ensure_run()
        if not self.spec.candidates:
            return
        metrics = {k: row[k] for k in records.CANDIDATE_METRICS}
        metrics[records.gpu_hours_name(self.spec.simulated)] = row["gpu_seconds"] / 3600.0  # the GPU time so far
        metrics.update({f"knob.{k}": row[k] for k in records.KNOB_METRICS})
        metrics["knob.slot_index"] = self._slot_index(row["slot"])
        metrics["failed"] = float(row["failed"])
        metrics.update({k: v for k, v in row.items() if k.startswith("predicted_")})
        self._log(metrics, step=ev.index, buffered=True)

    def _batch(self, ev: BatchFinished) -> None:
        metrics = {"hypervolume": ev.hypervolume, "batch": ev.batch}
        if ev.hypervolume_ratio is not None:
            self.hv.append((ev.profiled, ev.hypervolume_ratio))
            self.reference = ev.reference
            metrics["hypervolume_ratio"] = ev.hypervolume_ratio
        if ev.predicted_gain is not None:
            metrics["predicted_gain"] = ev.predicted_gain
        self._log(metrics, step=ev.profiled)
        self._write_candidates()

    def _finished(self, ev: SearchFinished) -> None:
        """Record the frontier and end the run FINISHED: the search did finish, so a write that fails
        here (warned and counted) leaves the run's record short, not the run KILLED."""
        try:
            self._record_finish(ev)
        finally:
            self.close("FINISHED")

    def _record_finish(self, ev: SearchFinished) -> None:
        records.mark_frontier(self.rows, ev.frontier)
        final = {"profiled": ev.profiled, "failed_candidates": ev.failed,
                 records.gpu_hours_name(self.spec.simulated): ev.gpu_seconds / 3600.0,
                 "hypervolume_final": ev.hypervolume, "frontier_points": len(ev.frontier)}
        if ev.hypervolume_ratio is not None:
            if not self.hv or self.hv[-1][0] != ev.profiled:
                self.hv.append((ev.profiled, ev.hypervolume_ratio))
            self.reference = ev.reference
            final["hypervolume_ratio_final"] = ev.hypervolume_ratio
            final["hypervolume_reference_time_s"], final["hypervolume_reference_energy_j"] = ev.reference
        self._log(final, step=ev.profiled)
        run_id = self._ensure_run()
        self._write_candidates(table=True)
        text, table = records.frontier_artifacts(ev.frontier)
        retry(self.client.log_text, run_id, text, "frontier.csv")
        retry(self.client.log_table, run_id, table, "frontier.json")
        if self.spec.plots:
            self._plots(ev)

    def _write_candidates(self, table: bool = False) -> None:
        if not self.rows:
            return
        run_id = self._ensure_run()
        retry(self.client.log_text, run_id, records.to_csv(self.rows), "candidates.csv")
        if table:
            retry(self.client.log_table, run_id, records.to_table(self.rows), "candidates.json")

    def _plots(self, ev: SearchFinished) -> None:
        from kareus.tracking import plots

        with tempfile.TemporaryDirectory() as tmp:
            key = self.spec.partition
            plots.plot_partition_frontier(self.rows, ev.frontier, Path(tmp) / "frontier.png",
                                          title=f"Partition {key}: measured candidates", note=self.spec.note)
            if self.hv:
                plots.plot_hypervolume([p for p, _ in self.hv], [h for _, h in self.hv],
                                       Path(tmp) / "hypervolume.png", title=f"Partition {key}: hypervolume ratio",
                                       note=self.spec.note, budget=self.budget, reference=self.reference)
            retry(self.client.log_artifacts, self.run_id, tmp, "plots")

    def close(self, status: str = "KILLED") -> None:
        """End the run (an error, an interrupt: the search stopped without SearchFinished), writing
        what is buffered first; a run whose end could not be written stays open for the next call."""
        if self.run_id is None or self.finished:
            return
        try:
            self.flush()
        finally:
            retry(self.client.set_terminated, self.run_id, status)
            self.finished = True
