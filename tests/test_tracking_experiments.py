"""The ablation bundles in conf/experiment compose with the project config and set what they claim."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from kareus.components import register_all


@pytest.fixture(scope="module")
def composer():
    register_all()
    with initialize_config_module(version_base="1.3", config_module="kareus.conf"):
        yield lambda *overrides: compose("config", overrides=["+model=tiny", *overrides])


def test_full_changes_nothing(composer):
    assert OmegaConf.to_container(composer("+experiment=full"), resolve=True) == \
        OmegaConf.to_container(composer(), resolve=True)


def test_no_clock_search_pins_the_top_clock(composer):
    for hardware in ("a100_sim", "h100_sim"):
        cfg = composer("+experiment=no_clock_search", f"hardware={hardware}")
        fr = cfg.search.space.freq_mhz
        assert fr.min == fr.max == cfg.hardware.max_mhz


def test_no_kernel_scheduling_uses_the_sequential_partitioner(composer):
    assert composer("+experiment=no_kernel_scheduling").partitioner.name == "sequential"


def test_plain_nanobatching_fixes_slot_and_sms(composer):
    space = composer("+experiment=plain_nanobatching").search.space
    assert list(space.slots) == ["first"] and list(space.sms) == [16]


@pytest.mark.parametrize("name,passes", [("passes_total", ["total"]), ("passes_total_dynamic", ["total", "dynamic"])])
def test_passes_ablations(composer, name, passes):
    cfg = composer(f"+experiment={name}")
    assert [p.value if hasattr(p, "value") else p for p in cfg.search.passes] == passes


def test_tracking_defaults_compose(composer):
    t = composer().tracking
    assert t.uri == "sqlite:///runs/mlflow.db" and t.experiment == "kareus" and t.telemetry is False
    with pytest.raises(Exception):
        composer("tracking.enabld=false")  # typos fail at composition


def test_nanobatch_perseus_is_plain_nanobatching_planned_by_perseus(composer):
    cfg = composer("+experiment=nanobatch_perseus")
    assert list(cfg.search.space.slots) == ["first"] and list(cfg.search.space.sms) == [16]
    assert cfg.search.name == "exhaustive" and cfg.compose.name == "perseus"
    assert cfg.plan.megatron_layout is False  # no fallback to Megatron's layout: N+P as the baseline runs
