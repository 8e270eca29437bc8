"""Hydra callback: a multirun gets one parent (sweep) MLflow run; each job's run nests under it.

The store and experiment are created here, once, before any job starts, so jobs running in
parallel never initialise SQLite concurrently. The parent id reaches the jobs through an environment
variable (inherited by launcher processes) and a file in the sweep directory. When a job raises,
Hydra re-raises it and skips ``on_multirun_end``; an exit hook then closes the sweep run as FAILED
instead of leaving it RUNNING. ``jobs`` and ``jobs_failed`` count Hydra's jobs (a job that failed
before it opened an MLflow run counts too); a job started but never ended counts as failed.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from kareus.tracking import records
from kareus.tracking.config import as_tracking_config
from kareus.tracking.partition import KIND_TAG, PARENT_TAG
from kareus.tracking.store import ENV_PARENT_RUN, PARENT_RUN_FILE, connect, retry

log = logging.getLogger(__name__)


class MlflowSweepCallback(Callback):
    """Add under ``hydra.callbacks`` in conf/config.yaml (see kareus/tracking/__init__.py)."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self._client = None
        self._experiment_id: str | None = None
        self._previous_env: str | None = None
        self._started = 0
        self._completed = 0

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        tracking = as_tracking_config(config.get("tracking")) if "tracking" in config else None
        mode = config.get("mode")
        if tracking is None or not tracking.enabled or str(getattr(mode, "value", mode)) == "describe":
            return  # describe records nothing
        hydra = config.hydra
        cwd = hydra.runtime.cwd or os.getcwd()
        from kareus.errors import KareusError

        try:
            self._client, self._experiment_id, _ = connect(tracking.uri, tracking.experiment,
                                                           tracking.artifact_location, cwd, tracking.telemetry)
        except KareusError:
            return  # a store no job can record into (a deleted experiment): each job is refused with its line
        overrides = list(hydra.overrides.task)
        sweep_dir = Path(cwd) / str(hydra.sweep.dir)
        tags = {KIND_TAG: "sweep", "sweep.dir": str(sweep_dir), **records.override_tags(overrides)}
        from kareus.tracking.tracker import _user, git_state

        tags.update({"mlflow.user": _user(), **git_state()})
        name = "sweep " + (" ".join(overrides) if overrides else sweep_dir.name)
        run = retry(self._client.create_run, self._experiment_id, run_name=records.truncate(name, 250), tags=tags)
        self.run_id = run.info.run_id
        self._previous_env = os.environ.get(ENV_PARENT_RUN)
        os.environ[ENV_PARENT_RUN] = self.run_id
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PARENT_RUN_FILE).write_text(self.run_id + "\n")
        atexit.register(self._finish, aborted=True)
        log.info("MLflow sweep run %s", self.run_id)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        self._started += 1

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        from kareus.errors import JobRefused

        done = job_return is not None and job_return.status == JobStatus.COMPLETED
        self._completed += int(done and not isinstance(job_return.return_value, JobRefused))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._finish(aborted=False)

    def _finish(self, aborted: bool) -> None:
        """Close the sweep run: FAILED if any job failed or the sweep never reached its end."""
        if self.run_id is None:
            return
        children = retry(self._client.search_runs, [self._experiment_id],
                         filter_string=f"tags.`{PARENT_TAG}` = '{self.run_id}'", max_results=10000)
        for child in children:  # a job whose process died never closed its run
            if child.info.status == "RUNNING":
                retry(self._client.set_terminated, child.info.run_id, "FAILED")
        simulated = sweep_simulated(children)
        if simulated is not None:
            retry(self._client.set_tag, self.run_id, "simulated", simulated)
        failed = self._started - self._completed
        from mlflow.entities import Metric

        now = int(time.time() * 1000)  # MLflow's timestamps are milliseconds; 0 would chart as 1970
        retry(self._client.log_batch, self.run_id,
              metrics=[Metric("jobs", float(self._started), now, 0), Metric("jobs_failed", float(failed), now, 0)])
        retry(self._client.set_terminated, self.run_id, "FAILED" if failed or aborted else "FINISHED")
        if self._previous_env is None:
            os.environ.pop(ENV_PARENT_RUN, None)
        else:
            os.environ[ENV_PARENT_RUN] = self._previous_env
        self.run_id = None


def sweep_simulated(children: list[Any]) -> str | None:
    """The sweep's ``simulated`` tag from its jobs' runs: ``true`` or ``false`` when they agree,
    ``mixed`` when a sweep over ``hardware=`` ran on both, None when no job got that far."""
    seen = {child.data.tags["simulated"] for child in children if "simulated" in child.data.tags}
    if not seen:
        return None
    return seen.pop() if len(seen) == 1 else "mixed"
