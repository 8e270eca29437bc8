"""The compose and plan YAML options compose through their dataclass schemas and build components."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import kareus.compose  # noqa: F401  (registers composers and schedules)
import kareus.plan  # noqa: F401  (registers the plan schema)
from kareus.config.store import store_all
from kareus.plan import PlanConfig, SelectRule
from kareus.registry import COMPOSERS, to_dataclass

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.fixture(scope="module", autouse=True)
def _schemas():
    store_all()


@pytest.mark.parametrize("name", ["kareus", "perseus"])
def test_compose_options_build_their_composer(name):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name=f"compose/{name}")
    composer = COMPOSERS.build(cfg.compose.name, config=cfg.compose)
    assert composer.name == name
    assert composer.config.problems() == []


def test_typos_and_bad_values_fail_at_composition():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        with pytest.raises(Exception, match="num_deadline"):
            compose(config_name="compose/kareus", overrides=["compose.num_deadline=3"])
        with pytest.raises(Exception, match="select"):
            compose(config_name="plan/default", overrides=["plan.select=cheapest"])


def test_plan_default_and_overrides():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="plan/default", overrides=["plan.deadline_s=2.5"])
    plan = to_dataclass(PlanConfig, cfg.plan)
    assert plan.select is SelectRule.max_throughput and plan.deadline_s == 2.5 and plan.energy_budget_j is None
    assert OmegaConf.to_container(cfg.plan)["select"] == "max_throughput"
