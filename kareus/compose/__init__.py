"""Composition: partition frontiers -> instruction options -> iteration frontier over the pipeline DAG.

Importing this package registers the schedules (``1f1b``) and the composers (``kareus``, ``perseus``).
"""
from kareus.compose.iteration import (
    Assignment, CostModel, IterationFrontier, critical_path, fixed_option_frontier, fixed_option_iteration,
)
from kareus.compose.lp import KareusComposer, KareusComposerConfig
from kareus.compose.microbatch import InstructionOption, compose_instruction, minkowski_pareto
from kareus.compose.perseus import PerseusComposer, PerseusComposerConfig
from kareus.compose.schedule import Instr, PipelineDAG, Synchronous1F1B, pipeline_dag

__all__ = [
    "Assignment", "CostModel", "Instr", "InstructionOption", "IterationFrontier", "KareusComposer",
    "KareusComposerConfig", "PerseusComposer", "PerseusComposerConfig", "PipelineDAG", "Synchronous1F1B",
    "compose_instruction", "critical_path", "fixed_option_frontier", "fixed_option_iteration", "minkowski_pareto",
    "pipeline_dag",
]
