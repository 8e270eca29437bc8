"""Composition with Hydra: the documented call, every shipped option, user models, and what must fail early."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from conftest import compose_config
from kareus.config.schema import ModelConfig, ParallelConfig, Recompute
from kareus.config.validate import validate

MISSION = ("+model=qwen1.7b", "parallel=pp2_tp8", "search=mbo")

# Issue facts: (layers, hidden, ffn, heads, kv heads, head dim, vocab, tied embeddings, qk-layernorm)
MODELS = {
    "qwen1.7b": (28, 2048, 6144, 16, 8, 128, 151936, True, True),
    "llama3.2-3b": (28, 3072, 8192, 24, 8, 128, 128256, False, False),
    "llama3.3-70b": (80, 8192, 28672, 64, 8, 128, 128256, False, False),
}
# Each shipped layout with a model it is meant for; together they cover every model and layout.
PAIRS = [("qwen1.7b", "pp2_tp8"), ("llama3.2-3b", "pp2_cp2_tp4"), ("llama3.3-70b", "pp10_tp8"),
         ("tiny", "pp2_tp2"), ("tiny", "pp1_tp2")]
# the GPU a pair is meant for, where the default A100-40GB cannot hold it (70B: 47 GB on its first stage)
HARDWARE = {("llama3.3-70b", "pp10_tp8"): "h100_sim"}


def group_options(group: str) -> list[str]:
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(version_base="1.3", config_module="kareus.conf"):
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def fails_to_compose(error_text, *overrides: str) -> str:
    """Compose, expect a Hydra error, return its full text (the cause names the key)."""
    with pytest.raises(HydraException) as info:
        compose_config(*overrides)
    return error_text(info.value)


def test_mission_overrides_compose_typed():
    cfg = compose_config(*MISSION)
    assert OmegaConf.get_type(cfg.model) is ModelConfig and cfg.model.name == "qwen1.7b"
    assert OmegaConf.get_type(cfg.parallel) is ParallelConfig
    assert (cfg.parallel.pp, cfg.parallel.tp) == (2, 8)
    from kareus.search.config import MBOConfig

    assert OmegaConf.get_type(cfg.search) is MBOConfig
    for section in ("hardware", "partitioner", "profiler", "compose", "launcher", "plan", "tracking"):
        assert OmegaConf.get_type(cfg[section]) not in (None, dict), f"{section} is not typed by a schema"
    validate(cfg)


def test_model_is_not_in_the_defaults():
    assert compose_config("parallel=pp2_tp8").model is None


def test_model_without_plus_points_to_plus_model(error_text):
    text = fails_to_compose(error_text, "model=qwen1.7b")
    assert "+model=qwen1.7b" in text


def test_required_models_and_layouts_are_shipped():
    assert {"qwen1.7b", "llama3.2-3b", "llama3.3-70b", "tiny"} <= set(group_options("model"))
    assert {"pp2_tp8", "pp2_cp2_tp4", "pp10_tp8"} <= set(group_options("parallel"))


@pytest.mark.parametrize("model,parallel", PAIRS)
def test_shipped_pair_composes_and_validates(model, parallel):
    cfg = compose_config(f"+model={model}", f"parallel={parallel}", f"hardware={HARDWARE.get((model, parallel), 'a100_sim')}")
    assert cfg.model.name == model
    validate(cfg)
    m = cfg.model
    if model in MODELS:
        assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_kv_heads,
                m.head_dim, m.vocab_size, m.tied_embeddings, m.qk_layernorm) == MODELS[model]
    p = cfg.parallel
    if parallel in ("pp2_tp8", "pp2_cp2_tp4"):  # the published layouts
        assert p.micro_batch_size in (8, 16) and p.seq_len in (4096, 8192)
        assert (p.num_microbatches, p.nanobatches, p.recompute) == (8, 2, Recompute.full)
        assert (p.pp, p.tp, p.cp) == ((2, 8, 1) if parallel == "pp2_tp8" else (2, 4, 2))
    if parallel == "pp10_tp8":
        assert (p.pp, p.tp) == (10, 8) and 16 <= p.num_microbatches <= 128


def test_every_other_option_composes():
    """Options added later than PAIRS still compose (with a model / layout of the pairs)."""
    covered_models, covered_layouts = {m for m, _ in PAIRS}, {p for _, p in PAIRS}
    for model in sorted(set(group_options("model")) - covered_models):
        assert compose_config(f"+model={model}", "parallel=pp2_tp8").model.name == model
    for layout in sorted(set(group_options("parallel")) - covered_layouts):
        assert compose_config("+model=qwen1.7b", f"parallel={layout}").parallel.tp >= 1


# ------------------------------------------------------------------------ failing at composition


@pytest.mark.parametrize("override,key", [
    ("parallel.ttp=2", "parallel.ttp"),
    ("search.pases=[total]", "search.pases"),
    ("hardware.smss=100", "hardware.smss"),
    ("profiler.cooldown.secs=3", "profiler.cooldown.secs"),
])
def test_typo_fails_naming_the_key(error_text, override, key):
    text = fails_to_compose(error_text, *MISSION, override)
    assert key in text
    assert "not in" in text or "Could not override" in text


def test_wrong_type_fails_naming_the_key(error_text):
    text = fails_to_compose(error_text, *MISSION, "parallel.tp=two")
    assert "parallel.tp" in text and "'two'" in text and "Integer" in text


@pytest.mark.parametrize("override,key,allowed", [
    ("search.passes=[bogus]", "search.passes", "[total, dynamic, static, uncertainty, fastest, spread, local, coverage]"),
    ("parallel.recompute=half", "parallel.recompute", "[full, none]"),
    ("search.surrogate.basis=cubic", "search.surrogate.basis", "[main, interactions, auto]"),
])
def test_bad_enum_value_fails_listing_allowed_values(error_text, override, key, allowed):
    text = fails_to_compose(error_text, *MISSION, override)
    assert key in text and f"expected one of {allowed}" in text


def test_unknown_group_option_fails(error_text):
    text = fails_to_compose(error_text, "+model=qwen1.7b", "parallel=pp3_tp9")
    assert "parallel" in text and "pp2_tp8" in text  # Hydra lists the available options


# ------------------------------------------------------------------------------------ user models


def _user_dir(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    (tmp_path / "model" / f"{name}.yaml").write_text(text)
    return f"hydra.searchpath=[file://{tmp_path}]"


USER_MODEL = """\
name: my_model
num_layers: 12
hidden_size: 1024
ffn_hidden_size: 4096
num_attention_heads: 16
num_kv_heads: 4
head_dim: 64
vocab_size: 50000
"""


def test_user_model_from_an_extra_config_dir(tmp_path):
    sp = _user_dir(tmp_path, "my_model", USER_MODEL)
    cfg = compose_config(sp, "+model=my_model", "parallel=pp2_tp2")
    assert OmegaConf.get_type(cfg.model) is ModelConfig
    assert (cfg.model.name, cfg.model.num_layers, cfg.model.tied_embeddings) == ("my_model", 12, False)
    validate(cfg)


def test_user_model_via_initialize_config_dir(tmp_path):
    """A config dir of one's own that builds on the packaged config (what --config-dir gives)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _user_dir(tmp_path, "my_model", USER_MODEL)
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(tmp_path)):
        cfg = compose("mine", overrides=["hydra.searchpath=[pkg://kareus.conf]", "+model=my_model",
                                         "parallel=pp2_tp2"])
    assert OmegaConf.get_type(cfg.model) is ModelConfig and cfg.model.num_kv_heads == 4
    validate(cfg)


def test_user_model_typo_fails_at_composition(error_text, tmp_path):
    sp = _user_dir(tmp_path, "typo", USER_MODEL.replace("num_layers", "num_layer").replace("my_model", "typo"))
    text = fails_to_compose(error_text, sp, "+model=typo")
    assert "model.num_layer" in text


def test_search_seed_follows_the_run_seed_unless_set():
    base = ("+model=tiny", "parallel=pp2_tp2")
    assert validate(compose_config(*base, "seed=5"))["search"].seed == 5
    assert validate(compose_config(*base, "seed=5", "search.seed=3"))["search"].seed == 3
