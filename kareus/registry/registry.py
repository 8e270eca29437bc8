"""A small, explicit registry: components are chosen by short names from YAML, never by import path."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownComponentError(KeyError):
    """Raised for a name nobody registered; the message lists the known names."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want a plain sentence.
        return str(self.args[0])


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered component: its name, its typed config class and the factory that builds it."""

    kind: str
    name: str
    config_cls: type | None
    factory: Callable[..., T]
    description: str = ""


class Registry(Generic[T]):
    """Maps short names to (config class, factory) for one component kind."""

    def __init__(self, kind: str, group: str | None = None) -> None:
        self.kind = kind
        self.group = group or kind  # the Hydra config group whose options select from this registry
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self, name: str, config_cls: type | None = None, description: str = ""
    ) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: ``@SEARCHERS.register("mbo", MBOConfig)`` on a class or factory function."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            self.add(name, factory, config_cls, description or (factory.__doc__ or "").strip().split("\n")[0])
            return factory

        return deco

    def add(self, name: str, factory: Callable[..., T], config_cls: type | None = None, description: str = "") -> None:
        if name in self._entries and self._entries[name].factory is not factory:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if config_cls is not None and not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"{self.kind} {name!r}: config class must be a dataclass")
        self._entries[name] = Entry(self.kind, name, config_cls, factory, description)

    def get(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownComponentError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def build(self, name: str, *args: Any, config: Any = None, **kwargs: Any) -> T:
        """Build the component; ``config`` (a dict, DictConfig or dataclass) is typed through its schema."""
        entry = self.get(name)
        if entry.config_cls is None:
            return entry.factory(*args, **kwargs)
        return entry.factory(self.build_config(name, config), *args, **kwargs)

    def build_config(self, name: str, config: Any = None) -> Any:
        """The component's typed config dataclass for ``config`` (validated, defaults filled)."""
        entry = self.get(name)
        if entry.config_cls is None:
            raise TypeError(f"{self.kind} {name!r} takes no config")
        return to_dataclass(entry.config_cls, config)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self._entries[n] for n in self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def to_dataclass(cls: type, config: Any) -> Any:
    """Turn a dict / DictConfig / dataclass into ``cls`` with OmegaConf's type checks (lazy import)."""
    if isinstance(config, cls):
        return config
    from omegaconf import OmegaConf

    from omegaconf import DictConfig

    base = OmegaConf.structured(cls)
    if config is not None:
        if dataclasses.is_dataclass(config):
            config = OmegaConf.structured(config)
        elif isinstance(config, DictConfig):  # a section of the run's config: ``${parallel.pp}`` resolves
            config = OmegaConf.to_container(config, resolve=True)  # against the whole tree, not the copy
        base = OmegaConf.merge(base, config)
    return OmegaConf.to_object(base)
