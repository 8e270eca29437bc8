"""The ``thermal`` cooldown policy: no waiting, leakage anchors in the stream, heat bias corrected.

Seeded runs on the simulated A100 (its YAML, with the thermal and noise parameters pinned here so the
tests do not follow tuning of the simulator): the policy must land close to a fully cooled reference
where back-to-back profiling is biased, and cost far less GPU-time than the fixed 5 s cooldown.
"""
from __future__ import annotations

import math
import random
import statistics

import pytest

from _hw_helpers import sim_config
from kareus.hardware.sim import SimulatedGPU
from kareus.hardware.tables import window_partition
from kareus.profiler import Journal, Profiler, ProfilerConfig
from kareus.profiler.cooldown import ThermalCooldown, ThermalCooldownConfig, fit_tau, window_mean
from kareus.registry import COOLDOWNS
from kareus.search.space import SpaceConfig, build_space

THERMAL = dict(ambient_c=30.0, thermal_r_c_per_w=0.09, thermal_tau_s=25.0, static_ref_c=55.0,
               static_temp_coeff=0.006, power_noise=0.004, time_noise=0.002, counter_period_s=0.1, fail_rate=0.0)
REFERENCE = {"name": "temperature", "delta_c": 0.05, "timeout_s": 1000.0, "poll_s": 0.5}


def gpu(seed: int = 0, **kw) -> SimulatedGPU:
    return SimulatedGPU(sim_config(**{**THERMAL, **kw}), seed=seed)


@pytest.fixture(scope="module")
def stream():
    """120 candidates (seeded sample of the attention partition) profiled by each policy on seed 0."""
    part = window_partition(-1)
    space = build_space(part, gpu().gpu, SpaceConfig())
    cands = random.Random(0).sample(space, 120)
    out = {}
    for name, cool in {"reference": REFERENCE, "fixed": {"name": "fixed"}, "none": {"name": "none"},
                       "thermal": {"name": "thermal"}}.items():
        be = gpu()
        prof = Profiler(ProfilerConfig(cooldown=cool), be)
        ms = [prof.measure(part, c) for c in cands]
        out[name] = (be.now(), ms, prof)
    return out


def bias(ms, ref, raw: bool = False) -> float:
    def e(m):
        return statistics.fmean(r.energy_j for r in m.readings) if raw else m.energy_j
    return statistics.fmean(e(m) / r.energy_j - 1.0 for m, r in zip(ms, ref))


def test_thermal_corrects_the_heat_bias_without_waiting(stream):
    ref = stream["reference"][1]
    _, ms, prof = stream["thermal"]
    raw = bias(ms, ref, raw=True)  # what the same windows read before the correction
    assert raw > 0.01  # back to back the GPU runs hot: leakage inflates every window
    assert abs(bias(ms, ref)) < 0.005 and abs(bias(ms, ref)) < 0.25 * raw
    assert bias(stream["none"][1], ref) > 0.01 and bias(stream["fixed"][1], ref) > 0.005
    hot = [m for m in ms if any(f.startswith("thermal:-") for f in m.flags)]
    assert len(hot) > 0.8 * len(ms)  # corrected measurements say so
    assert all(m.energy_j < m.readings[0].energy_j for m in hot)  # raw reading kept beside the value
    pol = prof.cooldown
    assert pol.tau == pytest.approx(THERMAL["thermal_tau_s"], rel=0.1)  # fitted from the stream itself
    # the relative leakage coefficient at the idle temperature the sim implies
    c = THERMAL["static_temp_coeff"]
    true = c / (1 + c * (prof.backend.idle_temperature() - THERMAL["static_ref_c"]))
    assert pol.coeff == pytest.approx(true, rel=0.15)


def test_thermal_costs_far_less_than_the_fixed_cooldown(stream):
    t_fixed, t_none, t_thermal = stream["fixed"][0], stream["none"][0], stream["thermal"][0]
    pol = stream["thermal"][2].cooldown
    assert t_thermal < 0.7 * t_fixed
    assert t_thermal - t_none == pytest.approx(pol.anchor_seconds, abs=0.2 * len(pol.anchors) + 1.0)
    assert len(pol.anchors) <= pol.cfg.max_anchors
    assert stream["reference"][0] > 5 * t_fixed  # a truly cold reference is far too slow to use


