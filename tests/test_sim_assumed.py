"""The simulator's assumed parameters: one statement of their ranges (kareus/hardware/assumed.py) that the
YAML comments repeat, the draws made from it (held-out workloads, paper.py's sensitivity study), the fit
those draws are refitted with, and the real table's repeat spread the docs quote."""
import json
import math
import random
import re
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kareus.hardware import assumed  # noqa: E402
from kareus.hardware.tables import repeat_spread  # noqa: E402

SIMS = sorted(assumed.HARDWARE_DIR.glob("*_sim.yaml"))
REAL = Path(__file__).resolve().parents[2] / "shared/data/a100_attention_tp2"


def shipped(path: Path) -> dict:
    """The config's values as Hydra reads them (PyYAML would read 6.7e7 as a string)."""
    data = OmegaConf.to_container(OmegaConf.load(path))
    data.pop("defaults", None)
    return data


def comments(path: Path) -> dict[str, str]:
    """Key -> comment of every commented top-level key line."""
    return {m.group(1): m.group(2) for m in (re.match(r"^(\w+):[^#]*#\s*(.*)$", line)
                                             for line in path.read_text().splitlines()) if m}


def test_the_three_sim_configs_are_read():
    assert [p.stem for p in SIMS] == ["a100_sim", "h100_sim", "h200_sim"]


@pytest.mark.parametrize("path", SIMS, ids=lambda p: p.stem)
def test_every_parameter_labelled_assumed_has_a_range_or_a_reason_it_is_kept(path):
    labelled = assumed.labelled(path)
    assert {"eff_gemm", "thermal_tau_s", "power_noise", "act_gemm"} <= set(labelled)
    assert not set(assumed.RANGES) & set(assumed.FIXED)
    missing = set(labelled) - set(assumed.RANGES) - set(assumed.FIXED)
    assert not missing, f"{path.name}: labelled assumed without a range in kareus/hardware/assumed.py: {missing}"


@pytest.mark.parametrize("path", SIMS, ids=lambda p: p.stem)
def test_each_yaml_comment_states_the_range_the_code_holds(path):
    labelled = assumed.labelled(path)
    for key, comment in comments(path).items():
        stated = re.findall(r"\brange \S+", comment)
        if key in assumed.RANGES and key in labelled:
            assert stated == [assumed.RANGES[key].text()], f"{path.name}: {key}: comment states {stated}, code " \
                                                            f"holds {assumed.RANGES[key].text()!r}"
        elif key in assumed.FIXED and key in labelled:
            assert not stated and assumed.NOT_VARIED in comment, f"{path.name}: {key} should say it is not varied"
        else:  # datasheet, paper, fitted: no range to state
            assert not stated, f"{path.name}: {key} is not labelled assumed, yet its comment states {stated}"


def test_every_range_holds_the_shipped_value_and_names_a_labelled_parameter():
    used = set()
    for path in SIMS:
        values = shipped(path)
        for key in set(assumed.labelled(path)) & set(assumed.RANGES):
            lo, hi = assumed.RANGES[key].bounds(values[key])
            assert lo <= values[key] <= hi, f"{path.name}: {key}={values[key]} outside its range {lo}..{hi}"
            used.add(key)
    assert used == set(assumed.RANGES)  # no range for a parameter no config labels assumed
    assert all(r.source for r in assumed.RANGES.values()) and all(assumed.FIXED.values())


def test_the_simulator_page_states_each_range_the_code_holds():
    page = (Path(__file__).resolve().parents[1] / "docs/simulator.md").read_text()
    stated = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        keys = re.findall(r"`(\w+)`", cells[0]) if len(cells) == 3 else []
        ranges = cells[1].split(", ") if keys else []
        for i, key in enumerate(keys):
            stated[key] = ranges[0] if len(ranges) == 1 else ranges[i]
    for key, r in assumed.RANGES.items():
        assert stated.get(key) == r.text()[len("range "):], f"docs/simulator.md: {key}: {stated.get(key)} " \
                                                            f"against the code's {r.text()}"


