"""The pipeline's own backend: built once per run and closed on the way out, also when the run fails."""
from __future__ import annotations

import pytest

import kareus.pipeline.searching as searching
from conftest import compose_config
from kareus.config.validate import validate
from kareus.errors import KareusError
from kareus.pipeline import run_mode


@pytest.fixture
def closes(monkeypatch):
    """Wrap every backend the pipeline builds so that its close() calls are counted."""
    closed: list[str] = []
    build = searching.make_backend

    def counted(ctx, seed=None):
        backend = build(ctx, seed)
        backend.close = lambda: closed.append(backend.name)
        return backend

    monkeypatch.setattr(searching, "make_backend", counted)
    return closed


def test_describe_closes_its_backend(tmp_path, closes):
    cfg = compose_config("+model=tiny", "parallel=pp2_tp2", "mode=describe")
    run_mode(cfg, validate(cfg), tmp_path)
    assert len(closes) == 1


def test_a_refused_run_still_closes_its_backend(tmp_path, closes):
    cfg = compose_config("+model=tiny", "parallel=pp2_tp2", "mode=search", "search.space.slots=[bogus]",
                         "tracking.enabled=false")
    with pytest.raises(KareusError, match="search.space.slots"):
        run_mode(cfg, validate(cfg), tmp_path)
    assert len(closes) == 1