@pytest.mark.parametrize("policy", ["thermal", "compensated"])
def test_residual_work_is_corrected_too(policy):
    """Residual (non-partition) work is measured back to back before composing; it ran neither the
    probe nor the anchors, so these policies, which wait for no heat to leave, corrected nothing:
    the bias grew along the sweep to about 2%."""
    from kareus.hardware.tables import attention_ops

    ops, _ = attention_ops()
    clocks = [1410, 1380, 1350, 1320, 1290, 1260]
    reads = {}
    for name, cool in (("reference", REFERENCE), (policy, {"name": policy})):
        be = gpu(power_noise=0.0, time_noise=0.0)
        prof = Profiler(ProfilerConfig(cooldown=cool), be)
        reads[name] = [prof.profile_ops(ops, f) for f in clocks]
    worst = max(abs(m.energy_j / r.energy_j - 1.0) for m, r in zip(reads[policy], reads["reference"]))
    assert worst < 0.006, worst
    assert any(f.startswith("thermal:-") for f in reads[policy][-1].flags)


def test_window_mean_and_tau_fit_recover_an_exponential():
    rng = random.Random(1)
    tau, amb, r = 18.0, 28.0, 0.1
    t, rows = 40.0, []
    for _ in range(60):
        p, w = rng.uniform(80, 380), rng.uniform(3, 6)
        target = amb + r * p
        t1 = target + (t - target) * math.exp(-w / tau)
        rows.append((round(t), round(t1), w, p))  # integer degrees, as NVML reports them
        t = t1
    assert fit_tau(rows, prior=50.0) == pytest.approx(tau, rel=0.15)
    assert fit_tau(rows[:2], prior=50.0) == 50.0  # too few windows: the prior
    # mean of 60 -> 40 relaxing toward 30 with tau 10 over 5 s, closed form
    t1 = 30 + 30 * math.exp(-0.5)
    assert window_mean(60, t1, 5.0, 10.0) == pytest.approx(30 + 30 * 10 / 5 * (1 - math.exp(-0.5)))


def test_leakage_fit_pools_clocks_and_ignores_the_anchor_kernel_power():
    pol = ThermalCooldown(ThermalCooldownConfig())
    pol.tau = 1e9  # windows this short barely relax: the mean is the midpoint
    c, levels = 0.007, {1410: 80.0, 1110: 62.0, 870: 56.0}
    extra = 4.0  # the anchor kernel's own (temperature-independent) dynamic power
    rng = random.Random(2)
    for f, s in levels.items():
        for x in ((0.5, 12.0, 25.0) if f == 1410 else (rng.uniform(5, 20),)):
            p = s * (1 + c * x) + extra + rng.gauss(0, 0.05)
            pol.anchors.append({"mhz": f, "t0": 35 + x, "t1": 35 + x, "w": 3.0, "p": p, "idle": 35.0})
    pol._fit()
    # the slope at an anchored clock is exact whatever the anchor kernel draws itself
    assert pol.slope_at(1410) == pytest.approx(c * 80.0, rel=0.03)
    assert pol.slope_at(1260) == pytest.approx(0.5 * (pol.slope_at(1410) + pol.slope_at(1110)))
    assert pol.coeff_rel_se < 0.05
    bare = ThermalCooldown(ThermalCooldownConfig())
    bare.anchors = [a for a in pol.anchors if a["mhz"] != 1410]  # one anchor per clock: no slope yet
    bare._fit()
    assert bare.coeff is None and bare.slope_at(1110) == 0.0


def test_anchors_survive_a_resume_through_the_journal(tmp_path):
    part = window_partition(-1)
    space = build_space(part, gpu().gpu, SpaceConfig())
    cands = random.Random(3).sample(space, 24)
    journal = Journal.open(tmp_path / "j.sqlite", "h")
    first = Profiler(ProfilerConfig(cooldown={"name": "thermal"}), gpu(seed=3), journal)
    for c in cands[:12]:
        first.measure(part, c)
    anchors = list(first.cooldown.anchors)
    assert anchors and anchors[0]["mhz"] == gpu().gpu.max_mhz  # the cold reference anchor came first
    be = gpu(seed=4)
    again = Profiler(ProfilerConfig(cooldown={"name": "thermal"}), be, Journal.open(tmp_path / "j.sqlite", "h"))
    for c in cands:
        again.measure(part, c)
    assert again.cooldown.anchors[:len(anchors)] == anchors  # loaded, not re-taken on the cold GPU
    assert again.measured == 12


