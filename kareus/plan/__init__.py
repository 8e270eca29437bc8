"""Execution plans: one per iteration-frontier point, saved as validated YAML, and the selection rules.

Importing this package registers the ``plan`` config schema (``/schema/plan/default``).
"""
from kareus.plan.io import PlanFormatError, load_plan, plan_from_dict, plan_to_dict, save_plan
from kareus.plan.model import (
    SCHEMA_VERSION, ExecutionPlan, InstructionPlan, PartitionSetting, StagePlan, make_plans,
)
from kareus.plan.report import frontier_table, remove_run_outputs, write_run_outputs
from kareus.plan.select import PlanConfig, PlanSelectionError, SelectRule, select_plan
from kareus.plan.simulate import SimulatedIteration, plan_energy, simulate_plan

__all__ = [
    "SCHEMA_VERSION", "ExecutionPlan", "InstructionPlan", "PartitionSetting", "PlanConfig", "PlanFormatError",
    "PlanSelectionError", "SelectRule", "SimulatedIteration", "StagePlan", "frontier_table", "load_plan",
    "make_plans", "plan_energy", "plan_from_dict", "plan_to_dict", "remove_run_outputs", "save_plan",
    "select_plan", "simulate_plan", "write_run_outputs",
]
