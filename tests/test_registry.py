from dataclasses import dataclass

import pytest

from kareus.registry import ALL, Registry, UnknownComponentError


@dataclass
class FooConfig:
    name: str = "foo"
    size: int = 3


def make_registry() -> Registry:
    reg = Registry("widget", "widget")

    @reg.register("foo", FooConfig)
    def build_foo(cfg: FooConfig, scale: int = 1) -> int:
        """Foo widgets."""
        return cfg.size * scale

    return reg


def test_build_types_the_config_and_passes_arguments():
    reg = make_registry()
    assert reg.build("foo", 2, config={"size": 5}) == 10
    assert reg.build("foo", config=None) == 3  # defaults fill in


def test_unknown_name_lists_known_names():
    reg = make_registry()
    reg.add("bar", lambda: 1)
    with pytest.raises(UnknownComponentError) as err:
        reg.get("baz")
    assert str(err.value) == "unknown widget 'baz'; known: bar, foo"


def test_config_typo_and_wrong_type_fail():
    reg = make_registry()
    with pytest.raises(Exception, match="sise"):
        reg.build_config("foo", {"sise": 4})
    with pytest.raises(Exception, match="size"):
        reg.build_config("foo", {"size": "many"})


def test_double_registration_is_refused():
    reg = make_registry()
    with pytest.raises(ValueError, match="already registered"):
        reg.add("foo", lambda cfg: 0, FooConfig)


def test_config_class_must_be_a_dataclass():
    reg = Registry("widget")
    with pytest.raises(TypeError):
        reg.add("x", lambda c: c, dict)


def test_every_kind_in_the_design_has_a_registry():
    kinds = {r.kind for r in ALL}
    for kind in ("workload source", "partitioner", "hardware backend", "cooldown policy", "searcher",
                 "surrogate", "acquisition pass", "composer", "frequency controller", "comm backend", "launcher"):
        assert kind in kinds


def test_plugins_load_through_entry_points(monkeypatch):
    import kareus.registry as registry_mod

    calls = []

    class FakeEP:
        name = "myplugin"

        def load(self):
            return lambda: calls.append("registered")

    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [FakeEP()] if group == "kareus.plugins" else [])
    assert registry_mod.load_plugins() == ["myplugin"]
    assert calls == ["registered"]


def test_a_config_section_that_interpolates_another_becomes_its_dataclass():
    """``parallel.tp=${parallel.pp}`` passed validation (which resolves the whole tree) and then crashed
    building the run: the section was merged away from the tree its interpolation points into."""
    from omegaconf import OmegaConf

    from kareus.config.schema import ParallelConfig
    from kareus.registry import to_dataclass

    cfg = OmegaConf.create({"parallel": {"pp": 2, "tp": "${parallel.pp}"}, "width": 4})
    parallel = to_dataclass(ParallelConfig, cfg.parallel)
    assert (parallel.pp, parallel.tp) == (2, 2)
