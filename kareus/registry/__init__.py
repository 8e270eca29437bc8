"""Registries of every swappable component. Components register themselves; this package imports none."""
from __future__ import annotations

from kareus.registry.registry import Entry, Registry, UnknownComponentError, to_dataclass

# One registry per component kind (DESIGN.md). The second argument is the Hydra config group.
WORKLOADS: Registry = Registry("workload source", "workload")
PARTITIONERS: Registry = Registry("partitioner", "partitioner")
HARDWARE: Registry = Registry("hardware backend", "hardware")
COOLDOWNS: Registry = Registry("cooldown policy", "profiler/cooldown")
SEARCHERS: Registry = Registry("searcher", "search")
SURROGATES: Registry = Registry("surrogate", "search/surrogate")
ACQUISITIONS: Registry = Registry("acquisition pass", "search/passes")
COMPOSERS: Registry = Registry("composer", "compose")
SCHEDULES: Registry = Registry("pipeline schedule", "compose/schedule")
FREQUENCY_CONTROLLERS: Registry = Registry("frequency controller", "profiler/frequency")
COMM_BACKENDS: Registry = Registry("comm backend", "runtime/comm")
LAUNCHERS: Registry = Registry("launcher", "launcher")

ALL: tuple[Registry, ...] = (
    WORKLOADS, PARTITIONERS, HARDWARE, COOLDOWNS, SEARCHERS, SURROGATES, ACQUISITIONS,
    COMPOSERS, SCHEDULES, FREQUENCY_CONTROLLERS, COMM_BACKENDS, LAUNCHERS,
)

PLUGIN_GROUP = "kareus.plugins"


def load_plugins() -> list[str]:
    """Import every ``kareus.plugins`` entry point; importing a plugin registers its components."""
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=PLUGIN_GROUP):
        obj = ep.load()
        if callable(obj):
            obj()
        loaded.append(ep.name)
    return loaded


__all__ = [
    "ALL", "ACQUISITIONS", "COMM_BACKENDS", "COMPOSERS", "COOLDOWNS", "Entry", "FREQUENCY_CONTROLLERS",
    "HARDWARE", "LAUNCHERS", "PARTITIONERS", "PLUGIN_GROUP", "Registry", "SCHEDULES", "SEARCHERS",
    "SURROGATES", "UnknownComponentError", "WORKLOADS", "load_plugins", "to_dataclass",
]
