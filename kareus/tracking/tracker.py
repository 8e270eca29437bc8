"""One MLflow run per invocation: config, choices, overrides, frontiers, plan and summary.

The pipeline calls these methods with generic values (mappings, Frontier objects, paths); partition
searches get a picklable listener factory instead, so they can log from any process.
"""
from __future__ import annotations

import getpass
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from kareus.errors import OutputClosed
from kareus.frontier import Frontier, hypervolume_ratio
from kareus.tracking import records
from kareus.tracking.config import TrackingConfig, as_tracking_config
from kareus.tracking.partition import KIND_TAG, PARENT_TAG, PartitionListenerFactory
from kareus.tracking.store import ENV_PARENT_RUN, PARENT_RUN_FILE, base_dir, connect, retry

log = logging.getLogger(__name__)


def git_state(path: str | os.PathLike | None = None) -> dict[str, str]:
    """Commit and dirtiness of the checkout at ``path`` ({} outside a git checkout).

    By default the checkout kareus itself is installed from (``pip install -e .``), wherever the
    command is run from: the code that made the numbers, not the working folder.
    """
    checks = []
    if path is None:
        import kareus

        path = Path(kareus.__file__).resolve().parent
        checks = [["ls-files", "--error-unmatch", "__init__.py"]]  # a checkout, not a venv inside one
    try:
        for args in checks:
            subprocess.run(["git", "-C", str(path), *args], capture_output=True, timeout=10, check=True)
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git.commit": commit, "mlflow.source.git.commit": commit, "git.dirty": str(bool(dirty)).lower()}


NAMED_GROUPS = ("model", "parallel", "search", "experiment")  # shown by their option alone
# how a run is shown, run or recorded, not what it measures; resume= continues the same config (its hash is checked)
UNNAMED_KEYS = ("progress", "launcher", "tracking", "resume")


def default_run_name(choices: Mapping[str, Any], overrides: Sequence[str] = ()) -> str:
    """``qwen1.7b pp2_tp8 mbo`` plus every other override (``hardware=h100_sim``, ``seed=1``), so
    sweep jobs get distinct names; overrides that cannot change a result (``progress=false``,
    ``launcher=process``, ``tracking.plots=false``, ``resume=DIR``) stay out, so the same experiment keeps one name
    (they remain in the run's ``override.*`` tags)."""
    parts = [str(choices[g]) for g in NAMED_GROUPS if choices.get(g)]
    for item in map(records.normal_override, overrides):
        key = item.partition("=")[0].lstrip("+~")
        if key not in NAMED_GROUPS and key.split(".")[0].split("/")[0] not in UNNAMED_KEYS:
            parts.append(item.lstrip("+~"))
    return records.truncate(" ".join(parts) or "kareus", 250)


def summary_metrics(plan_time_s: float, plan_energy_j: float, reference_time_s: float | None = None,
                    reference_energy_j: float | None = None, profiled: int | None = None,
                    profiling_gpu_seconds: float | None = None, simulated: bool | None = True) -> dict[str, float]:
    """The standard summary metric names: the selected plan, its savings against the reference (Megatron)
    in percent, positive = faster / less energy, named as in summary.json (``plan.time_saving_pct`` is
    its ``selected.time_saving_pct``), and cost (its name says when the GPU-hours are simulated)."""
    out = {"plan.iteration_time_s": plan_time_s, "plan.iteration_energy_j": plan_energy_j}
    if reference_time_s:
        out["reference.iteration_time_s"] = reference_time_s
        out["plan.time_saving_pct"] = 100.0 * (1 - plan_time_s / reference_time_s)
        out["speedup"] = reference_time_s / plan_time_s if plan_time_s else float("nan")
    if reference_energy_j:
        out["reference.iteration_energy_j"] = reference_energy_j
        out["plan.energy_saving_pct"] = 100.0 * (1 - plan_energy_j / reference_energy_j)
    if profiled is not None:
        out["profiled_candidates"] = profiled
    if profiling_gpu_seconds is not None:
        out[records.gpu_hours_name(simulated, "profiling_")] = profiling_gpu_seconds / 3600.0
    return out


