"""Benchmark scoring: the search-efficiency noise diagnostics on recorded tables (what one repeat per
setting would cost an exhaustive search, how far each clock's lowest-energy corner leads) and the
plan-quality comparison against the exhaustive composition."""
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import search_efficiency as se  # noqa: E402

from kareus.types import Candidate  # noqa: E402


def truth(repeats: dict[tuple[str, int], list[tuple[float, float]]]) -> se.Truth:
    """A one-clock table from (time, energy) repeats; medians are the table, as replay_truths builds it."""
    space, table, reps = [], {}, {}
    for (slot, sms), reads in repeats.items():
        c = Candidate("p", slot, sms, 1410)
        ts, es = sorted(t for t, _ in reads), sorted(e for _, e in reads)
        t, e = ts[len(ts) // 2], es[len(es) // 2]
        space.append(c)
        table[c] = (t, e, e - 10.0 * t)
        reps[c] = list(reads)
    return se.Truth("recorded", None, space, table, 10.0, reps)


FRONT = {("a", 2): [(1.0, 3.0)] * 3, ("a", 4): [(2.0, 2.0)] * 3, ("b", 2): [(3.0, 1.0)] * 3}


def test_noise_free_repeats_keep_the_whole_front():
    t = truth({**FRONT, ("b", 4): [(3.0, 2.5)] * 3})
    assert se.single_repeat_exhaustive(t, draws=20)["mean"] == pytest.approx(1.0)
    assert se.single_repeat_exhaustive(se.Truth("sim", None, t.space, t.table, 10.0)) is None


def test_a_lucky_repeat_of_a_dominated_setting_costs_the_corner():
    # ("b", 4) has median (3.2, 1.2), dominated by the corner ("b", 2) at (3.0, 1.0); one of its three
    # repeats reads (2.9, 0.9), which would hide the corner whenever it is the one drawn
    t = truth({**FRONT, ("b", 4): [(3.2, 1.2), (3.3, 1.3), (2.9, 0.9)]})
    got = se.single_repeat_exhaustive(t, draws=300, seed=1)
    lost = got["min"]  # a draw that read the lucky repeat: the front has (3.2, 1.2) for its corner
    assert lost < 1.0 and got["p10"] == pytest.approx(lost)
    assert 1.0 - got["mean"] == pytest.approx((1.0 - lost) / 3, rel=0.25)  # a third of the draws lose it


def test_pareto_share_counts_each_front_point_once():
    """Two settings that read the same front point: finding one of them finds the point (the share
    counted settings, so the duplicate held it at 3 of 4 while the front has 3 points)."""
    t = truth({**FRONT, ("c", 2): [(2.0, 2.0)] * 3})
    got = [Candidate("p", slot, sms, 1410) for slot, sms in (("a", 2), ("a", 4), ("b", 2))]
    points = [SimpleNamespace(time_s=t.table[c][0], energy_j=t.table[c][1]) for c in got]
    result = SimpleNamespace(measurements=[SimpleNamespace(candidate=c) for c in got], frontier=points,
                             dynamic_frontier=points)
    assert se.score(t, result)["pareto_share"] == 1.0
    result.measurements = result.measurements[:2]
    assert se.score(t, result)["pareto_share"] == pytest.approx(2 / 3)


def test_a_ground_truth_reading_that_failed_stops_the_benchmark():
    """It was kept as a NaN row that reached the searchers as a successful measurement."""
    import kareus.hardware  # noqa: F401
    import kareus.partition  # noqa: F401
    from omegaconf import OmegaConf

    from kareus.registry import HARDWARE, PARTITIONERS
    from kareus.search.space import SpaceConfig, build_space
    from kareus.workload import build_workload

    hw = OmegaConf.load(se.ROOT / "kareus" / "conf" / "hardware" / "a100_sim.yaml")
    hw.pop("defaults", None)
    hw.fail_rate = 1.0
    backend = HARDWARE.build("sim", config=hw, seed=0)
    part = PARTITIONERS.build("nanobatch", config={}).partition(build_workload(*se.conf_workload("tiny", "pp2_tp2"))).types[0]
    space = build_space(part, backend.gpu, SpaceConfig())[:2]
    with pytest.raises(RuntimeError, match=re.escape(f"ground truth failed at {space[0]}: ")):
        se.measure_space("tiny", backend, part, space)


def test_corner_lead_and_repeat_spread_from_recorded_energies():
    t = truth({**FRONT, ("b", 4): [(3.2, 1.1), (3.3, 1.2), (3.1, 1.0)]})
    (row,) = se.corner_noise(t)
    assert row["corner"] == "b/2 SMs"
    assert row["lead"] == pytest.approx(0.1)  # runner-up median 1.1 against the corner's 1.0
    assert row["repeat_spread_median"] == pytest.approx(0.0)  # three of four settings repeat exactly
    assert row["hv_ratio_without"] < 1.0


def test_plan_quality_compares_the_plans_a_user_picks():
    import plan_quality as pq

    from kareus.frontier import Frontier

    class Composed:  # what compose() returns, as far as plan_points reads it
        def __init__(self, pts):
            self.frontier = Frontier.from_arrays([t for t, _ in pts], [e for _, e in pts])

    exh = pq.plan_points(Composed([(1.0, 10.0), (1.5, 8.0), (2.0, 7.0), (3.0, 6.0)]), reference_time_s=2.0)
    assert list(exh["fastest"]) == [1.0, 10.0] and list(exh["deadline"]) == [2.0, 7.0]
    assert pq.compare(exh, exh) == {"hv_ratio": 1.0, "fastest_extra_time": 0.0, "fastest_extra_energy": 0.0,
                                    "deadline_met": 1.0, "deadline_extra_energy": 0.0}
    ours = pq.plan_points(Composed([(1.1, 10.0), (1.9, 7.7), (3.0, 6.0)]), reference_time_s=2.0)
    got = pq.compare(ours, exh)
    assert got["fastest_extra_time"] == pytest.approx(0.1) and got["deadline_extra_energy"] == pytest.approx(0.1)
    assert got["hv_ratio"] < 1.0
    late = pq.plan_points(Composed([(2.5, 6.5)]), reference_time_s=2.0)
    assert late["deadline"] is None and "deadline_extra_energy" not in pq.compare(late, exh)
    assert pq.compare(late, exh)["deadline_met"] == 0.0  # counted, so a miss cannot hide in the average
    assert pq.compare(ours, exh, perseus_energy_j=11.0)["perseus_energy_saving"] == pytest.approx(0.3)
    assert "perseus_energy_saving" not in pq.compare(late, exh, perseus_energy_j=11.0)

    class WithPerseus(Composed):
        def __init__(self, pts, perseus):
            super().__init__(pts)
            self.perseus = Composed(perseus)

    assert pq.perseus_energy_within(WithPerseus([], [(2.0, 9.0), (2.5, 8.0)]), 2.0) == 9.0
    assert pq.perseus_energy_within(WithPerseus([], [(2.5, 8.0)]), 2.0) is None


def test_a_simulated_ground_truth_is_the_profilers_reading_and_its_own():
    """Each partition is read as the profiler reads it, on a GPU of its own: its table does not depend
    on which partitions were measured before it (their heat and counter phase)."""
    alone = se.sim_truths(keys=("fwd_trail",))
    among = [t for t in se.sim_truths() if t.partition.key == "fwd_trail"]
    assert [t.table for t in alone] == [t.table for t in among] and len(alone) == 2  # both workloads
    c = alone[0].space[0]
    assert alone[0].table[c][1] - alone[0].table[c][2] == pytest.approx(alone[0].static_power_w * alone[0].table[c][0])


def test_a_second_reading_that_swaps_a_corner_costs_the_exhaustive_search_its_share():
    t = truth({**FRONT, ("b", 4): [(3.0, 1.02)] * 3})  # a near-tie behind the lowest-energy corner
    assert se.remeasured_exhaustive(t, t) == pytest.approx(1.0)
    swapped = dict(t.table)
    b2, b4 = (next(c for c in t.space if (c.slot, c.sms) == k) for k in (("b", 2), ("b", 4)))
    swapped[b2], swapped[b4] = (3.0, 1.03, 0.0), (3.0, 1.0, 0.0)  # the second reading ranks them the other way
    again = se.Truth("sim", None, t.space, swapped, 10.0)
    # normalised, the corner (1, 0) becomes (1, 0.01): a strip 0.1 wide and 0.01 high of the front's 0.46
    assert se.remeasured_exhaustive(t, again) == pytest.approx(1 - 0.1 * 0.01 / 0.46)


def test_a_model_that_swaps_a_corner_is_rescued_by_a_budget_that_reaches_the_runner_up():
    """The model ceiling spends the whole budget nearest the model's front: with one pick more than
    the front it measures the near-tie the model ranked second, and keeps the table's corner."""
    t = truth({**FRONT, ("b", 4): [(3.0, 1.02)] * 3, ("c", 2): [(9.0, 9.0)] * 3})
    swapped = np.array([t.table[c][:2] for c in t.space])
    swapped[2], swapped[3] = (3.0, 1.03), (3.0, 1.0)  # the model reads b/4 as the corner, b/2 behind it
    # b/4 stands in for b/2: normalised, the corner (1, 0) becomes (1, 0.01), as in the test above
    assert se.nearest_front(t, swapped, 3) == pytest.approx(1 - 0.1 * 0.01 / 0.46)
    assert se.nearest_front(t, swapped, 4) == pytest.approx(1.0)  # b/2 is the next nearest
    exact = np.array([t.table[c][:2] for c in t.space])
    assert se.nearest_front(t, exact, 3) == pytest.approx(1.0)
    assert se.nearest_front(t, exact, 1) < se.nearest_front(t, exact, 2) < 1.0  # the budget binds


def test_the_model_ceiling_reads_a_second_table_or_one_repeat_per_setting():
    def keyed(t: se.Truth, key: str, repeats: bool = True) -> se.Truth:
        return se.Truth(t.workload, SimpleNamespace(key=key), t.space, t.table, 10.0, t.repeats if repeats else None)

    noiseless = keyed(truth({**FRONT, ("b", 4): [(3.2, 1.2)] * 3}), "p")
    # one of ("b", 4)'s repeats reads (2.9, 0.9): a model drawn with it puts b/4 ahead of the corner b/2
    lucky = keyed(truth({**FRONT, ("b", 4): [(3.2, 1.2), (3.3, 1.3), (2.9, 0.9)]}), "q")
    assert se.model_ceiling([noiseless], {}, (0.75, 1.0)) == {"recorded": {"0.75": pytest.approx(1.0),
                                                                            "1.0": pytest.approx(1.0)}}
    both = se.model_ceiling([noiseless, lucky], {}, (0.75,), draws=60)["recorded"]["0.75"]  # 3 of 4 settings
    assert 0.9 < both < 1.0  # the mean over the workload's two partitions, the lucky draws cost the corner
    assert se.model_ceiling([lucky], {}, (1.0,), draws=60)["recorded"]["1.0"] == pytest.approx(1.0)  # all measured
    # a simulated table (no repeats) is judged by its second reading alone; without one it is left out
    sim = keyed(noiseless, "p", repeats=False)
    again = se.Truth("recorded", sim.partition, sim.space, dict(sim.table), 10.0)
    b2, b4 = (next(c for c in sim.space if (c.slot, c.sms) == k) for k in (("b", 2), ("b", 4)))
    again.table[b2], again.table[b4] = (3.2, 1.2, 0.0), (3.0, 1.0, 0.0)
    assert se.model_ceiling([sim], {}, (0.5,)) == {}
    assert se.model_ceiling([sim], {("recorded", "p"): again}, (0.75,))["recorded"]["0.75"] < 1.0


# --- the noisy protocol and the held-out family -----------------------------------------------------

TINY = [("tiny", *se.conf_workload("tiny", "pp1_tp2"))]


def test_noisy_readings_are_fresh_while_the_truth_they_are_scored_at_is_fixed():
    truth = se.sim_truths(workloads=TINY, keys=("fwd_mlp",), noise=False)[0]
    assert se.sim_truths(workloads=TINY, keys=("fwd_mlp",), noise=False)[0].table == truth.table
    assert se.sim_truths(workloads=TINY, keys=("fwd_mlp",))[0].table != truth.table  # noise on differs
    c = truth.space[len(truth.space) // 2]
    read = se.Counted(truth.readings.reader(seed=0), budget=2)
    first, again = read([c]) + read([c])
    assert first.energy_j != again.energy_j and first.time_s != again.time_s
    assert abs(first.energy_j / truth.table[c][1] - 1) < 0.05  # noise, not another setting
    with pytest.raises(RuntimeError, match="3 readings on a budget of 2"):  # a repeat is charged too
        read([c])
    # a searcher's reported front is scored at the truth of its settings, not at its readings
    prob = se.for_protocol(se.problem(truth, 12, 0), truth, "noisy")
    import kareus.search  # noqa: F401
    from kareus.registry import SEARCHERS

    res = SEARCHERS.build("random", config={"seed": 0, "budget": 12}).run(prob)
    assert prob.evaluate.readings == 12
    scored = se.at_truth(truth, res.frontier)
    assert [tuple(p) for p in scored] == [truth.table[p.payload.candidate][:2] for p in res.frontier]
    assert not np.allclose(scored, [[p.time_s, p.energy_j] for p in res.frontier])
    assert se.score(truth, res, truthful=True) == se.score(truth, res, truthful=True)


def test_a_recorded_table_serves_its_repeats_in_turn_from_a_seeded_start():
    t = truth({**FRONT, ("b", 4): [(3.2, 1.1), (3.3, 1.2), (3.1, 1.0)]})
    c = next(c for c in t.space if (c.slot, c.sms) == ("b", 4))
    got = [m.energy_j for m in se.ReplayReadings(t.repeats, 10.0).reader(seed=3)([c] * 4)]
    assert sorted(got[:3]) == [1.0, 1.1, 1.2] and got[3] == got[0]
    starts = {se.ReplayReadings(t.repeats, 10.0).reader(seed=s)([c])[0].energy_j for s in range(12)}
    assert len(starts) > 1  # seeds start at different repeats


def hydra_overrides(w) -> list[str]:
    """The held-out workload as overrides of the shipped configs, for the project's own validate()."""
    import heldout

    m, p = w.model, w.parallel
    out = ["+model=tiny", "parallel=pp1_tp2", f"hardware={w.gpu}"]
    out += [f"model.{k}={getattr(m, k)}" for k in ("name", "num_layers", "hidden_size", "ffn_hidden_size",
                                                   "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
                                                   "tied_embeddings", "qk_layernorm")]
    out += [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp", "micro_batch_size", "num_microbatches",
                                                      "seq_len", "nanobatches", "recompute", "sequence_parallel")]
    base = heldout.shipped(w.gpu)
    return out + [f"hardware.{k}={v!r}" for k, v in w.hardware.items() if v != base[k]]


def test_heldout_seeds_are_split_and_every_workload_validates_and_builds(compose):
    import heldout

    import kareus.hardware  # noqa: F401
    from kareus.config.validate import validate
    from kareus.registry import HARDWARE, PARTITIONERS
    from kareus.workload import build_workload

    assert not set(heldout.TUNING_SEEDS) & set(heldout.REPORT_SEEDS)
    assert all(heldout.is_report_seed(s) for s in heldout.seeds("report", 5))
    assert not any(heldout.is_report_seed(s) for s in heldout.seeds("tuning", 100))
    for seed in (0, 1, 1000, 1001):
        w = heldout.draw(seed)
        assert heldout.draw(seed) == w and heldout.draw(seed).hardware == w.hardware  # the same every time
        base = heldout.shipped(w.gpu)
        changed = {k for k, v in w.hardware.items() if v != base[k]}
        assert changed <= heldout.assumed_keys(w.gpu) and set(heldout.NOISE) <= changed
        assert not heldout.problems(w.model, w.parallel, w.hardware)
        validate(compose(*hydra_overrides(w)))  # raises ConfigError listing any problem
        backend = HARDWARE.build("sim", config=w.hardware, seed=0)
        types = PARTITIONERS.build("nanobatch", config={}).partition(build_workload(w.model, w.parallel)).types
        kept = [t for t in types if t.key in w.partitions]
        assert len(kept) == len(w.partitions) >= 1
        for t in kept:
            space = w.space(t, backend.gpu)
            assert 50 <= len(space) <= 140 and {c.slot for c in space} == set(w.slots[t.key])
            full = w.full_space(t, backend.gpu)  # what a run searches: every slot, SM count and clock
            assert set(space) < set(full) and {c.slot for c in full} == set(t.slot_labels) | {"sequential"}
            table = se.measure_space(w.label, backend, t, space).table  # raises on a failed reading
            assert np.all(np.isfinite(list(table.values()))) and np.all(np.array(list(table.values()))[:, :2] > 0)


def test_heldout_draws_only_what_the_configs_label_assumed():
    import heldout

    for gpu in heldout.GPUS:
        assumed = heldout.assumed_keys(gpu)
        assert {"eff_gemm", "thermal_tau_s", "power_noise"} <= assumed
        assert not assumed & {"host_scale", "comm_sm_gbps", "comm_link_eff", "contention_sm", "contention_hbm",
                              "p_sm_w", "sms", "max_mhz"}  # fitted or datasheet
    assert "static_power_w" not in heldout.assumed_keys("a100_sim")  # the paper's figure
    assert "static_power_w" in heldout.assumed_keys("h100_sim")


def test_a_quick_noisy_run_writes_the_noisy_summary(tmp_path):
    out = tmp_path / "se.json"
    doc = se.main(["--noisy", "--workload", "tiny:pp1_tp2:a100_sim", "--partitions", "fwd_trail", "--no-replay",
                   "--seeds", "2", "--budgets", "0.1", "--searchers", "random", "--jobs", "1", "--no-timing",
                   "--out", str(out)])
    import json

    written = json.loads(out.read_text())
    assert written["protocols"] == ["noisy"] and "summary" not in written  # the lookup did not run
    noisy = written["noisy"]
    for key in ("summary", "summary_sem", "summary_dynamic", "igd_plus", "pareto_share", "by_workload",
                "exhaustive_one_reading", "runs"):
        assert key in noisy, key
    assert set(noisy["summary"]) == {"random"} and 0 < noisy["summary"]["random"]["0.1"] <= 1
    assert {r["protocol"] for r in noisy["runs"]} == {"noisy"} and len(noisy["runs"]) == 2
    assert all(r["readings"] == r["budget"] == 16 for r in noisy["runs"])
    assert doc["noisy"]["summary"] == noisy["summary"]


# --- the published evaluation (benchmarks/paper.py) --------------------------------------------------

def test_a_layout_the_memory_model_refuses_is_marked_oom_and_not_run(tmp_path):
    import paper

    row, out = paper.config_row(paper.Config("llama3.2-3b", "pp2_tp8", 64, 16384), [], tmp_path)
    assert row["oom"] and "more than A100-SXM4-40GB's 40 GB" in row["oom_reason"] and out is None
    assert row["megatron"] is row["kareus"] is None and row["memory_gb_least"] > 40
    assert not list(tmp_path.iterdir())  # nothing was measured


@pytest.mark.slow  # a tiny form of the whole benchmark: about 40 s
def test_a_smoke_run_of_the_paper_benchmark_writes_every_part(tmp_path):
    import json

    import paper

    out = tmp_path / "paper.json"
    paper.main(["--smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["simulated"] and doc["mode"] == "smoke"
    (row,) = doc["configs"]
    assert {"name", "oom", "megatron", "mp", "np", "kareus", "published", "search_cost"} <= set(row)
    assert not row["oom"] and row["published"] == {"oom": False}
    k = row["kareus"]
    assert k["time_s"] <= row["megatron"]["time_s"] * (1 + 1e-9)  # Megatron's layout is one of its options
    assert k["shortfall_vs_mp_pct"] == 0.0  # M+P's plans join Kareus' frontier
    assert row["search_cost"]["profiled"] < row["search_cost"]["space"]
    assert {"no_clock_search", "no_kernel_scheduling", "plain_nanobatching"} <= set(doc["ablations"]["variants"])
    for v in doc["ablations"]["variants"].values():
        assert {"equal_time", "max_throughput", "published", "disagreements"} <= set(v)
    (seventy,) = doc["seventy_b"]
    assert seventy["microbatches"] == 16 and seventy["dp"] * 8 * 16 == 2048 and seventy["kareus"]["time_s"] > 0
    published_oom = [c.name for c in paper.CONFIGS if c.published_oom]
    assert published_oom == ["llama3.2-3b tp8 mb8 s8192", "llama3.2-3b tp8 mb16 s4096"]


@pytest.mark.slow
def test_a_small_warm_start_run_writes_cold_and_warm_profiles_per_scenario(tmp_path):
    """benchmarks/warm_start.py on one scenario, one partition and one seed: each search's profiles to
    0.98 of the exhaustive hypervolume, cold and warm, and the saving they make, written as JSON."""
    import json

    import warm_start

    out = tmp_path / "warm_start.json"
    warm_start.main(["--scenarios", "drift", "--partitions", "fwd_mlp", "--seeds", "1", "--budget", "0.2",
                     "--out", str(out)])
    doc = json.loads(out.read_text())
    (run,) = doc["scenarios"]["drift"]["runs"]
    assert doc["simulated"] and run["partition"] == "fwd_mlp" and run["prior_points"] > 0
    assert 0 < run["warm"] <= run["space"] and 0 < run["cold"] <= run["space"]
    assert run["saving"] == pytest.approx(1 - run["warm"] / run["cold"])
    assert doc["mean_saving"] == pytest.approx(doc["scenarios"]["drift"]["saving_mean"])
