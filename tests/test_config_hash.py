"""The journal's config hash: what changes measurements changes it; what only prices plans does not."""
from conftest import compose_config
from kareus.config.hashing import config_hash


def test_a_clock_switch_price_is_not_part_of_the_journal_hash():
    """hardware.clock_switch_s prices plans at composition, so a resume may change it; a value that
    changes measurements (the static power every energy reading splits by) still may not."""
    base = config_hash(compose_config("+model=tiny", "parallel=pp2_tp2"))
    assert config_hash(compose_config("+model=tiny", "parallel=pp2_tp2", "hardware.clock_switch_s=0.002")) == base
    assert config_hash(compose_config("+model=tiny", "parallel=pp2_tp2", "hardware.static_power_w=90")) != base
    assert config_hash(compose_config("+model=tiny", "parallel=pp2_tp2", "plan.deadline_s=1")) == base


def test_the_microbatch_count_and_schedule_are_not_part_of_the_journal_hash():
    """They decide how the partitions' frontiers compose into an iteration, not what a partition
    measures, so a resume may re-compose the same measurements for another count; the shape of a
    microbatch (its size, the nanobatches it splits into) still changes what is measured."""
    base = config_hash(compose_config("+model=tiny", "parallel=pp2_tp2"))
    for same in ("parallel.num_microbatches=16", "parallel.schedule=1f1b"):
        assert config_hash(compose_config("+model=tiny", "parallel=pp2_tp2", same)) == base, same
    for other in ("parallel.micro_batch_size=2", "parallel.nanobatches=1", "parallel.seq_len=1024"):
        assert config_hash(compose_config("+model=tiny", "parallel=pp2_tp2", other)) != base, other


def test_measured_differences_name_what_a_resume_changed_and_nothing_else():
    from kareus.config.hashing import measured_differences

    old = {"search": {"budget_frac": 0.15, "seed": 0}, "hardware": {"clock_switch_s": 0.0, "sms": 108},
           "tracking": {"experiment": "a"}, "seed": 0}
    new = {"search": {"budget_frac": 0.3, "seed": 0}, "hardware": {"clock_switch_s": 0.002, "sms": 108},
           "tracking": {"experiment": "b"}, "seed": 1, "model": {"name": "tiny"}}
    assert measured_differences(old, new) == ["model.name (- -> tiny)", "search.budget_frac (0.15 -> 0.3)",
                                              "seed (0 -> 1)"]
    assert measured_differences(old, old) == []
    # another searcher changes many keys: its name comes first, before the keys it brings along
    other = {**old, "search": {"name": "random", "budget_frac": 0.15, "seed": 0, "batch_size": 8}}
    assert measured_differences({**old, "search": {**old["search"], "name": "mbo"}}, other)[0] == \
        "search.name (mbo -> random)"