def test_a_draw_stays_within_the_ranges_and_changes_only_the_keys_given():
    values = shipped(assumed.HARDWARE_DIR / "a100_sim.yaml")
    keys = set(assumed.labelled("a100_sim")) & set(assumed.RANGES)
    for seed in range(20):
        got = assumed.draw(values, keys, random.Random(seed))
        assert {k for k in values if got[k] != values[k]} <= keys
        for key in keys:
            lo, hi = assumed.RANGES[key].bounds(values[key])
            if key == "v_knee_mhz":
                assert isinstance(got[key], int) and got[key] < values["max_mhz"]
                lo, hi = math.floor(lo), math.ceil(hi)
            assert lo <= got[key] <= hi, (key, got[key])
        assert all(got[k] <= 1 for k in assumed.FRACTIONS)
    assert assumed.draw(values, keys, random.Random(1)) == assumed.draw(values, keys, random.Random(1))
    assert assumed.draw(values, keys, random.Random(1)) != assumed.draw(values, keys, random.Random(2))


def test_heldout_draws_from_the_shared_ranges():
    import heldout

    assert heldout.DRAWN <= set(assumed.RANGES) and not hasattr(heldout, "ASSUMED")
    for key, (lo, hi) in heldout.NOISE.items():  # its noise level is one part of the plausible range
        r = assumed.RANGES[key]
        assert not r.relative and r.low <= lo < hi <= r.high
    for gpu in heldout.GPUS:
        base, got = heldout.shipped(gpu), heldout.draw_hardware(gpu, random.Random(3))
        for key in heldout.assumed_keys(gpu) & heldout.DRAWN:
            lo, hi = assumed.RANGES[key].bounds(base[key])
            slack = 1 if key == "v_knee_mhz" else 0  # rounded to a whole MHz
            assert lo - slack <= got[key] <= hi + slack, (gpu, key, got[key])


def test_repeat_spread_is_computed_per_clock_and_pooled():
    rows = {1410: [{"times": [1.0, 1.0, 1.0], "energies": [100.0, 102.0, 99.0]},
                   {"times": [2.0, 2.02, 2.0], "energies": [10.0, 10.0, 10.0]}],
            1200: [{"times": [1.0], "energies": [5.0]}]}  # one reading: no spread
    got = repeat_spread(rows)
    assert set(got) == {"1410", "1200", "all"} and got["all"]["rows"] == 3
    assert got["1410"]["energy_range"] == pytest.approx((0.03 + 0.0) / 2)
    assert got["1410"]["time_range"] == pytest.approx((0.0 + 0.01) / 2)
    assert got["1410"]["energy_cv"] > 0 and math.isnan(got["1200"]["time_cv"])


@pytest.mark.skipif(not REAL.is_dir(), reason="needs the recorded A100 table")
def test_the_docs_quote_the_repeat_spread_the_function_computes():
    import sim_fidelity

    data, _, _ = sim_fidelity.split(REAL)
    got = repeat_spread(data)
    docs = Path(__file__).resolve().parents[1] / "docs"
    page = " ".join((docs / "simulator.md").read_text().split())
    pooled, fast, slow = got["all"], got["1410"], got["1200"]
    assert (f"spread by a median {100 * pooled['energy_range']:.2f}% in energy and {100 * pooled['time_range']:.2f}% "
            f"in time ((max - min) / median; coefficient of variation {100 * pooled['energy_cv']:.2f}% and "
            f"{100 * pooled['time_cv']:.2f}%) over all {pooled['rows']} rows, {100 * fast['energy_range']:.2f}% in "
            f"energy at 1410 MHz and {100 * slow['energy_range']:.2f}% at 1200 MHz") in page
    search = " ".join((docs / "search.md").read_text().split())
    assert (f"spread by a median {100 * pooled['energy_range']:.1f}% in energy (coefficient of variation "
            f"{100 * pooled['energy_cv']:.1f}%;") in search


@pytest.mark.skipif(not REAL.is_dir(), reason="needs the recorded A100 table")
def test_the_fit_keeps_the_priors_it_is_given():
    import dataclasses

    import sim_fidelity

    _, fit_rows, _ = sim_fidelity.split(REAL)
    base = dataclasses.replace(sim_fidelity.base_config(), eff_gemm=0.6)
    got, _ = sim_fidelity.fit(fit_rows[:4], ["p_sm_w"], ideal=False, starts=1, base=base)
    assert got.eff_gemm == 0.6 and got.p_sm_w != sim_fidelity.FIT["p_sm_w"][0]


# --- paper.py --sensitivity --------------------------------------------------------------------------

def test_a_sensitivity_draw_is_reproducible_valid_and_leaves_fitted_and_paper_values():
    import paper
    import sim_fidelity

    first = paper.drawn_assumed(0)
    assert first == paper.drawn_assumed(0) and first != paper.drawn_assumed(1)
    assert set(first) == set(assumed.labelled("a100_sim")) & set(assumed.RANGES)
    assert not set(first) & (set(sim_fidelity.FIT) | {"static_power_w", "act_gemm", "sms"})


