"""Choosing one plan from the frontier: maximum throughput, minimum energy, a deadline or an energy budget."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Sequence

from kareus.config.store import register_schema
from kareus.plan.model import ExecutionPlan

_TOL = 1e-9


class SelectRule(str, Enum):
    max_throughput = "max_throughput"
    min_energy = "min_energy"


@dataclass
class PlanConfig:
    """``plan.select`` picks an end of the frontier; ``deadline_s`` / ``energy_budget_j`` override it."""

    select: SelectRule = SelectRule.max_throughput
    deadline_s: Optional[float] = None  # least energy among plans no slower than this
    energy_budget_j: Optional[float] = None  # fastest among plans using no more than this

    def problems(self, ctx: Any = None) -> list[str]:
        out = []
        if self.deadline_s is not None and self.energy_budget_j is not None:
            out.append("plan.deadline_s and plan.energy_budget_j are exclusive: set at most one")
        if self.deadline_s is not None and not self.deadline_s > 0:
            out.append(f"plan.deadline_s must be positive seconds (got {self.deadline_s})")
        if self.energy_budget_j is not None and not self.energy_budget_j > 0:
            out.append(f"plan.energy_budget_j must be positive joules (got {self.energy_budget_j})")
        return out


register_schema("plan", "default", PlanConfig)


class PlanSelectionError(ValueError):
    """No plan satisfies the request; the message says how far off the nearest plan is."""


def select_plan(plans: Sequence[ExecutionPlan], cfg: PlanConfig | None = None) -> ExecutionPlan:
    cfg = cfg or PlanConfig()
    if not plans:
        raise PlanSelectionError("no execution plans to select from (the iteration frontier is empty)")
    problems = cfg.problems()
    if problems:
        raise PlanSelectionError("; ".join(problems))
    if cfg.deadline_s is not None:
        ok = [p for p in plans if p.predicted_time_s <= cfg.deadline_s * (1 + _TOL)]
        if not ok:
            best = min(plans, key=lambda p: p.predicted_time_s)
            gap = best.predicted_time_s - cfg.deadline_s
            raise PlanSelectionError(
                f"no plan meets plan.deadline_s={cfg.deadline_s:.6g} s: the fastest plan takes "
                f"{best.predicted_time_s:.6g} s per iteration, {gap:.4g} s ({100 * gap / cfg.deadline_s:.2f}%) over")
        return min(ok, key=lambda p: (p.predicted_energy_j, p.predicted_time_s))
    if cfg.energy_budget_j is not None:
        ok = [p for p in plans if p.predicted_energy_j <= cfg.energy_budget_j * (1 + _TOL)]
        if not ok:
            best = min(plans, key=lambda p: p.predicted_energy_j)
            gap = best.predicted_energy_j - cfg.energy_budget_j
            raise PlanSelectionError(
                f"no plan fits plan.energy_budget_j={cfg.energy_budget_j:.6g} J: the least-energy plan uses "
                f"{best.predicted_energy_j:.6g} J per iteration, {gap:.4g} J "
                f"({100 * gap / cfg.energy_budget_j:.2f}%) over")
        return min(ok, key=lambda p: (p.predicted_time_s, p.predicted_energy_j))
    if SelectRule(cfg.select) is SelectRule.min_energy:
        return min(plans, key=lambda p: (p.predicted_energy_j, p.predicted_time_s))
    return min(plans, key=lambda p: (p.predicted_time_s, p.predicted_energy_j))
