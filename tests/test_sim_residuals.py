"""benchmarks/sim_residuals.py: the contrasts that test the published N+P mechanisms against the real table
compare only matched rows, pick N+P's rivals from the search space alone, and write what they report."""
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import sim_residuals as sr  # noqa: E402

REAL = Path(__file__).resolve().parents[2] / "shared/data/a100_attention_tp2"
MHZ = 1410


def table(time_of, energy_of=lambda s, e, n: 1.0, windows=((0, 6), (2, 6), (0, 5), (2, 5), (0, 2), (2, 2), (-1, -1)),
          sms=range(1, 21)):
    """(clock, start, end, sms) -> (time, energy) over the given windows."""
    return {(MHZ, s, e, n): (time_of(s, e, n), energy_of(s, e, n)) for s, e in windows for n in sms}


def test_early_launch_compares_only_matched_launches_and_isolates_the_late_joins():
    real = table(lambda s, e, n: 1.02 if s == 0 and e >= 5 and n >= 8 else 1.0)
    sim = table(lambda s, e, n: 1.0)
    got = sr.early_launch(real, sim, MHZ)
    # launches before op 0 and op 2 joined after the same op (2, 5, 6) with the same SMs: 3 x 20 pairs
    assert len(got["pairs"]) == 60 and all(p["end"] >= sr.GEMM for p in got["pairs"])
    s = got["summary"]
    assert sum(v["pairs"] for v in s.values()) == 60
    assert s["late_join_high_sms"]["real_time"] == pytest.approx(0.0198, abs=1e-4)
    assert s["late_join_low_sms"]["real_time"] == 0.0 and s["early_join"]["real_time"] == 0.0
    assert all(v["sim_time"] == 0.0 for v in s.values())


def test_np_choice_picks_its_rivals_from_the_search_space_only():
    # fastest overall at 20 SMs (outside the 2..16 space) and in a window joined early (not a partition of Kareus')
    def time_of(s, e, n):
        if n == 20:
            return 0.5
        return 0.8 if (s, e) == (0, 2) else (0.9 if (s, e, n) == (2, 6, 10) else 1.0)

    real = table(time_of, lambda s, e, n: 0.7 if (s, e, n) == (-1, -1, 4) else 1.0)
    got = sr.np_choice(real, real, MHZ)
    assert got["real"]["fastest"] == {"window": [2, 6], "sms": 10}
    assert got["real"]["least_energy"] == {"window": [-1, -1], "sms": 4}
    assert got["real"]["np_time_over_fastest"] == pytest.approx(1 / 0.9 - 1)
    assert got["real"]["np_energy_over_least"] == pytest.approx(1 / 0.7 - 1)
    del real[(MHZ, 0, 6, sr.NP_SMS)]
    assert "missing" in sr.np_choice(real, real, MHZ)


def test_sm_stealing_finds_the_fastest_sm_count_and_the_rise_past_it():
    real = table(lambda s, e, n: 1.0 + 0.01 * abs(n - 6), windows=((0, 6), (2, 6)))
    sim = table(lambda s, e, n: 1.0 + 0.01 * abs(n - 4), windows=((0, 6), (2, 6)))
    got = sr.sm_stealing(real, sim, MHZ)
    assert set(got) == {"0,6", "2,6"}
    assert got["0,6"]["real"]["fastest_sms"] == 6 and got["0,6"]["sim"]["fastest_sms"] == 4
    assert got["0,6"]["real"]["rise_to_top"] == pytest.approx(math.log(1.14))


def test_residuals_follow_the_knob_they_grow_with():
    real = table(lambda s, e, n: 1.0)
    sim = table(lambda s, e, n: 1.0 + 0.01 * n)
    got = sr.residuals(real, sim)[str(MHZ)]
    assert got["time_rho"]["sms"] == pytest.approx(1.0)
    assert set(got["by_launch"]) == {"sequential", "early_memory", "gemm_and_after"}
    assert got["by_launch"]["sequential"]["rows"] == 20


@pytest.mark.skipif(not REAL.is_dir(), reason="the real A100 table is not checked out beside the project")
def test_the_script_writes_every_contrast_for_the_real_table(tmp_path):
    out = tmp_path / "res.json"
    res = sr.main(["--src", str(REAL), "--out", str(out), "--no-mission", "--no-probes"])
    saved = json.loads(out.read_text())
    for key in ("residuals", "early_launch", "sm_stealing", "np_choice", "fitted", "repeat_spread_time"):
        assert key in saved and key in res
    assert set(saved["residuals"]) == {"1200", "1410"}
    assert saved["early_launch"]["summary"]["late_join_high_sms"]["pairs"] > 0
    assert {"real", "sim"} <= set(saved["np_choice"])


def test_mission_compares_np_with_the_fastest_candidate_of_the_space():
    parts = sr.mission(sr.MISSIONS["qwen1.7b tp8 mb8 s4096"])
    assert parts
    for p in parts:
        assert p["np_time_over_fastest"] >= 0.0  # the fastest of the space is never slower than N+P's candidate
        assert p["np"]["slot"] == p["slots"][0] and p["np"]["sms"] == sr.NP_SMS
        assert p["fastest"]["sms"] in p["sms_space"]
        assert 0.0 <= p["np_exposed_comm_share"] <= 1.0
