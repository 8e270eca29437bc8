"""Imports every planner component package so that each registers itself (no torch, no mlflow)."""
from __future__ import annotations

import importlib

PLANNER_PACKAGES = (
    "kareus.partition", "kareus.hardware", "kareus.search", "kareus.profiler", "kareus.launch",
    "kareus.compose", "kareus.plan", "kareus.tracking",
    "kareus.runtime",  # registers the cuda backend and comm backends; imports torch only when used
)


def register_all() -> None:
    """Register built-in components and third-party plugins, then store all schemas for Hydra."""
    from hydra.core.config_store import ConfigStore

    from kareus.config.schema import KareusConfig
    from kareus.config.store import store_all
    from kareus.registry import load_plugins

    for name in PLANNER_PACKAGES:
        importlib.import_module(name)
    load_plugins()
    store_all()
    ConfigStore.instance().store(name="kareus_schema", node=KareusConfig)
