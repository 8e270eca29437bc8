"""Shared fixtures: compose Kareus' config through Hydra exactly as the CLI does, cached per override set."""
from __future__ import annotations

import copy
import functools
from typing import Callable

import pytest


def _full_message(exc: BaseException) -> str:
    """The exception's text with its causes: Hydra puts the offending key in the cause."""
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def _registered() -> bool:
    from kareus.components import register_all

    register_all()
    return True


@functools.lru_cache(maxsize=None)
def _compose_cached(overrides: tuple[str, ...]):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    _registered()
    GlobalHydra.instance().clear()
    with initialize_config_module(version_base="1.3", config_module="kareus.conf"):
        return compose("config", overrides=list(overrides))


def compose_config(*overrides: str):
    """A fresh copy of the composed config (composition errors propagate unchanged)."""
    return copy.deepcopy(_compose_cached(tuple(overrides)))


@pytest.fixture
def compose() -> Callable[..., object]:
    """``compose("+model=qwen1.7b", "parallel.tp=4")`` -> DictConfig, as ``python -m kareus`` builds it."""
    return compose_config


@pytest.fixture
def error_text() -> Callable[[BaseException], str]:
    """The full text of a composition error, causes included."""
    return _full_message


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt for the test, as in an interactive shell: a runner that starts
    the suite with SIGINT ignored (a backgrounded job, ``nohup cmd &``) would otherwise swallow the
    Ctrl-C a test sends itself."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
