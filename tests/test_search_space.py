"""Search space construction, encoding, budgets and config rules (composition included)."""
from pathlib import Path

import numpy as np
import pytest

from kareus.search.config import (MBOConfig, PassName, SearcherConfig, budget_for, config_problems, initial_size,
                                  pass_shares)
from kareus.search.space import FEATURES, FreqRange, SpaceConfig, build_space, clocks, encode, space_problems
from kareus.search.synthetic import SYNTH_GPU, synthetic_partition
from kareus.types import SEQUENTIAL, Candidate

ROOT = Path(__file__).resolve().parents[1]


def test_default_space_is_slots_x_sms_x_clocks():
    part = synthetic_partition()
    space = build_space(part, SYNTH_GPU, SpaceConfig())
    assert len(space) == 9 * 8 * 10 == 720
    assert {c.slot for c in space} == set(part.slot_labels)
    assert sorted({c.sms for c in space}) == list(range(2, 17, 2))
    fs = sorted({c.freq_mhz for c in space})
    assert fs[-1] == 1410 and fs[0] == 870 and all(SYNTH_GPU.supports_clock(f) for f in fs)


def test_overrides_sms_list_clock_step_and_slots():
    part = synthetic_partition()
    cfg = SpaceConfig(sms=[3, 6, 9], freq_mhz=FreqRange(step=30, min=1200), slots=[SEQUENTIAL, "s4"])
    space = build_space(part, SYNTH_GPU, cfg)
    assert {c.sms for c in space} == {3, 6, 9}
    assert sorted({c.freq_mhz for c in space}) == list(range(1200, 1411, 30))
    assert {c.slot for c in space} == {SEQUENTIAL, "s4"}
    with pytest.raises(ValueError, match="search.space.slots: partition .* has none of nope"):
        build_space(part, SYNTH_GPU, SpaceConfig(slots=["nope"]))


def test_named_slots_narrow_each_partition_to_those_it_has():
    """``slots=[sequential,s4]`` keeps s4 where a partition has it and sequential everywhere; a label
    no partition has is a typo, named with the allowed labels."""
    from dataclasses import replace

    from kareus.search.space import slot_problems

    full = synthetic_partition()
    short = replace(full, key="short", slots=full.slots[:2])  # no s4
    cfg = SpaceConfig(slots=[SEQUENTIAL, "s4"])
    assert {c.slot for c in build_space(short, SYNTH_GPU, cfg)} == {SEQUENTIAL}
    assert slot_problems([full, short], cfg) == []
    [line] = slot_problems([full, short], SpaceConfig(slots=["s4", "bogus"]))
    assert line.startswith("search.space.slots: no partition has bogus; allowed: first, ")


def test_every_partition_a_slot_list_leaves_empty_is_named_in_one_line():
    from dataclasses import replace

    from kareus.search.space import slot_problems

    full = synthetic_partition()
    shorts = [replace(full, key=f"short{i}", slots=full.slots[:2]) for i in range(2)]  # no s4
    [line] = slot_problems([full, *shorts], SpaceConfig(slots=["s4"]))
    assert line.startswith("search.space.slots: 2 partition(s) have none of s4, so nothing to search; ")
    assert "short0 (" in line and "short1 (" in line and f"{full.key} (" not in line
    assert slot_problems([full], SpaceConfig(slots=[])) == [
        "search.space.slots: an empty list keeps no slot; name the slots to keep, or null for all"]


def test_fixed_space_is_only_filtered_by_explicit_fields():
    part = synthetic_partition()
    fixed = [Candidate(part.key, s, n, f) for s in (SEQUENTIAL, "s1") for n in (1, 5, 20) for f in (1200, 1410)]
    assert build_space(part, SYNTH_GPU, SpaceConfig(), fixed=fixed) == sorted(fixed)
    got = build_space(part, SYNTH_GPU, SpaceConfig(sms=[5, 20], freq_mhz=FreqRange(max=1300)), fixed=fixed)
    assert {(c.sms, c.freq_mhz) for c in got} == {(5, 1200), (20, 1200)}
    stepped = build_space(part, SYNTH_GPU, SpaceConfig(sms_step=4, freq_mhz=FreqRange(step=420)), fixed=fixed)
    assert {(c.sms, c.freq_mhz) for c in stepped} == {(1, 1410), (5, 1410)}  # steps from 1 SM and from 1410 MHz


