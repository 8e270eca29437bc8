"""The simulated GPU as a backend: protocol, clock control, virtual time, thermal drift, NVML counter."""
from __future__ import annotations

import math
import statistics
import time

import pytest

from _hw_helpers import attention_partition, sim_config
from kareus.hardware.base import HardwareBackend
from kareus.hardware.sim import SimulatedGPU
from kareus.registry import HARDWARE
from kareus.types import Candidate


@pytest.fixture(scope="module")
def part():
    return attention_partition()


def cand(part, slot=None, sms=12, mhz=1410):
    return Candidate(part.key, slot or part.slots[0].label, sms, mhz)


def test_registered_and_fulfils_the_protocol():
    gpu = HARDWARE.build("sim", seed=3, config=sim_config())
    assert isinstance(gpu, HardwareBackend)
    assert gpu.gpu.sms == 108 and gpu.gpu.max_mhz == 1410 and gpu.gpu.static_power_w == 85.0
    assert gpu.clock() == 1410 and gpu.space(attention_partition()) is None
    assert sim_config().gpu_spec() == gpu.gpu  # usable without building the backend


def test_clock_must_be_set_before_measuring(part):
    gpu = SimulatedGPU(sim_config())
    with pytest.raises(ValueError, match="set_clock"):
        gpu.measure(part, cand(part, mhz=1200), 1.0)
    with pytest.raises(ValueError, match="no locked clock"):
        gpu.set_clock(1203)
    for fraction in (1410.9, 1395.5):  # were truncated to 1410 and 1395, clocks the GPU would lock
        with pytest.raises(ValueError, match=f"no locked clock {fraction} MHz"):
            gpu.set_clock(fraction)
    gpu.set_clock(1200.0)  # a whole clock written as a float is that clock
    assert gpu.clock() == 1200
    gpu.set_clock(1200)
    r = gpu.measure(part, cand(part, mhz=1200), 1.0)
    assert r.ok and r.freq_mhz == 1200


def test_deterministic_for_a_seed(part):
    def readings(seed):
        gpu = SimulatedGPU(sim_config(), seed)
        return [gpu.measure(part, cand(part, sms=s), 2.0) for s in (4, 8, 16)]

    assert readings(7) == readings(7)
    assert readings(7) != readings(8)


def test_a_readings_noise_does_not_depend_on_the_windows_before_it(part):
    """Noise is keyed by what a window measures and its repeat: probes, anchors or other candidates
    measured in between leave a candidate's reading noise as it was (its heat is another matter)."""
    x = cand(part, sms=8)

    def read_x(before):
        gpu = SimulatedGPU(sim_config(counter_period_s=1e-6), 5)  # no counter quantization: it follows the wall time
        for other in before:
            gpu.measure(part, other, 2.0)
        gpu.measure_ops(part.compute[:2], 2.0)  # a probe window
        gpu.idle(1e6)  # back to the idle temperature
        first, again = gpu.measure(part, x, 2.0), gpu.measure(part, x, 2.0)
        return first, again

    alone, crowded = read_x([]), read_x([cand(part, sms=s) for s in (4, 12, 16)])
    assert crowded[0].time_s == alone[0].time_s  # the same draw
    assert crowded[0].energy_j == pytest.approx(alone[0].energy_j, rel=1e-6)
    assert alone[1].time_s != alone[0].time_s  # a repeat draws anew


def test_virtual_clock_never_sleeps(part):
    gpu = SimulatedGPU(sim_config())
    t0 = time.perf_counter()
    r = gpu.measure(part, cand(part), 5.0)
    gpu.idle(60.0)
    assert gpu.now() == pytest.approx(r.window_s + 60.0)
    assert abs(r.window_s - 5.0) < r.time_s  # whole executions filling the window
    assert r.executions == round(r.window_s / r.time_s)
    assert time.perf_counter() - t0 < 0.5
    before = gpu.now()
    t = gpu.run_once(part, cand(part))
    assert gpu.now() == pytest.approx(before + t)


def test_short_window_fails_and_failures_can_be_injected(part):
    gpu = SimulatedGPU(sim_config())
    r = gpu.measure(part, cand(part), 0.05)
    assert not r.ok and "counter" in r.error and math.isnan(r.energy_j)
    flaky = SimulatedGPU(sim_config(fail_rate=1.0))
    r = flaky.measure(part, cand(part), 2.0)
    assert not r.ok and r.error
    assert all(SimulatedGPU(sim_config()).measure(part, cand(part, sms=s), 1.0).ok for s in range(1, 33))


def test_a_window_that_misses_every_counter_update_fails_and_never_reads_negative_energy():
    """A window of whole 70 ms executions came out under the 0.1 s counter period: with no update in
    it, the energy read as the power difference before it, below zero on a GPU coming from idle."""
    from kareus.hardware.model import Outcome

    gpu = SimulatedGPU(sim_config(time_noise=0.0, power_noise=0.0, counter_period_s=0.1), 0)
    out = Outcome(0.07, 0.07 * 300.0, 1.0, 1410)
    readings = []
    for i in range(12):
        gpu.idle(0.013 * i + 0.2)
        readings.append(gpu._window(out, 0.1, f"k{i}"))
    assert all(r.energy_j > 0 for r in readings if r.ok)
    missed = [r for r in readings if not r.ok]
    assert missed and all("saw no update of the energy counter" in r.error for r in missed)


