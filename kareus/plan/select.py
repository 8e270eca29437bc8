"""Choosing one plan from the frontier: maximum throughput, minimum energy, a deadline or an energy budget."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Sequence

from kareus.config.store import register_schema
from kareus.frontier import within_limit
from kareus.plan.cost import CarbonConfig, PriceConfig, ProfileError, cost_problems, plan_cost
from kareus.plan.model import ExecutionPlan


class SelectRule(str, Enum):
    max_throughput = "max_throughput"
    min_energy = "min_energy"
    cost = "cost"  # least money (energy, GPU time and priced carbon: plan.price, plan.carbon) per iteration or job


@dataclass
class PlanConfig:
    """``plan.select`` picks an end of the frontier; ``deadline_s`` / ``energy_budget_j`` override it."""

    select: SelectRule = SelectRule.max_throughput
    deadline_s: Optional[float] = None  # least energy among plans no slower than this
    energy_budget_j: Optional[float] = None  # fastest among plans using no more than this
    # measure Megatron's own layout at every clock of the search space too: the Megatron + Perseus frontier each
    # plan is compared with at equal time, and one more option of every instruction (no plan trails
    # it); false: Megatron's layout at the top clock alone (the reference point; fewer profiles)
    compare_perseus: bool = True
    # Megatron's own layout is one more option of every instruction (where splitting a microbatch costs
    # more than overlap saves, plans keep it); false: every instruction runs Kareus' partitions (an
    # ablation, and plans whose overlap mode=train executes and measures)
    megatron_layout: bool = True
    # what a plan costs (kareus.plan.cost): priced with plan.select=cost, reported for the selected plan
    price: PriceConfig = field(default_factory=PriceConfig)
    carbon: CarbonConfig = field(default_factory=CarbonConfig)
    iterations: Optional[int] = None  # the job's iterations: its cost over the job (None: per iteration)
    start: Optional[str] = None  # the job's start (ISO 8601), needed with an hourly profile

    def problems(self, ctx: Any = None) -> list[str]:
        out = cost_problems(self)
        if self.deadline_s is not None and self.energy_budget_j is not None:
            out.append("plan.deadline_s and plan.energy_budget_j are exclusive: set at most one")
        # inf is no deadline or budget: leave it unset (plan.select picks the plan then)
        if self.deadline_s is not None and not 0 < self.deadline_s < math.inf:
            out.append(f"plan.deadline_s: must be positive seconds, got {self.deadline_s}")
        if self.energy_budget_j is not None and not 0 < self.energy_budget_j < math.inf:
            out.append(f"plan.energy_budget_j: must be positive joules, got {self.energy_budget_j}")
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
        return _within(plans, "predicted_time_s", "predicted_energy_j", cfg.deadline_s,
                       "no plan meets plan.deadline_s={limit} s: the fastest plan takes", "s")
    if cfg.energy_budget_j is not None:
        return _within(plans, "predicted_energy_j", "predicted_time_s", cfg.energy_budget_j,
                       "no plan fits plan.energy_budget_j={limit} J: the least-energy plan uses",
                       "J")
    if SelectRule(cfg.select) is SelectRule.cost:
        try:  # one plan for the whole job: the runtime cannot switch plans between iterations
            return min(plans, key=lambda p: (plan_cost(p.predicted_time_s, p.predicted_energy_j,
                                                       p.num_stages * p.gpus_per_stage, cfg).total, p.predicted_time_s))
        except ProfileError as err:  # a profile that does not cover some plan's span of the job
            raise PlanSelectionError(str(err)) from None
    if SelectRule(cfg.select) is SelectRule.min_energy:
        return min(plans, key=lambda p: (p.predicted_energy_j, p.predicted_time_s))
    return min(plans, key=lambda p: (p.predicted_time_s, p.predicted_energy_j))


def _within(plans: Sequence[ExecutionPlan], limited: str, minimised: str, limit: float, refusal: str,
            unit: str) -> ExecutionPlan:
    """Minimise ``minimised`` among plans whose ``limited`` is within ``limit``; or say how far off it is
    (``refusal`` names the limit as ``{limit}``)."""
    ok = [p for p in plans if within_limit(getattr(p, limited), limit)]
    if not ok:
        from kareus.plan.report import exact

        nearest = getattr(min(plans, key=lambda p: getattr(p, limited)), limited)
        gap = nearest - limit
        pct = 100 * gap / limit
        # a limit copied from a rounded table can miss by far less than 0.01%: then every digit of both,
        # or the limit would read as rounded past the plan that misses it
        if pct >= 0.01:
            shown, value, share = f"{limit:.6g}", f"{nearest:.6g}", f"{pct:.2f}"
        else:
            shown, value, share = exact(limit), exact(nearest), f"{pct:.2g}"
        raise PlanSelectionError(f"{refusal.format(limit=shown)} {value} {unit} per iteration, "
                                 f"{gap:.4g} {unit} ({share}%) over")
    return min(ok, key=lambda p: (getattr(p, minimised), getattr(p, limited)))
