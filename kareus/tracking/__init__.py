"""MLflow record of every run, plots, and the progress display.

Importing this package is cheap (it registers the ``tracking`` config schema); MLflow, matplotlib and
rich load only when used.

Pipeline use::

    tracker = Tracker(cfg.tracking)
    with tracker:                                   # ends FINISHED, or FAILED on an exception
        tracker.start(resolved, **hydra_context(), hardware="sim:a100")
        factory = tracker.partition_listener_factory(ptype.key, ptype.slot_labels)  # picklable
        bus.subscribe(factory())                    # in whichever process searches
        tracker.log_microbatch_frontiers({"stage0.fwd": f0, ...})
        tracker.log_iteration_frontier(frontier, reference=(t_megatron, e_megatron), selected=(t, e))
        tracker.log_plan("runs/plans/plan.yaml")
        tracker.log_summary(summary_metrics(t, e, t_megatron, e_megatron, profiled, gpu_seconds))

Multirun: add to conf/config.yaml::

    hydra:
      callbacks:
        mlflow_sweep:
          _target_: kareus.tracking.callback.MlflowSweepCallback
"""
from __future__ import annotations

from typing import Any

from kareus.tracking.config import TrackingConfig, as_tracking_config

_LAZY = {
    "Tracker": "kareus.tracking.tracker",
    "hydra_context": "kareus.tracking.tracker",
    "summary_metrics": "kareus.tracking.tracker",
    "default_run_name": "kareus.tracking.tracker",
    "find_parent_run_id": "kareus.tracking.tracker",
    "PartitionListenerFactory": "kareus.tracking.partition",
    "PartitionRunListener": "kareus.tracking.partition",
    "MlflowSweepCallback": "kareus.tracking.callback",
    "make_progress": "kareus.tracking.progress",
    "ProgressListener": "kareus.tracking.progress",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kareus.tracking' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["TrackingConfig", "as_tracking_config", *_LAZY]