def test_back_to_back_reads_more_energy_than_after_rest(part):
    gpu = SimulatedGPU(sim_config(power_noise=0.0, time_noise=0.0))
    c = cand(part)
    gpu.idle(600.0)
    rested = statistics.mean(gpu.measure(part, c, 10.0).energy_j for _ in range(1))
    hot = [gpu.measure(part, c, 10.0).energy_j for _ in range(12)]
    assert gpu.temperature() > gpu.idle_temperature() + 10
    assert statistics.mean(hot[-3:]) > rested * 1.01
    gpu.idle(600.0)
    assert gpu.temperature() == pytest.approx(gpu.idle_temperature(), abs=0.5)
    assert gpu.measure(part, c, 10.0).energy_j < statistics.mean(hot[-3:])


def test_executions_without_a_reading_heat_the_gpu(part):
    """Warm-up and calibration runs (``run_once``) and failed windows run the partition too: the GPU
    heats as under a read window, and the time moves on."""
    def until(gpu, step):
        while gpu.now() < 30.0:
            step()

    for name, work in (
        ("run_once", lambda gpu, c: until(gpu, lambda: gpu.run_once(part, c))),
        ("failed windows", lambda gpu, c: until(gpu, lambda: gpu.measure(part, c, 10.0))),
        ("windows under the counter period", lambda gpu, c: until(gpu, lambda: gpu.measure(part, c, 0.05))),
    ):
        gpu = SimulatedGPU(sim_config(fail_rate=1.0 if name == "failed windows" else 0.0))
        c = cand(part)
        gpu.set_clock(c.freq_mhz)
        work(gpu, c)
        assert gpu.temperature() > gpu.idle_temperature() + 10, name


def test_the_energy_counter_integrates_what_ran_before_a_window(part):
    """A reading spans the counter's last updates before and in the window, so the stretch between the
    update before the window and its start counts at the power the GPU drew then: after calibration
    runs it reads more than after as long an idle stretch (counted at idle power, both read alike, up
    to ~9% low on a 1 s window)."""
    gains = []
    for seed in range(8):  # the counter's phase differs per seed
        reads, ran = [], 0.0
        for runs in (True, False):
            gpu = SimulatedGPU(sim_config(power_noise=0.0, time_noise=0.0), seed)
            c = cand(part)
            gpu.set_clock(c.freq_mhz)
            gpu.idle(1.0)
            if runs:
                while gpu.now() < 1.3:  # more than a counter period of executions
                    gpu.run_once(part, c)
                ran = gpu.now() - 1.0
            else:
                gpu.idle(ran)  # as long idle: the window starts at the same time, at the same phase
            reads.append(gpu.measure(part, c, 1.0).energy_j)
        gains.append(reads[0] / reads[1] - 1)
    assert min(gains) > 0 and statistics.mean(gains) > 0.01


def test_heat_does_not_depend_on_how_the_running_is_split_into_windows(part):
    """The temperature and static power settle together; solved exactly, 1000 s of running heats the
    GPU alike in one window, ten or a thousand (two fixed-point passes per window read 110, 514 and
    843 C under a strong thermal loop)."""
    temps = []
    for windows in (1, 10, 1000):
        gpu = SimulatedGPU(sim_config(power_noise=0.0, time_noise=0.0, thermal_r_c_per_w=0.19, static_temp_coeff=0.06))
        c = cand(part)
        gpu.set_clock(c.freq_mhz)
        for _ in range(windows):
            gpu.measure(part, c, 1000.0 / windows)
        temps.append(gpu.temperature())
    assert max(temps) == pytest.approx(min(temps), rel=1e-3)


@pytest.mark.parametrize("window", [0.0, -1.0])
def test_a_window_of_no_time_fails_and_changes_nothing(part, window):
    gpu = SimulatedGPU(sim_config())
    c = cand(part)
    gpu.set_clock(c.freq_mhz)
    temp, now = gpu.temperature(), gpu.now()
    r = gpu.measure(part, c, window)
    assert not r.ok and "shorter than the energy counter" in r.error
    assert gpu.temperature() == temp and gpu.now() == now


def test_short_windows_have_larger_energy_error(part):
    def mean_error(window):
        errs = []
        for seed in range(40):
            gpu = SimulatedGPU(sim_config(power_noise=0.0, time_noise=0.0), seed)
            truth_gpu = SimulatedGPU(sim_config(power_noise=0.0, time_noise=0.0, counter_period_s=1e-6), seed)
            r, t = gpu.measure(part, cand(part), window), truth_gpu.measure(part, cand(part), window)
            errs.append(abs(r.energy_j / t.energy_j - 1.0))
        return statistics.mean(errs)

    assert mean_error(1.0) > 1.5 * mean_error(5.0)


def test_measure_ops_and_per_gpu_energy(part):
    gpu = SimulatedGPU(sim_config(power_noise=0.0, time_noise=0.0))
    r = gpu.measure_ops(part.compute, 2.0)
    assert r.ok and r.time_s > 0
    out = gpu.outcome(part, part.slots[0].label, 12, 1410)
    long = gpu.measure(part, cand(part), 30.0)
    assert long.time_s == pytest.approx(out.time_s, rel=1e-9)
    per_exec = out.dynamic_j + 85.0 * out.static_scale * out.time_s
    assert long.energy_j == pytest.approx(per_exec, rel=0.1)


def test_h100_and_h200_configs_load():
    for name, hbm in (("h100_sim", 3350.0), ("h200_sim", 4800.0)):
        spec = sim_config(name).gpu_spec()
        assert spec.sms == 132 and spec.max_mhz == 1980 and spec.hbm_gbps == hbm and spec.tdp_w == 700.0
