"""Measurement noise in MBO: re-measurements, the mean of a setting's readings, the posterior front."""
from dataclasses import replace

import numpy as np
import pytest

from kareus.frontier import pareto_mask
from kareus.registry import SEARCHERS, to_dataclass
from kareus.search.base import SearchProblem
from kareus.search.common import SearchRun
from kareus.search.config import MBOConfig, config_problems
from kareus.search.mbo import posterior_estimates, remeasure_near_ties
from kareus.search.noise import at_stake, pooled_noise, remeasure_pick
from kareus.search.space import SpaceConfig, build_space
from kareus.search.synthetic import SYNTH_GPU, SyntheticGPU, synthetic_partition
from kareus.types import Candidate, Measurement

import kareus.search  # noqa: F401  (registers)

PART = synthetic_partition()
SPACE = build_space(PART, SYNTH_GPU, SpaceConfig(slots=["sequential", "s1"], sms=[2, 4, 8, 12, 16]))
FAST = {"surrogate": {"members": 4, "rounds": 60}}


def mbo_config(**over) -> MBOConfig:
    return to_dataclass(MBOConfig, {**FAST, **over})


def reading(c: Candidate, t: float, e: float) -> Measurement:
    return Measurement(c, t, e, e - SYNTH_GPU.static_power_w * t, SYNTH_GPU.static_power_w, 60.0, float(c.freq_mhz), 1)


def scripted(values: dict[Candidate, list[tuple[float, float]]], asked: list):
    """An evaluate answering each setting's readings in turn, recording each annotation."""
    served: dict[Candidate, int] = {}

    def evaluate(batch, notes=None):
        out = []
        for c, note in zip(batch, notes or [{}] * len(batch)):
            asked.append((c, dict(note)))
            k = served.get(c, 0)
            served[c] = k + 1
            out.append(reading(c, *values[c][min(k, len(values[c]) - 1)]))
        return out

    return evaluate


def test_a_remeasurement_is_charged_asks_for_its_reading_and_the_front_takes_the_mean():
    a, lucky, b = SPACE[:3]
    values = {a: [(1.0, 10.0)], b: [(2.0, 8.0)], lucky: [(1.0, 9.0), (1.0, 11.0)]}  # lucky reads 9 once, 11 next
    asked: list = []
    run = SearchRun(SearchProblem(PART, SPACE, scripted(values, asked), 5, 0, SYNTH_GPU.static_power_w))
    run.evaluate([0, 1, 2])
    front = lambda res: {p.payload.candidate for p in res.frontier}  # noqa: E731
    assert lucky in front(run.result()) and a not in front(run.result())  # one lucky reading hides a
    run.remeasure([1, 1], [{"pass": "remeasure"}, {"pass": "remeasure"}])  # one reading of a setting per call
    assert asked[-1] == (lucky, {"pass": "remeasure", "reading": 1}) and len(asked) == 4
    assert run.remaining == 1 and run.counts([0, 1, 2]).tolist() == [1, 2, 1]
    res = run.result()
    assert [m.energy_j for m in res.measurements] == [10.0, 9.0, 8.0, 11.0]  # every reading, in order
    mean = next(m for m in res.per_setting() if m.candidate == lucky)
    assert mean.energy_j == pytest.approx(10.0) and "readings:2" in mean.flags and len(res.per_setting()) == 3
    assert a in front(res)


def lucky_problem():
    """30 settings of a smooth synthetic partition read with 0.2% noise, one dominated setting near the
    front's slow end read 8% low in energy, so that its single reading puts it on the front."""
    gpu = SyntheticGPU(PART, noise=0.002, seed=0)
    lucky = next(c for c in SPACE if (c.slot, c.sms, c.freq_mhz) == ("s1", 8, 870))

    def evaluate(batch, notes=None):
        out = gpu.evaluate(batch, notes)
        return [replace(m, energy_j=0.92 * m.energy_j, dynamic_energy_j=m.dynamic_energy_j - 0.08 * m.energy_j)
                if m.candidate == lucky else m for m in out]

    truth = np.array([gpu.truth(c)[:2] for c in SPACE])
    front = np.flatnonzero(pareto_mask(truth[:, 0], truth[:, 1]))
    rng = np.random.default_rng(1)
    pick = sorted(set(rng.choice(len(SPACE), 30, replace=False).tolist()) | {SPACE.index(lucky)}
                  | set(front.tolist()[::3]))
    return SearchProblem(PART, SPACE, evaluate, len(pick), 0, SYNTH_GPU.static_power_w), pick, lucky