def test_space_problems_name_the_key():
    bad = SpaceConfig(sms=[0, 200], freq_mhz=FreqRange(step=20, min=100))
    msgs = "\n".join(space_problems(bad, SYNTH_GPU))
    assert "search.space.sms" in msgs and "freq_mhz.step: must be" in msgs and "freq_mhz.min: must be" in msgs
    assert space_problems(SpaceConfig(), SYNTH_GPU) == []
    assert clocks(SpaceConfig(freq_mhz=FreqRange(step=30)), SYNTH_GPU)[-1] == 1410


def test_encoding_is_numeric_features_not_indices():
    part = synthetic_partition()
    cands = [Candidate(part.key, SEQUENTIAL, 4, 1410), Candidate(part.key, "s4", 8, 1200)]
    X = encode(part, cands)
    assert X.shape == (2, len(FEATURES))
    assert X[0, :3].tolist() == [1410, 4, 1.0]
    assert X[1, 0] == 1200 and X[1, 1] == 8 and X[1, 2] == 0.0
    assert X[1, 3] == pytest.approx(4 / len(part.compute))
    assert X[1, FEATURES.index("slot_attention")] == 1.0  # op 4 of the synthetic chain is attention


def test_encoding_places_slots_by_the_work_before_and_after_them():
    part = synthetic_partition()
    labels = [s.label for s in part.slots]
    X = encode(part, [Candidate(part.key, s, 4, 1410) for s in labels])
    before = X[:, FEATURES.index("flops_before")]
    overlap = X[:, FEATURES.index("flops_overlap")]
    flops = np.array([op.flops for op in part.compute])
    starts = [s.start for s in part.slots]
    assert before == pytest.approx([flops[:a].sum() / flops.sum() for a in starts])
    assert np.all(np.diff(before) >= 0) and np.all(np.diff(overlap) <= 0)  # later slot: less work left to hide comm
    seq = encode(part, [Candidate(part.key, SEQUENTIAL, 4, 1410)])[0]
    assert seq[FEATURES.index("flops_overlap")] == 0.0 and seq[FEATURES.index("bytes_overlap")] == 0.0


def test_budget_and_initial_size():
    assert budget_for(SearcherConfig(budget_frac=0.15), 720) == 108
    assert budget_for(SearcherConfig(budget=50, budget_frac=0.9), 720) == 50
    assert budget_for(SearcherConfig(budget=5000), 720) == 720
    assert budget_for(SearcherConfig(budget_frac=None), 10) == 10
    assert initial_size(SearcherConfig(), 108) == 27
    assert initial_size(SearcherConfig(), 30) == 7
    assert initial_size(SearcherConfig(), 4) == 4
    assert initial_size(SearcherConfig(), 1000) == 32
    assert initial_size(SearcherConfig(initial=5), 30) == 5


def test_round_batch_keeps_enough_model_updates():
    from kareus.search.config import round_batch

    assert round_batch(SearcherConfig(), 1000) == 32
    assert round_batch(SearcherConfig(), 16) == 4
    assert round_batch(SearcherConfig(min_rounds=1), 16) == 16
    assert round_batch(SearcherConfig(), 1) == 1


def test_pass_shares_fill_the_batch_and_renormalise():
    cfg = MBOConfig()
    assert sum(n for _, n in pass_shares(cfg, 32)) == 32
    cfg2 = MBOConfig(passes=[PassName.total, PassName.dynamic])
    plan = dict(pass_shares(cfg2, 7))
    assert set(plan) == {"total", "dynamic"} and sum(plan.values()) == 7 and plan["total"] >= plan["dynamic"]


