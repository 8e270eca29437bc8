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