def test_the_posterior_front_leaves_out_a_setting_whose_single_reading_was_lucky():
    prob, pick, lucky = lucky_problem()
    run = SearchRun(prob)
    run.evaluate(pick)
    by_readings = {p.payload.candidate for p in run.result().frontier}
    est = posterior_estimates(run, mbo_config(report="posterior"), 0)
    by_posterior = {p.payload.candidate for p in run.result(est).frontier}
    assert lucky in by_readings and lucky not in by_posterior
    assert posterior_estimates(run, mbo_config(), 0) is None  # report=readings: the readings' front


def test_noise_is_pooled_from_repeats_and_exact_repeats_say_there_is_none():
    sd, exact = pooled_noise([np.log([[1.0, 2.0]]), np.log([[1.0, 2.0], [1.0, 2.0]])], np.array([0.002, 0.01]))
    assert exact and sd[0] < 0.002 and sd[1] < 0.01  # the repeat shrank the prior
    sd, exact = pooled_noise([np.log([[1.0, 2.0], [1.01, 2.2]])], np.array([0.002, 0.01]))
    assert not exact and sd[1] > 0.03


def test_the_setting_picked_again_is_the_lucky_side_of_a_near_tie_at_stake():
    # log (time, energy): 0 and 1 a near-tie at the fast end (1 seems to dominate 0 by 0.5%), 2 far off
    pts = np.log(np.array([[1.0, 10.05], [1.0, 10.0], [2.0, 5.0], [3.0, 4.0]]))
    counts = np.ones(4, dtype=int)
    sd = np.array([0.002, 0.01])
    stake = at_stake(pts, counts, sd)
    assert np.argmax(stake) in (0, 1) and stake[2] < stake[0]
    assert remeasure_pick(pts, counts, sd, 0.002) == 1  # the front side of the tie: its reading may be lucky
    assert remeasure_pick(pts, np.array([2, 1, 1, 1]), sd, 0.002) == 1  # the side with fewer readings
    assert remeasure_pick(pts, counts, sd, 1.0) is None  # nothing at stake by that much


def test_mbo_stops_remeasuring_once_repeats_read_back_the_same_numbers():
    """On a deterministic backend (a lookup) a repeat reads what it read before: one re-measurement tells,
    and the rest of the share goes back to new settings."""
    gpu = SyntheticGPU(PART)
    asked: list = []

    def evaluate(batch, notes=None):
        asked.extend(dict(n) for n in (notes or [{}] * len(batch)))
        return gpu.evaluate(batch, notes)

    res = SEARCHERS.build("mbo", config={"seed": 0, "remeasure": 0.3, "remeasure_stake": 0.0, **FAST}).run(
        SearchProblem(PART, SPACE, evaluate, 30, 0, SYNTH_GPU.static_power_w))
    again = [n for n in asked if n.get("reading")]
    assert len(res.measurements) == 30 == len(asked) and len(again) == 1
    assert len(res.per_setting()) == 29 == len({m.candidate for m in res.measurements})


def test_remeasure_near_ties_reads_again_under_noise_within_its_share():
    prob, pick, lucky = lucky_problem()
    prob = replace(prob, budget=len(pick) + 4)
    run = SearchRun(prob)
    run.evaluate(pick)
    taken = remeasure_near_ties(run, mbo_config(remeasure_stake=0.0), 3)
    assert 1 <= taken <= 3 and run.remaining == 4 - taken and len(run.log) == len(pick) + taken


@pytest.mark.parametrize("override, key", [({"remeasure": 1.0}, "search.remeasure"),
                                           ({"remeasure_handed": -0.1}, "search.remeasure_handed"),
                                           ({"noise_prior": [0.01]}, "search.noise_prior"),
                                           ({"remeasure_stake": -1.0}, "search.remeasure_stake")])
def test_noise_options_out_of_range_are_refused(override, key):
    assert any(p.startswith(key) for p in config_problems(MBOConfig(**override)))