def hydra_context() -> dict[str, Any]:
    """``choices``, ``overrides`` and ``run_name`` of the running Hydra job ({} outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return {}
    if not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    choices = {k: v for k, v in dict(hc.runtime.choices).items()}
    overrides = list(hc.overrides.task)
    return {"choices": choices, "overrides": overrides, "run_name": default_run_name(choices, overrides)}


def find_parent_run_id() -> str | None:
    """The sweep run of the current multirun: from the environment, else from the sweep directory."""
    if os.environ.get(ENV_PARENT_RUN):
        return os.environ[ENV_PARENT_RUN]
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            path = Path(HydraConfig.get().runtime.cwd) / HydraConfig.get().sweep.dir / PARENT_RUN_FILE
            if path.is_file():
                return path.read_text().strip() or None
    except Exception:  # no hydra, or an unusual launcher layout
        return None
    return None


class Tracker:
    """The record of one invocation. With ``enabled: false`` every method does nothing."""

    def __init__(self, config: TrackingConfig | Mapping[str, Any] | None = None,
                 base: str | os.PathLike | None = None) -> None:
        self.config = as_tracking_config(config)
        self.base = str(base) if base is not None else None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.uri: str | None = None
        self.hardware: str | None = None
        self.simulated: bool | None = None
        self.run_name = ""
        self._identity: dict[str, str] = {}  # the invocation's choice, override and git tags
        self._client = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.enabled)

    @property
    def active(self) -> bool:
        return self.enabled and self.run_id is not None

    def _note(self) -> str | None:
        sim = " (simulated)" if self.simulated else ""
        return f"hardware: {self.hardware}{sim}" if self.hardware else ("simulated" if self.simulated else None)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, resolved_config: Mapping[str, Any], choices: Mapping[str, Any] | None = None,
              overrides: Sequence[str] = (), hardware: str | None = None, run_name: str | None = None,
              parent_run_id: str | None = None, tags: Mapping[str, str] | None = None,
              simulated: bool | None = None) -> str | None:
        """Create the invocation's run (nested under the sweep run in a multirun); return its id.

        ``simulated=True`` labels plots and the run as simulated-hardware numbers.
        """
        if not self.enabled:
            return None
        choices = dict(choices or {})
        base = self.base or base_dir()
        self._client, self.experiment_id, self.uri = connect(
            self.config.uri, self.config.experiment, self.config.artifact_location, base, self.config.telemetry)
        self.hardware = hardware
        self.simulated = simulated
        parent = parent_run_id or find_parent_run_id()
        all_tags = {KIND_TAG: "invocation", "mlflow.user": _user(), "mlflow.source.name": "kareus",
                    "mlflow.source.type": "LOCAL", **records.choice_tags(choices), **records.override_tags(overrides),
                    **git_state()}
        if hardware:
            all_tags["hardware"] = hardware
        if simulated is not None:
            all_tags["simulated"] = str(bool(simulated)).lower()
        if parent:
            all_tags[PARENT_TAG] = parent
        all_tags.update({records.clean_key(k): records.truncate(str(v), records.MAX_TAG_VALUE)
                         for k, v in (tags or {}).items()})
        # the user's tracking.run_name wins over the caller's derived name
        name = records.truncate(self.config.run_name or run_name or default_run_name(choices, overrides), 250)
        run = retry(self._client.create_run, self.experiment_id, run_name=name, tags=all_tags)
        self.run_id = run.info.run_id
        self.run_name = name
        # what tells one job from another, for the partition runs too (filters and chart legends)
        self._identity = {k: v for k, v in all_tags.items()
                          if k.startswith(("choice.", "override", "git.", "mlflow.source.git"))}
        self._log_params(records.config_params(resolved_config))
        import yaml

        retry(self._client.log_text, self.run_id,
              records.redacted(yaml.safe_dump(records.plain(resolved_config), sort_keys=False)), "config.yaml")
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Close the run; partition runs left open (a crashed worker) are closed as KILLED/FAILED."""
        if not self.active:
            return
        child_status = "KILLED" if status == "FINISHED" else status
        try:
            open_children = retry(self._client.search_runs, [self.experiment_id],
                                  filter_string=f"tags.`{PARENT_TAG}` = '{self.run_id}' and attributes.status = 'RUNNING'",
                                  max_results=1000)
            for child in open_children:
                retry(self._client.set_terminated, child.info.run_id, child_status)
        except Exception:
            log.warning("could not close the partition runs of %s", self.run_id, exc_info=True)
        retry(self._client.set_terminated, self.run_id, status)
        self.run_id = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, (KeyboardInterrupt, SystemExit, OutputClosed)):
            self.end("KILLED")  # Ctrl-C, SIGTERM turned into SystemExit by the CLI, or a reader that left (| head)
            return
        if exc is not None and self.active:  # why it failed, beside the status (the run's one error line)
            try:
                retry(self._client.set_tag, self.run_id, "error",
                      records.truncate(str(exc).strip().splitlines()[0] if str(exc).strip() else exc_type.__name__,
                                       records.MAX_TAG_VALUE))
            except Exception:
                log.warning("could not record the error of %s", self.run_id, exc_info=True)
        self.end("FAILED" if exc_type else "FINISHED")

    # ---- partition searches ---------------------------------------------------------------
    def partition_listener_factory(self, partition_key: str, slot_labels: Sequence[str] = ()) -> PartitionListenerFactory:
        """A picklable zero-arg callable; call it (in any process) for the partition's event listener."""
        if not self.active:
            return PartitionListenerFactory(partition_key, None)
        return PartitionListenerFactory(
            partition=partition_key, uri=self.uri, experiment_id=self.experiment_id, parent_run_id=self.run_id,
            run_name=records.truncate(f"partition {partition_key} · {self.run_name}", 250), slot_labels=tuple(slot_labels),
            candidates=self.config.candidates, plots=self.config.plots, telemetry=self.config.telemetry,
            note=self._note(), flush_interval_s=self.config.flush_interval_s,
            tags=(*self._identity.items(), *((("hardware", self.hardware),) if self.hardware else ()),
                  *((("simulated", str(bool(self.simulated)).lower()),) if self.simulated is not None else ())),
            simulated=self.simulated)

    # ---- results --------------------------------------------------------------------------
    def log_microbatch_frontiers(self, frontiers: Mapping[str, Frontier],
                                 references: Mapping[str, tuple[float, float]] | None = None) -> None:
        """Per-instruction frontiers (keys like ``stage0.fwd``): a table each and one grid plot."""
        if not self.active or not frontiers:
            return
        for key, frontier in frontiers.items():
            self._log_frontier(frontier, f"frontiers/microbatch/{records.clean_key(key).replace('/', '_')}")
            self._log_metrics({f"microbatch.{records.clean_key(key)}.frontier_points": len(frontier)})
        if self.config.plots:
            from kareus.tracking import plots

            with tempfile.TemporaryDirectory() as tmp:
                plots.plot_frontiers(frontiers, Path(tmp) / "microbatch_frontiers.png", note=self._note(),
                                     references=references, energy="dynamic energy")
                retry(self._client.log_artifacts, self.run_id, tmp, "plots")

    def log_iteration_frontier(self, frontier: Frontier, reference: tuple[float, float] | None = None,
                               selected: tuple[float, float] | None = None,
                               hv_reference: tuple[float, float] | None = None,
                               baseline: Frontier | None = None) -> None:
        """The iteration frontier as a table and a plot with the Megatron ``reference`` (time, energy)
        and the ``baseline`` frontier (Megatron + Perseus)."""
        if not self.active:
            return
        self._log_frontier(frontier, "frontiers/iteration")
        if baseline is not None:
            self._log_frontier(baseline, "frontiers/perseus")
        metrics: dict[str, float] = {"iteration.frontier_points": len(frontier)}
        if len(frontier):
            metrics["iteration.min_time_s"] = float(frontier.times.min())
            metrics["iteration.min_energy_j"] = float(frontier.energies.min())
        hv_ref = hv_reference or reference
        if hv_ref is not None:
            metrics["iteration.hypervolume"] = frontier.hypervolume(tuple(hv_ref))
            ratio = hypervolume_ratio(metrics["iteration.hypervolume"], tuple(hv_ref))
            if ratio is not None:  # share of the rectangle (0 s, 0 J)-reference the frontier dominates
                metrics["iteration.hypervolume_ratio"] = ratio
        if reference is not None:
            metrics["reference.iteration_time_s"], metrics["reference.iteration_energy_j"] = map(float, reference)
        self._log_metrics(metrics)
        if self.config.plots:
            from kareus.tracking import plots

            with tempfile.TemporaryDirectory() as tmp:
                plots.plot_iteration_frontier(frontier, Path(tmp) / "iteration_frontier.png", reference=reference,
                                              selected=selected, note=self._note(), baseline=baseline)
                retry(self._client.log_artifacts, self.run_id, tmp, "plots")

    def log_plan(self, path: str | os.PathLike, artifact_path: str = "plan") -> None:
        """The selected execution plan file (YAML/JSON) as an artifact."""
        if self.active:
            retry(self._client.log_artifact, self.run_id, str(path), artifact_path)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Any file or folder (journals, extra plans) as an artifact."""
        if not self.active:
            return
        if Path(path).is_dir():
            retry(self._client.log_artifacts, self.run_id, str(path), artifact_path)
        else:
            retry(self._client.log_artifact, self.run_id, str(path), artifact_path)

    def log_summary(self, metrics: Mapping[str, float], tags: Mapping[str, str] | None = None) -> None:
        """Summary metrics (see :func:`summary_metrics` for the standard names) and optional tags."""
        if not self.active:
            return
        self._log_metrics(dict(metrics))
        if tags:
            from mlflow.entities import RunTag

            retry(self._client.log_batch, self.run_id,
                  tags=[RunTag(records.clean_key(k), records.truncate(str(v), records.MAX_TAG_VALUE))
                        for k, v in tags.items()])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Metrics of one step (a training iteration), so MLflow charts them over steps."""
        if self.active:
            self._log_metrics(dict(metrics), step)

    # ---- helpers --------------------------------------------------------------------------
    def _log_frontier(self, frontier: Frontier, stem: str) -> None:
        text, table = records.frontier_artifacts(frontier)
        retry(self._client.log_text, self.run_id, text, f"{stem}.csv")
        retry(self._client.log_table, self.run_id, table, f"{stem}.json")

    def _log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(records.clean_key(k), float(v), ts, step) for k, v in metrics.items() if records.finite(v)]
        for i in range(0, len(ms), 1000):
            retry(self._client.log_batch, self.run_id, metrics=ms[i:i + 1000])

    def _log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            retry(self._client.log_batch, self.run_id, params=items[i:i + 100])


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        return "unknown"

