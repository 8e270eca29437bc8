"""Puts every config schema into Hydra's ConfigStore, so YAML is typed at composition.

A group option file selects its schema in its defaults list, e.g. ``conf/search/mbo.yaml``::

    defaults:
      - /schema/search/mbo@_here_
      - _self_
    name: mbo

Registered components get ``/schema/<registry group>/<name>`` automatically; other typed sections
(``profiler``, ``model``, ``parallel``) call :func:`register_schema` themselves.
"""
from __future__ import annotations

_EXTRA: dict[tuple[str, str], type] = {}


def register_schema(group: str, name: str, cls: type) -> None:
    """Declare a schema for ``conf/<group>/*.yaml`` files to select as ``/schema/<group>/<name>``."""
    _EXTRA[(group, name)] = cls


def store_all() -> None:
    """Store every known schema (registry components and extra sections) in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    from kareus.registry import ALL

    cs = ConfigStore.instance()
    for registry in ALL:
        for entry in registry:
            if entry.config_cls is not None:
                cs.store(group=f"schema/{registry.group}", name=entry.name, node=entry.config_cls)
    for (group, name), cls in _EXTRA.items():
        cs.store(group=f"schema/{group}", name=name, node=cls)


def plain_schema(group: str) -> type:
    """The schema of a section with one fixed schema (``profiler``, ``plan``, ``tracking``)."""
    try:
        return _EXTRA[(group, "default")]
    except KeyError:
        known = ", ".join(sorted(g for g, _ in _EXTRA))
        raise KeyError(f"no schema registered for section {group!r}; known: {known}") from None