def test_a_failing_anchor_never_fails_the_candidate_and_anchoring_gives_up():
    calls = []

    class NoOps(SimulatedGPU):
        def measure_ops(self, ops, window_s):
            calls.append(window_s)
            raise RuntimeError("no ops kernels on this backend")

    part = window_partition(-1)
    space = build_space(part, gpu().gpu, SpaceConfig())
    be = NoOps(sim_config(**THERMAL))
    be._temp += 20.0  # hot: a correction would be due if the policy knew the leakage
    prof = Profiler(ProfilerConfig(cooldown={"name": "thermal"}), be)
    ms = [prof.measure(part, c) for c in random.Random(5).sample(space, 8)]
    assert all(not m.failed and m.energy_j == m.readings[0].energy_j for m in ms)
    assert not any(f.startswith("thermal") for m in ms for f in m.flags)  # nothing known: nothing corrected
    assert len(calls) == prof.cooldown.cfg.max_failed_anchors  # then it stops spending GPU-time on anchors


def test_config_checks_and_registration():
    assert "thermal" in COOLDOWNS
    bad = ThermalCooldownConfig(anchor_window_s=0, growth=0.5, hot_frac=2.0, max_anchors=1, max_failed_anchors=-1)
    assert bad.problems() == ["anchor_window_s: must be > 0, got 0", "growth: must be >= 1, got 0.5",
                              "hot_frac: must be in (0, 1], got 2.0", "max_anchors: must be >= 2, got 1",
                              "max_failed_anchors: must be >= 1, got -1"]  # one line per key
    assert ThermalCooldownConfig(max_failed_anchors=0).problems()  # spent before its first anchor
    assert ThermalCooldownConfig().problems() == []
    probs = ProfilerConfig(cooldown={"name": "thermal", "max_anchors": 0}).problems()
    assert any("max_anchors" in p for p in probs)


def test_option_file_composes_to_the_schema():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kareus.config.store import store_all
    from kareus.registry import to_dataclass

    store_all()
    conf = Path(__file__).resolve().parents[1] / "conf"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose("profiler/default", overrides=["profiler/cooldown=thermal",
                                                         "profiler.cooldown.max_anchors=12"])
            with pytest.raises(Exception):
                compose("profiler/default", overrides=["profiler/cooldown=thermal", "profiler.cooldown.anchors=3"])
    finally:
        GlobalHydra.instance().clear()
    pc = to_dataclass(ProfilerConfig, cfg.profiler)
    assert pc.problems() == []
    built = COOLDOWNS.build("thermal", config=cfg.profiler.cooldown)
    assert isinstance(built, ThermalCooldown) and built.cfg.max_anchors == 12
    assert built.cfg.anchor_window_s == ThermalCooldownConfig().anchor_window_s  # YAML matches the dataclass


def test_the_benchmark_reports_every_policy_on_gpus_whose_heat_physics_is_mismatched(tmp_path, monkeypatch, capsys):
    """benchmarks/cooldown.py's "mismatched": one entry per scenario (and the shipped physics on the same
    seeds), each with every policy's bias and GPU-time (a tiny run: its checks cut to one variant and size)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import cooldown

    monkeypatch.setattr(cooldown, "VARIANTS", {"as configured": ({}, False)})
    monkeypatch.setattr(cooldown, "SCALING", (3,))
    out = tmp_path / "cooldown.json"
    assert cooldown.main(["--candidates", "3", "--seeds", "1", "--check-seeds", "1", "--out", str(out)]) == 0
    mis = json.loads(out.read_text())["mismatched"]
    assert set(mis["scenarios"]) == {"two time constants", "exponential leakage", "fan step", "all three"}
    assert list(mis["results"]) == ["shipped (matched)", *mis["scenarios"]]
    for label, policies in mis["results"].items():
        assert set(policies) == set(cooldown.POLICIES), label
        for name, r in policies.items():
            assert math.isfinite(r["bias"]) and r["gpu_seconds"] > 0, (label, name)
    shipped, fan = mis["results"]["shipped (matched)"], mis["results"]["fan step"]
    assert fan["none"]["bias"] != shipped["none"]["bias"]  # the physics changed what back-to-back reads
    printed = capsys.readouterr().out
    assert "mismatched heat physics" in printed and all(label in printed for label in mis["results"])