def test_a_draws_overrides_compose_and_validate(compose):
    import paper

    from kareus.config.validate import validate

    values = {**paper.drawn_assumed(2), "p_sm_w": 600.5}
    cfg = compose("+model=qwen1.7b", "parallel=pp2_tp8", *paper.hardware_overrides(values))
    validate(cfg)
    assert cfg.hardware.p_sm_w == 600.5 and cfg.hardware.v_knee_mhz == values["v_knee_mhz"]
    assert cfg.hardware.eff_gemm == values["eff_gemm"] and cfg.hardware.host_gap_s == 0.0


def test_the_sensitivity_reports_bands_over_draws_beside_the_shipped_value(monkeypatch, tmp_path):
    import paper
    import sim_fidelity

    seen = []

    def evaluate(hardware, extra, tmp):
        seen.append(list(hardware))
        return {"vs_mp.energy_saving_at_megatron_time_pct": 30.0 - 10 * (len(seen) - 1),
                "table8.no_clock_search.max_throughput.energy_pct": None if len(seen) == 2 else 5.0}

    monkeypatch.setattr(paper, "evaluate", evaluate)
    monkeypatch.setattr(sim_fidelity, "split", lambda src: ({}, [], {}))
    monkeypatch.setattr(paper, "refitted", lambda values, fit_rows, test: {
        "fitted": {"p_sm_w": 500.0 + len(values)}, "harness": {"host_gap_s": 1e-3}, "rms": 0.01,
        "at_bound": ["p_sm_w"] if values else [], "scores": {"fidelity.time_median_ape": 0.03}})
    got = paper.sensitivity(3, [], tmp_path)
    saving = got["headline"]["vs_mp.energy_saving_at_megatron_time_pct"]
    assert saving["shipped"] == 30.0 and saving["median"] == 10.0 and saving["draws"] == 3
    assert saving["p10"] == pytest.approx(2.0) and saving["p90"] == pytest.approx(18.0)
    assert got["headline"]["table8.no_clock_search.max_throughput.energy_pct"]["draws"] == 2  # None left out
    p_sm_w = f"hardware.p_sm_w={500.0 + len(got['ranges'])}"
    assert seen[0] == [] and all(p_sm_w in h for h in seen[1:])  # each draw runs with its refitted values
    assert not any("host_gap_s" in o for h in seen for o in h)  # the recorded harness's idle stays out
    assert len(got["per_draw"]) == 3 and got["simulated"] and set(got["ranges"]) == set(got["per_draw"][0]["assumed"])
    assert got["fit"]["p_sm_w"]["shipped_priors"] == 500.0 and got["fit"]["p_sm_w"]["at_bound"] == 3
    assert got["fit"]["host_gap_s"]["median"] == 1e-3 and got["fit"]["host_gap_s"]["at_bound"] == 0

    out = tmp_path / "paper.json"
    out.write_text(json.dumps({"configs": ["kept"]}))
    paper.write_sensitivity(out, got)
    doc = json.loads(out.read_text())
    assert doc["configs"] == ["kept"] and doc["sensitivity"]["draws"] == 3


def test_a_fitted_value_at_a_bound_of_its_fit_is_told_apart():
    import paper

    assert paper.at_bound(0.3, 0.3, 3.0) and paper.at_bound(0.95, 0.0, 0.95) and not paper.at_bound(0.14, 0.0, 0.95)


def test_the_drivers_are_the_parameters_that_rank_with_the_number():
    import paper

    draws = [{"assumed": {"v_min": v, "act_comm": 0.3, "eff_memory": (i * 7) % 5}, "fitted": {"p_sm_w": -v},
              "values": {"x": 10 * v}} for i, v in enumerate((0.65, 0.7, 0.72, 0.75, 0.77))]
    got = paper.drivers(draws + [{"assumed": {}, "fitted": {}, "values": {"x": None}}], "x", top=2)
    assert got["draws"] == 5 and got["rho"] == pytest.approx({"v_min": 1.0, "p_sm_w": -1.0})  # a constant: no rank


def test_band_is_the_median_and_the_10_90_percentiles():
    import paper

    got = paper.band([float(v) for v in range(11)] + [None])
    assert (got["p10"], got["median"], got["p90"], got["draws"]) == (1.0, 5.0, 9.0, 11)
    assert paper.band([None])["median"] is None
