"""How MLflow's UI opens Kareus' experiment: its model-training view and a saved view of the invocations.

MLflow 3 opens an experiment in its GenAI view (traces) unless told otherwise, and its runs table shows
no metric column and counts every nested partition run. Both are set through experiment tags that the
UI itself reads and writes, so they travel with the store (a shared tracking server included):

- ``mlflow.experimentKind = custom_model_development``: the experiment type the UI's type selector
  writes. MLflow 3.17 shows the view of the sidebar's GenAI / Model training switch instead (the
  browser remembers it; ``?workflowType=machine_learning`` in the URL sets it): :func:`runs_url` sets
  it, and docs/mlflow.md says where the switch is.
- ``mlflow.sharedViewState.<id>``: a saved view of the runs page (its **Views** menu; the
  ``viewStateShareKey=<id>`` URL parameter opens it): the invocation runs alone, with the headline
  metrics as columns.
"""
from __future__ import annotations

import json
import time
from typing import Mapping

from kareus.tracking.partition import KIND_TAG

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"  # the UI's value for "Machine learning / model training"
VIEW_ID = "kareus-invocations"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_ID}"
VIEW_NAME = "Kareus invocations"
INVOCATIONS_FILTER = f"tags.`{KIND_TAG}` = 'invocation'"  # not the nested partition runs, not sweeps
# the selected plan per iteration, and its savings against Megatron (see tracker.summary_metrics)
HEADLINE_METRICS = ("plan.iteration_time_s", "plan.iteration_energy_j", "plan.energy_saving_pct",
                    "plan.time_saving_pct")


def view_state() -> dict[str, object]:
    """The saved view's state, as the runs page stores it: a search filter and the visible columns
    (``metrics.`name```), which replace the default ones (source, models, dataset)."""
    return {"searchFilter": INVOCATIONS_FILTER,
            "selectedColumns": [f"metrics.`{name}`" for name in HEADLINE_METRICS]}


def view_tag_value(now_ms: int | None = None) -> str:
    """The saved view as the UI's envelope: its name, times in ms and the state as a JSON string."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    state = json.dumps(view_state(), separators=(",", ":"))
    return json.dumps({"name": VIEW_NAME, "createdAt": now, "updatedAt": now, "state": state})


def _view_is_current(value: str | None) -> bool:
    try:
        envelope = json.loads(value or "")
        return envelope.get("name") == VIEW_NAME and json.loads(envelope["state"]) == view_state()
    except (ValueError, TypeError, KeyError, AttributeError):
        return False


def experiment_tags(existing: Mapping[str, str] | None = None) -> dict[str, str]:
    """The tags an experiment still needs: the model-training kind unless one is set (a kind the user
    chose stays), the saved view unless it is this version's (an older one is rewritten)."""
    existing = existing or {}
    out: dict[str, str] = {}
    if not existing.get(EXPERIMENT_KIND_TAG):
        out[EXPERIMENT_KIND_TAG] = MODEL_TRAINING
    if not _view_is_current(existing.get(VIEW_TAG)):
        out[VIEW_TAG] = view_tag_value()
    return out


def runs_url(base: str, experiment_id: str) -> str:
    """The experiment's runs in the UI at ``base`` (``http://127.0.0.1:5000``): model-training view,
    the saved view of the invocations open."""
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs"
            f"?workflowType=machine_learning&viewStateShareKey={VIEW_ID}")
