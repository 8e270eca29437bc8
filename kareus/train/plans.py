"""What ``train.plan`` names: Megatron's layout, a plan file, or a planning run's folder.

A run folder gives its ``plan_selected.yaml``, the invocation's MLflow run id (``summary.json``) and the
Megatron reference that plan was composed against (``frontier_iteration.csv``), so a comparison can set
the measured saving beside the predicted one. A plan file inside a run folder finds the same. Nothing
here imports torch: a bad path is refused before any process group starts.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.errors import KareusError

MEGATRON = "megatron"


@dataclass(frozen=True)
class TrainPlan:
    """The plan to run (None: Megatron's own layout) and what came with it."""

    source: str  # the path as resolved, or "megatron"
    plan: Any  # ExecutionPlan | None
    reference: tuple[float, float] | None  # Megatron's predicted (time s, energy J) per iteration
    invocation_run_id: str | None  # the MLflow run that planned it

    def predicted_saving(self) -> tuple[float | None, float | None]:
        """(time, energy) saving the plan predicts against Megatron's layout, fractions; None if unknown."""
        if self.plan is None or self.reference is None:
            return None, None
        t, e = self.reference
        return 1.0 - self.plan.predicted_time_s / t, 1.0 - self.plan.predicted_energy_j / e


def resolve_plan(value: str | None, start_dir: Path) -> TrainPlan:
    """Load what ``train.plan`` names; one clear line (KareusError) for a missing or invalid one."""
    from kareus.plan.io import PlanFormatError, load_plan

    if not value:
        raise KareusError("train.plan: mode=train needs a plan: a plan file, a run directory (its "
                          "plan_selected.yaml) or megatron")
    if value == MEGATRON:
        return TrainPlan(MEGATRON, None, None, None)
    path = Path(value).expanduser()
    path = path if path.is_absolute() else start_dir / path
    if path.is_dir():
        folder, path = path, path / "plan_selected.yaml"
        if not path.is_file():
            raise KareusError(f"train.plan: {folder} holds no plan_selected.yaml (is it a run directory of "
                              "mode=run that selected a plan?)")
    elif not path.is_file():
        raise KareusError(f"train.plan: no such file or directory: {path}")
    try:
        plan = load_plan(path)
    except PlanFormatError as err:
        raise KareusError(f"train.plan: {err}") from None
    folder = path.parent if (path.parent / "summary.json").is_file() else path.parent.parent
    return TrainPlan(str(path), plan, _reference(folder), _run_id(folder))


def _reference(folder: Path) -> tuple[float, float] | None:
    try:
        with open(folder / "frontier_iteration.csv", newline="") as f:
            for row in csv.DictReader(f):
                if row.get("plan") == "megatron_reference":
                    return float(row["time_s"]), float(row["energy_j"])
    except (OSError, KeyError, ValueError):
        return None
    return None


def _run_id(folder: Path) -> str | None:
    try:
        return json.loads((folder / "summary.json").read_text()).get("mlflow_run_id")
    except (OSError, ValueError, AttributeError):
        return None