def test_default_shares_leave_small_batches_to_the_total_pass():
    """As documented: up to 6 profiles go to total alone; dynamic gets one from 7, static from 17,
    uncertainty from 25."""
    others = {k: [n for name, n in pass_shares(MBOConfig(), k) if name != "total"] for k in (6, 7, 16, 17, 24, 25, 32)}
    assert others == {6: [0, 0, 0], 7: [1, 0, 0], 16: [1, 0, 0], 17: [1, 1, 0], 24: [1, 1, 0], 25: [1, 1, 1],
                      32: [1, 1, 1]}


def test_config_problems():
    msgs = config_problems(MBOConfig(budget=0, budget_frac=1.5, batch_size=0, shares={"total": -1.0, "bogus": 1.0}))
    text = "\n".join(msgs)
    for key in ("search.budget: must be > 0, got 0", "budget_frac: must be in (0, 1], got 1.5", "batch_size: must be > 0",
                "bogus", "must be >= 0"):
        assert key in text
    assert config_problems(MBOConfig()) == []
    assert any("final_local" in m for m in config_problems(MBOConfig(final_local=1.5)))

    class Ctx:
        gpu = SYNTH_GPU

    bad_space = MBOConfig(space=SpaceConfig(freq_mhz=FreqRange(step=7)))
    assert any("freq_mhz.step: must be" in m and m.endswith("got 7") for m in bad_space.problems(Ctx()))


@pytest.fixture()
def compose(tmp_path):
    """Compose conf/search/*.yaml under a minimal primary config with the stored schemas."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import kareus.search  # noqa: F401  (registers the searchers)
    from kareus.config.store import store_all

    store_all()
    (tmp_path / "search").symlink_to(ROOT / "conf" / "search")
    (tmp_path / "config.yaml").write_text("defaults:\n  - search: mbo\n  - _self_\nseed: 3\n")

    def run(overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(tmp_path), version_base="1.3"):
            return hcompose("config", overrides=overrides)

    yield run
    GlobalHydra.instance().clear()


def test_yaml_ablation_override_composes(compose):
    from kareus.registry import SEARCHERS, to_dataclass

    from omegaconf import OmegaConf

    cfg = compose(["search.passes=[total,dynamic]", "search.space.sms=[3,6,9]", "search.space.freq_mhz.step=30"])
    OmegaConf.resolve(cfg)  # search.seed follows the run's seed (an interpolation to the root)
    typed = to_dataclass(SEARCHERS.get("mbo").config_cls, cfg.search)
    assert typed.passes == [PassName.total, PassName.dynamic]
    assert typed.space.sms == [3, 6, 9] and typed.space.freq_mhz.step == 30
    for name in ("exhaustive", "random", "nsga2", "tpe", "artifact", "qnehvi"):
        full = compose([f"search={name}"])
        OmegaConf.resolve(full)
        sec = full.search
        assert sec.name == name
        to_dataclass(SEARCHERS.get(name).config_cls, sec)


@pytest.mark.parametrize("passes", [["coverage"], ["local"], ["local", "coverage"]])
def test_passes_that_pick_only_some_candidates_need_a_regular_pass_beside_them(passes):
    lines = config_problems(MBOConfig(passes=[PassName(p) for p in passes]))
    assert lines == [f"search.passes: {passes} run dry before the budget is spent; "
                     "add one of: total, dynamic, static, uncertainty, fastest, spread"]
    assert config_problems(MBOConfig(passes=[PassName(p) for p in (*passes, "total")])) == []


def test_yaml_bad_pass_fails_at_composition(compose):
    with pytest.raises(Exception, match="dynamc"):
        compose(["search.passes=[total,dynamc]"])


def test_a_clock_fraction_on_a_recorded_table_is_refused_not_ignored():
    """The default fraction never thins a table, so a value set for one was ignored in silence."""
    assert space_problems(SpaceConfig(), SYNTH_GPU, recorded=True) == []
    assert space_problems(SpaceConfig(freq_mhz=FreqRange(min_frac=0.9)), SYNTH_GPU, recorded=True) == [
        "search.space.freq_mhz.min_frac: a replayed table's clocks are thinned by explicit bounds only; set "
        "search.space.freq_mhz.min (MHz) instead, got min_frac=0.9"]
    assert space_problems(SpaceConfig(freq_mhz=FreqRange(min_frac=0.9)), SYNTH_GPU) == []
