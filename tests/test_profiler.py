"""The profiler's protocol, robustness (retries, outliers, crashes), journal answers and controllers."""
from __future__ import annotations

import math
import sys
import types

import pytest

from kareus.events import CandidateMeasured
from kareus.profiler import Journal, Profiler, ProfilerConfig, ReadError
from kareus.registry import COOLDOWNS, FREQUENCY_CONTROLLERS
from kareus.search.synthetic import SYNTH_GPU, SyntheticGPU, synthetic_partition
from kareus.types import Candidate, Op, OpKind, Reading

PART = synthetic_partition("fwd_synth", 6)


class FakeBackend:
    """A deterministic GPU with a first-order thermal model and scripted faults per candidate.

    ``script[candidate]`` is a list consumed one per ``measure`` call: "read_error" raises ReadError,
    "bad" returns ok=False, "short" returns a too-short window, "crash" raises RuntimeError,
    ("scale", k) multiplies energy by k; anything else (or an empty list) is a normal reading.
    """

    name = "fake"

    def __init__(self, tau_s: float = 8.0, idle_c: float = 35.0, hot_c: float = 75.0, leak_w_per_c: float = 0.0) -> None:
        self.leak = leak_w_per_c  # leakage: energy grows with the window's mean temperature
        self.gpu = SYNTH_GPU
        self.truth = SyntheticGPU(PART)
        self.t = 0.0
        self.mhz = SYNTH_GPU.max_mhz
        self.temp = idle_c
        self.idle_c, self.hot_c, self.tau = idle_c, hot_c, tau_s
        self.script: dict[Candidate, list] = {}
        self.clock_calls: list[int] = []
        self.measure_calls = 0
        self.windows: list[float] = []

    def _heat(self, seconds: float, target: float) -> None:
        self.temp = target + (self.temp - target) * math.exp(-seconds / self.tau)
        self.t += seconds

    def set_clock(self, mhz: int) -> None:
        self.clock_calls.append(mhz)
        self.mhz = mhz

    def clock(self) -> int:
        return self.mhz

    def temperature(self) -> float:
        return self.temp

    def idle_temperature(self) -> float:
        return self.idle_c

    def now(self) -> float:
        return self.t

    def idle(self, seconds: float) -> None:
        self._heat(seconds, self.idle_c)

    def run_once(self, partition, candidate) -> float:
        t, _, _ = self.truth.truth(candidate)
        self._heat(t, self.hot_c)
        return t

    def measure(self, partition, candidate, window_s: float) -> Reading:
        self.measure_calls += 1
        self.windows.append(window_s)
        action = self.script.get(candidate, [])
        action = action.pop(0) if action else None
        if action == "crash":
            raise RuntimeError("illegal memory access")
        if action == "read_error":
            raise ReadError("NVML_ERROR_UNKNOWN")
        t, e, _ = self.truth.truth(candidate)
        target, t0 = self.hot_c, self.temp
        mean_c = target + (t0 - target) * self.tau / window_s * (1 - math.exp(-window_s / self.tau))
        e += self.leak * (mean_c - self.idle_c) * t
        self._heat(window_s, self.hot_c)
        if isinstance(action, tuple) and action[0] == "scale":
            e *= action[1]
        n = max(1, round(window_s / t))
        if action == "bad":
            return Reading(t, e, self.temp, float(self.mhz), window_s, n, ok=False, error="counter wrapped")
        if action == "short":
            return Reading(t, e, self.temp, float(self.mhz), 0.01, n)
        return Reading(t, e, self.temp, float(self.mhz), window_s, n)

    def measure_ops(self, ops, window_s: float) -> Reading:
        self.measure_calls += 1
        self._heat(window_s, self.hot_c)
        return Reading(1e-3 * len(ops), 0.3 * len(ops), self.temp, float(self.mhz), window_s, 1000)

    def space(self, partition):
        return None


def cand(slot="sequential", sms=4, f=1200) -> Candidate:
    return Candidate(PART.key, slot, sms, f)


def make(tmp_path, backend=None, events=None, **cfg):
    backend = backend or FakeBackend()
    journal = Journal.open(tmp_path / "j.sqlite", "h1")
    events = events if events is not None else []
    prof = Profiler(ProfilerConfig(**cfg), backend, journal, events.append)
    return prof, backend, journal, events


def test_a_retried_windows_heat_correction_starts_from_the_gpu_the_failed_window_left(tmp_path):
    """The failed window ran and heated the GPU; the correction was given the temperature from before
    it, so it took too little heat out of the retried window."""
    prof, be, _, _ = make(tmp_path)
    starts: list[float] = []
    prof.cooldown.excess_energy = lambda reading, start_c, idle_c: starts.append(start_c) or 0.0
    c = cand()
    be.script[c] = ["bad"]
    temps: list[float] = []
    measure = be.measure
    be.measure = lambda p, k, w: temps.append(be.temperature()) or measure(p, k, w)
    prof.evaluator(PART)([c], None)
    assert len(temps) == 2 and temps[1] > temps[0] + 1.0  # the failed window heated the GPU
    assert starts == [temps[1]]


def test_protocol_locks_clock_sizes_window_and_journals(tmp_path):
    prof, be, journal, events = make(tmp_path)
    c = cand()
    m = prof.evaluator(PART)([c], [{"pass": "total", "predicted": {"time_s": 1.0}}])[0]
    t, e, _ = be.truth.truth(c)
    assert not m.failed and m.time_s == pytest.approx(t) and m.energy_j == pytest.approx(e)
    assert m.dynamic_energy_j == pytest.approx(e - SYNTH_GPU.static_power_w * t)
    assert be.clock_calls[0] == 1200
    assert abs(be.windows[0] - 5.0) <= t  # whole executions covering ~5 s
    assert journal.count() == 1 and journal.measurements()[0] == m
    (ev,) = events
    assert isinstance(ev, CandidateMeasured) and not ev.cached and ev.pass_name == "total"
    assert ev.predicted == {"time_s": 1.0} and ev.gpu_seconds == pytest.approx(be.now())
    assert be.now() > 5.0 + 5.0  # window plus the fixed 5 s cooldown


def test_a_signal_while_journaling_lands_after_the_measurement_is_reported(tmp_path):
    """SIGTERM between the journal write and the event would leave MLflow one candidate short."""
    import os
    import signal

    prof, _be, journal, events = make(tmp_path)
    append = journal.append

    def append_then_signal(*args, **kwargs):
        append(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # the signal lands between the write and the report

    def stop(signum, frame):
        raise SystemExit(143)

    journal.append = append_then_signal
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit):
            prof.evaluator(PART)([cand(), cand(sms=8)], None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert journal.count() == 1 and [ev.measurement.candidate for ev in events] == [cand()]


def test_journal_answers_without_remeasuring(tmp_path):
    prof, be, journal, _ = make(tmp_path)
    first = prof.evaluator(PART)([cand(), cand(sms=8)], None)
    spent = prof.gpu_seconds(PART.key)
    be2, events = FakeBackend(), []
    prof2 = Profiler(ProfilerConfig(), be2, Journal.open(tmp_path / "j.sqlite", "h1"), events.append)
    again = prof2.evaluator(PART)([cand(), cand(sms=8)], None)
    assert again == first and [a.readings for a in again] == [f.readings for f in first]
    assert be2.measure_calls == 0 and be2.now() == 0.0
    assert all(ev.cached for ev in events) and [ev.index for ev in events] == [0, 1]
    assert prof2.gpu_seconds(PART.key) == pytest.approx(spent)  # journaled cost carried over
    prof2.evaluator(PART)([cand()], None)  # asked again: answered, not charged again
    prof.evaluator(PART)([cand(sms=8)], None)
    assert prof2.gpu_seconds(PART.key) == pytest.approx(spent) == prof.gpu_seconds(PART.key)
    assert events[-1].cached and events[-1].gpu_seconds == pytest.approx(spent)


def test_a_remeasurement_reads_anew_is_charged_and_journaled_as_another_row(tmp_path):
    prof, be, journal, events = make(tmp_path)
    first = prof.measure(PART, cand())
    spent, calls = prof.gpu_seconds(PART.key), be.measure_calls
    again = prof.remeasure(PART, cand())
    assert be.measure_calls > calls and not events[-1].cached  # read on the backend, not the journal
    assert prof.gpu_seconds(PART.key) > spent  # and charged
    assert journal.count(PART.key) == 2 and journal.duplicates() == [cand().key]  # the journal keeps both
    assert prof.measure(PART, cand()) is again and again is not first  # later asks: the newest


def test_a_searchs_reread_is_a_row_of_its_own_and_a_resume_answers_each_reading(tmp_path):
    """A search asks for a setting's k-th re-measurement by annotation: a new reading, charged and
    journaled with ``reading:k``; a resumed run gets each reading back from its own row, never
    another reading's, and measures only readings the journal lacks."""
    from kareus.profiler.journal import reread

    prof, be, journal, events = make(tmp_path)
    be.script[cand()] = [None, ("scale", 1.1)]
    first = prof.measure(PART, cand())
    spent = prof.gpu_seconds(PART.key)
    again = prof.measure(PART, cand(), {"reading": 1, "pass": "remeasure"})
    assert again.energy_j == pytest.approx(1.1 * first.energy_j) and not events[-1].cached
    assert reread(first) == 0 and reread(again) == 1 and "reading:1" in again.flags
    assert prof.gpu_seconds(PART.key) > spent and journal.count(PART.key) == 2 and journal.duplicates() == []
    assert prof.measure(PART, cand()) is first  # the first reading is still what it was
    be2 = FakeBackend()
    resumed = Profiler(ProfilerConfig(), be2, Journal.open(tmp_path / "j.sqlite", "h1"))
    assert resumed.measure(PART, cand()) == first and resumed.measure(PART, cand(), {"reading": 1}) == again
    assert be2.measure_calls == 0 and resumed.gpu_seconds(PART.key) == pytest.approx(prof.gpu_seconds(PART.key))
    resumed.measure(PART, cand(), {"reading": 2})
    assert be2.measure_calls > 0 and journal.count(PART.key) == 3


def test_failed_reads_retried_then_recorded_failed(tmp_path):
    prof, be, journal, _ = make(tmp_path, retries=2)
    ok, bad = cand(sms=4), cand(sms=8)
    be.script[ok] = ["read_error", "bad"]
    be.script[bad] = ["read_error", "bad", "read_error", "normal"]
    m_ok, m_bad = prof.evaluator(PART)([ok, bad], None)
    assert not m_ok.failed and "retried:2" in m_ok.flags
    assert m_bad.failed and math.isnan(m_bad.energy_j) and math.isnan(m_bad.time_s)
    assert "read failed after 3 tries" in m_bad.flags[0]
    assert be.measure_calls == 6  # 3 for ok, 3 for bad: bounded
    assert [m.failed for m in journal.measurements()] == [False, True]


def test_short_window_retried_with_a_longer_one(tmp_path):
    prof, be, _, _ = make(tmp_path, min_window_s=1.0)
    c = cand()
    be.script[c] = ["short"]
    m = prof.evaluator(PART)([c], None)[0]
    assert not m.failed and be.windows[1] >= 2 * be.windows[0] - 1e-9


def test_crash_is_failed_and_search_goes_on(tmp_path):
    prof, be, journal, _ = make(tmp_path, retries=5)
    boom, fine = cand(sms=2), cand(sms=6)
    be.script[boom] = ["crash"]
    m_boom, m_fine = prof.evaluator(PART)([boom, fine], None)
    assert m_boom.failed and "illegal memory access" in m_boom.flags[0]
    assert not m_fine.failed
    assert be.measure_calls == 2  # a crash is not retried
    assert journal.count() == 2


def test_a_configuration_error_stops_the_search_instead_of_failing_each_candidate(tmp_path):
    from kareus.errors import KareusError

    prof, be, journal, _ = make(tmp_path)

    def no_group(*a):
        raise KareusError("hardware.comm=nccl needs a torch.distributed process group")

    be.run_once = no_group
    with pytest.raises(KareusError, match="process group"):
        prof.evaluator(PART)([cand(sms=2), cand(sms=4)], None)
    be.run_once = FakeBackend().run_once
    be.measure = no_group  # raised from a window: not a crash record either
    with pytest.raises(KareusError):
        prof.measure(PART, cand(sms=6))
    assert journal.count() == 0


def test_mad_outlier_flagged_and_excluded(tmp_path):
    prof, be, _, _ = make(tmp_path, repeats=5)
    c = cand()
    be.script[c] = ["n", "n", ("scale", 1.5), "n", "n"]
    m = prof.evaluator(PART)([c], None)[0]
    _, e, _ = be.truth.truth(c)
    assert "outlier:2" in m.flags and m.repeats == 4 and len(m.readings) == 5
    assert m.energy_j == pytest.approx(e)  # the 1.5x window did not leak into the mean


def test_profile_ops_is_journaled(tmp_path):
    prof, be, journal, _ = make(tmp_path)
    ops = (Op("embed", OpKind.ELEMENTWISE, bytes=1e6), Op("head", OpKind.GEMM, flops=1e9))
    m = prof.profile_ops(ops, 1110)
    assert not m.failed and m.time_s == pytest.approx(2e-3) and m.candidate.partition.startswith("ops:")
    assert m.dynamic_energy_j == pytest.approx(0.6 - SYNTH_GPU.static_power_w * 2e-3)
    calls = be.measure_calls
    assert prof.profile_ops(ops, 1110) == m and be.measure_calls == calls
    prof2 = Profiler(ProfilerConfig(), FakeBackend(), Journal.open(tmp_path / "j.sqlite", "h1"))
    assert prof2.profile_ops(ops, 1110) == m


# -- cooldown policies ---------------------------------------------------------------------------
def hot_backend(**kw) -> FakeBackend:
    be = FakeBackend(**kw)
    be.temp = 70.0
    return be


def test_fixed_and_none_cooldowns():
    be = hot_backend()
    assert COOLDOWNS.build("fixed", config={}).cool(be) == 5.0 and be.now() == 5.0
    assert COOLDOWNS.build("fixed", config={"seconds": 2}).cool(be) == 2.0 and be.now() == 7.0
    assert COOLDOWNS.build("none", config={}).cool(be) == 0.0 and be.now() == 7.0


def test_temperature_cooldown_waits_until_near_idle_or_timeout():
    be = hot_backend(tau_s=8.0)
    waited = COOLDOWNS.build("temperature", config={"delta_c": 2.0, "poll_s": 0.5}).cool(be)
    assert be.temperature() <= 37.0 + 1e-9 and waited == pytest.approx(be.now())
    assert waited == pytest.approx(math.ceil(8.0 * math.log(35 / 2) / 0.5) * 0.5)
    be = hot_backend(tau_s=1000.0)
    assert COOLDOWNS.build("temperature", config={"timeout_s": 3.0}).cool(be) == pytest.approx(3.0)


def test_predictive_cooldown_learns_tau_and_waits_just_enough():
    pol = COOLDOWNS.build("predictive", config={"delta_c": 2.0, "tau_s": 3.0, "poll_s": 0.25})
    be = hot_backend(tau_s=8.0)
    pol.cool(be)
    assert pol.tau == pytest.approx(8.0, rel=1e-6)  # fitted from the first decay
    be2 = hot_backend(tau_s=8.0)
    waited = pol.cool(be2)
    assert waited == pytest.approx(8.0 * math.log(35 / 2), rel=1e-6)  # one exact wait, no polling slack
    assert be2.temperature() == pytest.approx(37.0, abs=1e-6)
    assert pol.cool(be2) == 0.0  # already cool


def test_compensated_fits_leakage_and_removes_the_heat_bias(tmp_path):
    cool = {"name": "compensated", "cycles": 2, "probe_windows": 4, "probe_window_s": 4.0, "probe_idle_s": 10.0}
    c = cand(f=1200)
    cold_be = FakeBackend(leak_w_per_c=0.5)
    cold = Profiler(ProfilerConfig(cooldown={"name": "fixed", "seconds": 0}), cold_be).measure(PART, c)
    be = FakeBackend(leak_w_per_c=0.5)
    journal = Journal.open(tmp_path / "j.sqlite", "h")
    prof = Profiler(ProfilerConfig(cooldown=cool), be, journal)
    first = prof.measure(PART, cand(f=1000))  # runs the probe first
    pol = prof.cooldown
    assert set(pol.slopes) == {SYNTH_GPU.max_mhz, 855} and pol.probe_seconds > 0
    assert all(k == pytest.approx(0.5, rel=0.02) for k in pol.slopes.values())
    assert pol.tau == pytest.approx(8.0, rel=0.02)
    be.temp = 70.0  # as if the previous candidate left the GPU hot
    raw = FakeBackend(leak_w_per_c=0.5)
    raw.temp = 70.0
    hot_raw = Profiler(ProfilerConfig(cooldown={"name": "none"}), raw).measure(PART, c)
    hot = prof.measure(PART, c)
    assert hot_raw.energy_j > cold.energy_j * 1.01  # uncorrected: biased by the heat
    assert hot.energy_j == pytest.approx(cold.energy_j, rel=2e-3)  # corrected back to a cold start
    assert any(f.startswith("thermal:-") for f in hot.flags) and not first.failed
    assert hot.readings[0].energy_j == pytest.approx(hot_raw.readings[0].energy_j)  # raw reading kept
    # a second profiler on this journal reuses the fit instead of probing again
    prof2 = Profiler(ProfilerConfig(cooldown=cool), FakeBackend(leak_w_per_c=0.5), journal)
    prof2.measure(PART, cand(f=1110))
    assert prof2.cooldown.slopes == pol.slopes and prof2.cooldown.probe_seconds == 0.0


# -- frequency controllers -------------------------------------------------------------------------
def test_sim_controller_resets_clock_even_on_error():
    be = FakeBackend()
    with pytest.raises(ValueError):
        with FREQUENCY_CONTROLLERS.build("sim", be, config={}) as ctl:
            ctl.set(900)
            ctl.set(900)  # no redundant call
            raise ValueError("search died")
    assert be.clock_calls == [900, SYNTH_GPU.max_mhz]


def test_profiler_close_resets_clock(tmp_path):
    prof, be, _, _ = make(tmp_path)
    with prof:
        prof.evaluator(PART)([cand(f=1000)], None)
    assert be.clock_calls[-1] == SYNTH_GPU.max_mhz


def test_nvml_controller_locks_group_and_always_resets(monkeypatch):
    calls = []
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: calls.append("init")
    fake.nvmlShutdown = lambda: calls.append("shutdown")
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    fake.nvmlDeviceSetGpuLockedClocks = lambda h, lo, hi: calls.append(("lock", h, lo, hi))
    fake.nvmlDeviceResetGpuLockedClocks = lambda h: calls.append(("reset", h))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(RuntimeError):
        with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [2, 3]}) as ctl:
            ctl.set(1005)
            raise RuntimeError("crash")
    assert calls == ["init", ("lock", "h2", 1005, 1005), ("lock", "h3", 1005, 1005), ("reset", "h2"),
                     ("reset", "h3"), "shutdown"]


def _denying_nvml(monkeypatch, calls: list) -> None:
    """pynvml that refuses locks and resets as it does for a user without admin rights."""
    class NVMLError_NoPermission(Exception):  # pynvml builds one such class per NVML error code
        pass

    def deny(*args):
        calls.append(("denied",) + args)
        raise NVMLError_NoPermission("Insufficient Permissions")

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: calls.append("shutdown")
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    fake.nvmlDeviceSetGpuLockedClocks = deny
    fake.nvmlDeviceResetGpuLockedClocks = deny
    monkeypatch.setitem(sys.modules, "pynvml", fake)


def test_a_lock_without_admin_rights_stops_the_search_once_and_touches_nothing_else(tmp_path, monkeypatch):
    from kareus.errors import KareusError

    calls: list = []
    _denying_nvml(monkeypatch, calls)
    be = FakeBackend()
    prof = Profiler(ProfilerConfig(), be, Journal.open(tmp_path / "j.sqlite", "h1"),
                    frequency=FREQUENCY_CONTROLLERS.build("nvml", be, config={"devices": [0]}))
    with pytest.raises(KareusError, match=r"profiler.frequency=nvml: locking GPU clocks needs admin rights"):
        with prof:
            prof.evaluator(PART)([cand(), cand(sms=8)], None)
    assert prof.journal.count() == 0 and be.measure_calls == 0  # no candidate recorded as failed
    assert calls == [("denied", "h0", 1200, 1200), "shutdown"]  # nothing was locked: nothing to reset


def test_a_lock_that_held_on_some_gpus_resets_those(monkeypatch):
    calls: list = []
    _fake_nvml(monkeypatch, calls)
    fake = sys.modules["pynvml"]

    def lock(h, lo, hi):
        if h == "nvml1":
            raise RuntimeError("NVMLError_Unknown")
        calls.append(("lock", h, lo))

    fake.nvmlDeviceSetGpuLockedClocks = lock
    with pytest.raises(RuntimeError):
        with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0, 1]}) as ctl:
            ctl.set(1005)
    assert [c for c in calls if isinstance(c, tuple)] == [("lock", "nvml0", 1005), ("reset", "nvml0")]


def test_after_a_lock_that_failed_partway_the_old_clock_is_locked_again(monkeypatch):
    """GPU 0 took 1005 MHz, GPU 1 refused it; the controller still held 1410 as its clock, so the next
    candidate at 1410 locked nothing, and its windows ran with GPU 0 at 1005."""
    calls: list = []
    _fake_nvml(monkeypatch, calls)
    fake = sys.modules["pynvml"]

    def lock(h, lo, hi):
        if h == "nvml1" and lo == 1005:
            raise RuntimeError("NVMLError_Unknown")
        calls.append(("lock", h, lo))

    fake.nvmlDeviceSetGpuLockedClocks = lock
    with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0, 1]}) as ctl:
        ctl.set(1410)
        with pytest.raises(RuntimeError):
            ctl.set(1005)
        assert ctl.locked is None
        ctl.set(1410)
        assert ctl.locked == 1410
    locks = [c for c in calls if isinstance(c, tuple) and c[0] == "lock"]
    assert locks == [("lock", "nvml0", 1410), ("lock", "nvml1", 1410), ("lock", "nvml0", 1005),
                     ("lock", "nvml0", 1410), ("lock", "nvml1", 1410)]


def test_a_candidate_whose_lock_failed_is_journaled_without_a_clock(tmp_path, monkeypatch):
    """Its row carried the previous candidate's clock (1410 MHz for a 1005 MHz setting)."""
    import sqlite3

    calls: list = []
    fake = _fake_nvml(monkeypatch, calls)

    def lock(h, lo, hi):
        if h == "nvml1" and lo == 1005:
            raise RuntimeError("NVMLError_Unknown")

    fake.nvmlDeviceSetGpuLockedClocks = lock
    be = FakeBackend()
    journal = Journal.open(tmp_path / "j.sqlite", "h1")
    prof = Profiler(ProfilerConfig(), be, journal,
                    frequency=FREQUENCY_CONTROLLERS.build("nvml", be, config={"devices": [0, 1]}))
    with prof:
        got = prof.evaluator(PART)([cand(f=1410), cand(sms=8, f=1005)], None)
    assert not got[0].failed and got[1].failed
    with sqlite3.connect(tmp_path / "j.sqlite") as con:
        rows = dict(con.execute("SELECT freq_mhz, clock_mhz FROM measurements").fetchall())
    assert rows == {1410: 1410, 1005: None}


def test_a_reference_anchor_whose_lock_failed_partway_is_undone_before_the_window(tmp_path, monkeypatch):
    """The thermal policy's reference anchor locked 1410 MHz on GPU 0 and failed on GPU 1; the backend
    still recorded the candidate's clock, so no lock followed and its window ran with GPU 0 at 1410."""
    held: dict = {}
    fail = {"on": False}
    fake = _fake_nvml(monkeypatch, [])

    def lock(h, lo, hi):
        if fail["on"] and h == "nvml1" and lo == 1410:
            raise RuntimeError("NVMLError_Unknown")  # transient, not a refusal of rights
        held[h] = lo

    fake.nvmlDeviceSetGpuLockedClocks = lock
    fake.nvmlDeviceResetGpuLockedClocks = lambda h: held.pop(h, None)
    be = FakeBackend()
    seen = []
    measure = be.measure
    be.measure = lambda p, c, w: seen.append(dict(held)) or measure(p, c, w)
    prof = Profiler(ProfilerConfig(cooldown={"name": "thermal"}), be, Journal.open(tmp_path / "j.sqlite", "h"),
                    frequency=FREQUENCY_CONTROLLERS.build("nvml", be, config={"devices": [0, 1]}))
    with prof:
        prof.measure(PART, cand(sms=4, f=1005))
        monkeypatch.setattr(prof.cooldown, "_wants_reference", lambda *a: True)  # a new reference is due ...
        fail["on"] = True  # ... and its 1410 MHz lock fails on GPU 1 alone
        m = prof.measure(PART, cand(sms=8, f=1005))
    assert not m.failed and seen[-1] == {"nvml0": 1005, "nvml1": 1005}


def test_a_second_interrupt_during_the_reset_still_unlocks_every_gpu(monkeypatch):
    """A double Ctrl-C: the second lands while GPU 0 is being reset; GPU 1 stayed locked at 1005 MHz."""
    held: dict = {}
    fake = _fake_nvml(monkeypatch, [])
    fake.nvmlDeviceSetGpuLockedClocks = lambda h, lo, hi: held.__setitem__(h, lo)

    def reset(h):
        held.pop(h, None)
        if h == "nvml0":
            raise KeyboardInterrupt  # the second press

    fake.nvmlDeviceResetGpuLockedClocks = reset
    with pytest.raises(KeyboardInterrupt):
        with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0, 1]}) as ctl:
            ctl.set(1005)
            raise KeyboardInterrupt  # the first press
    assert held == {}


def test_a_clock_the_simulated_gpu_refused_is_journaled_without_a_clock(tmp_path):
    import sqlite3

    be = FakeBackend()
    set_clock = be.set_clock

    def refuse_1005(mhz):
        if mhz == 1005:
            raise ValueError("clock 1005 MHz refused")
        set_clock(mhz)

    be.set_clock = refuse_1005
    with Profiler(ProfilerConfig(), be, Journal.open(tmp_path / "j.sqlite", "h")) as prof:
        got = prof.evaluator(PART)([cand(f=1410), cand(sms=8, f=1005)], None)
    assert got[1].failed
    with sqlite3.connect(tmp_path / "j.sqlite") as con:
        rows = dict(con.execute("SELECT freq_mhz, clock_mhz FROM measurements").fetchall())
    assert rows == {1410: 1410, 1005: None}


def test_a_controller_that_never_locked_resets_nothing(monkeypatch):
    calls: list = []
    _denying_nvml(monkeypatch, calls)
    with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]}):
        pass
    assert calls == ["shutdown"]


def test_a_clock_the_gpu_lacks_is_refused_before_the_gpu_is_locked(monkeypatch):
    calls: list = []
    _fake_nvml(monkeypatch, calls)
    be = FakeBackend()
    with FREQUENCY_CONTROLLERS.build("nvml", be, config={"devices": [0]}) as ctl:
        with pytest.raises(ValueError, match="no locked clock 1207 MHz"):
            ctl.set(1207)
        assert ctl.locked is None and not any(c[0] == "lock" for c in calls if isinstance(c, tuple))


def _fake_zeus(monkeypatch, calls: list) -> None:
    class GPU:
        def __init__(self, i):
            self.i = i

        def set_gpu_locked_clocks(self, lo, hi):
            calls.append(("lock", self.i, lo, hi))

        def reset_gpu_locked_clocks(self):
            calls.append(("reset", self.i))

    class GPUs:
        gpus = [GPU(0), GPU(1)]

        def __len__(self):
            return 2

    zeus = types.ModuleType("zeus")
    device = types.ModuleType("zeus.device")
    device.get_gpus = GPUs
    monkeypatch.setitem(sys.modules, "zeus", zeus)
    monkeypatch.setitem(sys.modules, "zeus.device", device)
    monkeypatch.setattr("kareus.runtime.telemetry._torch_cuda", lambda: None)  # as without a CUDA torch


def test_zeus_controller_locks_and_resets(monkeypatch):
    calls = []
    _fake_zeus(monkeypatch, calls)
    with FREQUENCY_CONTROLLERS.build("zeus", None, config={"devices": [0, 1]}) as ctl:
        ctl.set(1200)
    assert calls == [("lock", 0, 1200, 1200), ("lock", 1, 1200, 1200), ("reset", 0), ("reset", 1)]


def test_zeus_controller_locks_only_this_ranks_gpu_by_default(monkeypatch):
    calls = []
    _fake_zeus(monkeypatch, calls)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second rank on this node
    with FREQUENCY_CONTROLLERS.build("zeus", None, config={}) as ctl:
        ctl.set(1200)
    assert calls == [("lock", 1, 1200, 1200), ("reset", 1)]


# -- which GPU a controller locks: this process's own, matched to NVML by UUID ---------------------------
UUIDS = {i: f"5f2a9c1e-0000-0000-0000-00000000000{i}" for i in range(8)}


def _fake_nvml(monkeypatch, calls: list) -> types.ModuleType:
    """pynvml whose NVML order differs from CUDA's: NVML index i holds the GPU with UUID ``UUIDS[7 - i]``."""
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: calls.append("init")
    fake.nvmlShutdown = lambda: calls.append("shutdown")
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"nvml{i}"
    fake.nvmlDeviceGetHandleByUUID = lambda u: f"nvml{7 - int(u[-1])}" if u.startswith("GPU-") else "bad-uuid"
    fake.nvmlDeviceGetIndex = lambda h: int(h[4:])
    fake.nvmlDeviceSetGpuLockedClocks = lambda h, lo, hi: calls.append(("lock", h, lo))
    fake.nvmlDeviceResetGpuLockedClocks = lambda h: calls.append(("reset", h))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


class FakeCuda:
    """torch.cuda of a CUDA build: ``current`` is the device set (None: CUDA not initialised yet)."""

    def __init__(self, current: int | None) -> None:
        self.current = current

    def is_initialized(self) -> bool:
        return self.current is not None

    def current_device(self) -> int:
        return self.current

    def get_device_properties(self, i: int):
        return types.SimpleNamespace(uuid=UUIDS[i])  # torch prints the UUID without NVML's "GPU-"


def _locked(monkeypatch, cuda, env: dict, config: dict | None = None) -> list:
    calls: list = []
    _fake_nvml(monkeypatch, calls)
    monkeypatch.setattr("kareus.runtime.telemetry._torch_cuda", lambda: cuda)
    for key in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ctl = FREQUENCY_CONTROLLERS.build("nvml", None, config=config or {})
    ctl.set(1005)
    ctl.__exit__(None, None, None)
    return [c[1] for c in calls if isinstance(c, tuple) and c[0] == "lock"]


def test_nvml_controller_locks_the_gpu_of_local_rank_before_cuda_starts(monkeypatch):
    # torchrun rank 3, no CUDA_VISIBLE_DEVICES, torch has not touched CUDA: LOCAL_RANK's GPU by its UUID
    assert _locked(monkeypatch, FakeCuda(None), {"LOCAL_RANK": "3"}) == ["nvml4"]


def test_nvml_controller_locks_the_current_device_only(monkeypatch):
    # every rank sees four GPUs; rank 3 set its device: only that one is locked, not all four
    assert _locked(monkeypatch, FakeCuda(3), {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LOCAL_RANK": "3"}) == ["nvml4"]


def test_nvml_controller_without_torch_reads_uuids_and_indices_from_the_environment(monkeypatch):
    env = {"CUDA_VISIBLE_DEVICES": f"GPU-{UUIDS[6]},GPU-{UUIDS[2]}", "LOCAL_RANK": "1"}
    assert _locked(monkeypatch, None, env) == ["nvml5"]
    assert _locked(monkeypatch, None, {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_RANK": "1"}) == ["nvml5"]
    assert _locked(monkeypatch, FakeCuda(0), {}, {"devices": [2, 3]}) == ["nvml2", "nvml3"]  # configured: as given


def test_energy_telemetry_reads_the_gpu_the_controller_locks(monkeypatch):
    from kareus.runtime.telemetry import nvml_index

    assert _locked(monkeypatch, FakeCuda(2), {"LOCAL_RANK": "2"}) == ["nvml5"]
    assert nvml_index(2) == 5  # the backend's NVMLDevice (energy, temperature, clock) opens the same GPU
    assert nvml_index(2, override=1) == 1


def test_nvml_controller_locks_the_gpu_the_backend_names_by_nvml_index(monkeypatch):
    """hardware.nvml_index points the backend's energy, clock and temperature reads at one NVML GPU; the
    controller locked the CUDA device's own (by UUID) beside it, so every window read another GPU."""
    calls: list = []
    _fake_nvml(monkeypatch, calls)
    monkeypatch.setattr("kareus.runtime.telemetry._torch_cuda", lambda: FakeCuda(2))
    backend = types.SimpleNamespace(cfg=types.SimpleNamespace(nvml_index=1), set_clock=lambda mhz: None,
                                    gpu=types.SimpleNamespace(check_clock=lambda mhz: None))
    ctl = FREQUENCY_CONTROLLERS.build("nvml", backend, config={})
    ctl.set(1005)
    ctl.__exit__(None, None, None)
    assert [c[1] for c in calls if isinstance(c, tuple)] == ["nvml1", "nvml1"]  # locked, then reset


def _zeus_with_handles(monkeypatch, calls: list) -> None:
    """Zeus's GPUs over NVML handles in NVML order (no CUDA_VISIBLE_DEVICES): member i holds ``nvml{i}``."""
    _fake_zeus(monkeypatch, calls)
    _fake_nvml(monkeypatch, [])
    gpus = sys.modules["zeus.device"].get_gpus
    for i, gpu in enumerate(gpus.gpus):
        gpu.handle = f"nvml{i}"
    monkeypatch.setattr(gpus, "gpus", list(gpus.gpus))


@pytest.mark.parametrize("handles", [True, False])
def test_zeus_controller_locks_the_gpu_the_backend_names_by_nvml_index(monkeypatch, handles):
    """As with NVML: hardware.nvml_index names the GPU the backend reads, and Zeus's controller locked
    the CUDA device's own GPU instead (LOCAL_RANK 0 here, NVML GPU 1 named)."""
    calls: list = []
    (_zeus_with_handles if handles else _fake_zeus)(monkeypatch, calls)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "" if handles else "3,1")
    backend = types.SimpleNamespace(cfg=types.SimpleNamespace(nvml_index=1), set_clock=lambda mhz: None,
                                    gpu=types.SimpleNamespace(check_clock=lambda mhz: None))
    with FREQUENCY_CONTROLLERS.build("zeus", backend, config={}) as ctl:
        ctl.set(1005)
    assert calls == [("lock", 1, 1005, 1005), ("reset", 1)]


def test_zeus_refuses_an_nvml_index_it_does_not_see(monkeypatch):
    from kareus.runtime.telemetry import zeus_index

    calls: list = []
    _fake_zeus(monkeypatch, calls)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with pytest.raises(ValueError, match=r"hardware.nvml_index: NVML GPU 2 is not among Zeus's GPUs"):
        zeus_index(sys.modules["zeus.device"].get_gpus(), 0, 2)


def test_zeus_energy_reads_the_gpu_the_backend_names_by_nvml_index(monkeypatch):
    from kareus.runtime.telemetry import energy_meter

    calls: list = []
    _zeus_with_handles(monkeypatch, calls)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = types.ModuleType("zeus.monitor")
    monitor.ZeusMonitor = lambda gpu_indices, **kw: types.SimpleNamespace(gpu_indices=gpu_indices)
    monkeypatch.setitem(sys.modules, "zeus.monitor", monitor)
    assert energy_meter("zeus", None, 0, 1).monitor.gpu_indices == [1]
    assert energy_meter("zeus", None, 0).monitor.gpu_indices == [0]


def test_a_signal_handled_inside_the_lock_call_still_resets_that_gpu(monkeypatch):
    """pynvml's lock is Python around the driver call: a SIGTERM handled inside it raised SystemExit
    after the clock was locked, before the controller counted the GPU as held, so nothing reset it."""
    calls: list = []
    fake = _fake_nvml(monkeypatch, calls)

    def locked_then_signalled(h, lo, hi):
        calls.append(("lock", h, lo))
        raise SystemExit(143)

    fake.nvmlDeviceSetGpuLockedClocks = locked_then_signalled
    with pytest.raises(SystemExit):
        with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]}) as ctl:
            ctl.set(1005)
    assert [c for c in calls if isinstance(c, tuple)] == [("lock", "nvml0", 1005), ("reset", "nvml0")]


# -- SIGTERM while clocks are locked ---------------------------------------------------------------------
def test_controller_turns_sigterm_into_exit_while_locked_and_restores_the_handler(monkeypatch):
    """SIGTERM at its default kills without unwinding, leaving the GPU locked for whoever runs next."""
    import signal

    calls = []
    _fake_nvml(monkeypatch, calls)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ctl = FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]})
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # nothing locked yet: untouched
        ctl.set(1005)
        handler = signal.getsignal(signal.SIGTERM)
        assert handler is not signal.SIG_DFL
        with pytest.raises(SystemExit) as exit_info:
            handler(signal.SIGTERM, None)
        assert exit_info.value.code == 128 + signal.SIGTERM
        ctl.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and ("reset", "nvml0") in calls
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_handler_the_program_set_keeps_deciding_how_a_locked_run_ends(monkeypatch):
    """Megatron's --exit-signal-handler only sets a flag on SIGTERM; the training loop then saves a
    checkpoint and exits. Replaced by one that raised SystemExit, a preempted job lost its checkpoint."""
    import signal

    _fake_nvml(monkeypatch, [])
    flagged = []
    megatrons = lambda signum, frame: flagged.append(signum)  # noqa: E731
    previous = signal.signal(signal.SIGTERM, megatrons)
    try:
        with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]}) as ctl:
            ctl.set(1005)
            assert signal.getsignal(signal.SIGTERM) is megatrons
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # no SystemExit: the loop saves and exits
            assert flagged == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is megatrons
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_the_process_ignores_stays_ignored_while_locked(monkeypatch):
    """``nohup`` ignores SIGHUP so that a run survives its terminal; locking clocks must not undo that."""
    import signal

    _fake_nvml(monkeypatch, [])
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [0]}) as ctl:
            ctl.set(1005)
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            with pytest.raises(SystemExit):  # SIGTERM still unwinds
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


SIGTERM_SCRIPT = """
import os, signal, sys, time, types
calls = []
fake = types.ModuleType("pynvml")
fake.nvmlInit = lambda: None
fake.nvmlShutdown = lambda: calls.append("shutdown")
fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
fake.nvmlDeviceSetGpuLockedClocks = lambda h, lo, hi: calls.append(f"lock:{h}:{lo}")
fake.nvmlDeviceResetGpuLockedClocks = lambda h: calls.append(f"reset:{h}")
sys.modules["pynvml"] = fake
import kareus.profiler
from kareus.registry import FREQUENCY_CONTROLLERS
try:
    with FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [1]}) as ctl:
        ctl.set(1005)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
finally:
    print(",".join(calls), flush=True)
"""


def test_sigterm_to_a_process_with_locked_clocks_resets_them():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + 15, out.stderr
    assert out.stdout.strip() == "lock:h1:1005,reset:h1,shutdown"


# -- config ----------------------------------------------------------------------------------------
def test_problems_reports_every_issue():
    assert ProfilerConfig().problems() == []
    probs = ProfilerConfig(target_window_s=0, repeats=0, retries=-1, cooldown={"name": "nap"},
                           frequency={"name": "sim", "bogus": 1}).problems()
    text = "\n".join(probs)
    assert "target_window_s" in text and "repeats" in text and "retries" in text
    assert "'nap' is unknown; known: compensated, fixed, none, predictive, temperature" in text
    assert "bogus" in text
    assert any("seconds" in p for p in ProfilerConfig(cooldown={"name": "fixed", "seconds": -1}).problems())


def test_yaml_composes_typed_sections():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from kareus.config.store import store_all
    from kareus.registry import to_dataclass

    store_all()
    conf = Path(__file__).resolve().parents[1] / "conf"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("profiler/default", overrides=["profiler/cooldown=temperature", "profiler.cooldown.delta_c=1.5",
                                                         "profiler.repeats=3"])
        with pytest.raises(Exception):
            compose("profiler/default", overrides=["profiler.cooldown.secnds=3"])
    GlobalHydra.instance().clear()
    section = cfg.profiler
    pc = to_dataclass(ProfilerConfig, section)
    assert pc.repeats == 3 and pc.problems() == []
    assert OmegaConf.to_container(section.cooldown) == {"name": "temperature", "delta_c": 1.5, "timeout_s": 30.0,
                                                        "poll_s": 0.5}


def test_three_repeats_keep_every_window():
    """With 3 repeats the MAD is about the smaller gap to the median: normal noise flagged one of three
    windows in about half the candidates (most often the coolest, first one), so fewer than 5 repeats
    are all kept; 5 still drop a real outlier (test_mad_outlier_flagged_and_excluded)."""
    import numpy as np

    from kareus.profiler.stats import mad_outliers

    rng = np.random.default_rng(0)
    triples = rng.normal(1.0, 0.01, size=(2000, 3))
    assert not any(any(mad_outliers(list(t), 3.5)) for t in triples)
    assert mad_outliers([1.0, 1.01, 0.99, 1.0, 1.5], 3.5) == [False, False, False, False, True]
    flagged = sum(any(mad_outliers(list(t), 3.5)) for t in rng.normal(1.0, 0.01, size=(2000, 5)))
    assert flagged < 0.25 * 2000


class NVMLError_FunctionNotFound(Exception):  # pynvml builds one such class per NVML error code
    pass


def _nvml_device(monkeypatch, calls: list, with_v: bool, driver_has_v: bool = True):
    from kareus.runtime.telemetry import NVMLDevice

    fake = _fake_nvml(monkeypatch, calls)
    fake.NVML_TEMPERATURE_GPU = 0
    fake.NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    fake.nvmlDeviceGetTemperature = lambda h, s: calls.append("old") or 61
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda h: 123456  # mJ
    fake.nvmlDeviceGetPowerUsage = lambda h: 250500  # mW

    def temperature_v(h, s):
        calls.append("v")
        if not driver_has_v:
            raise NVMLError_FunctionNotFound()
        return 62

    if with_v:
        fake.nvmlDeviceGetTemperatureV = temperature_v
    return NVMLDevice(0)


@pytest.mark.parametrize("with_v,driver_has_v,reads,calls_made", [
    (True, True, [62, 62], ["v", "v"]),
    (True, False, [61, 61], ["v", "old", "old"]),  # a driver without it: asked once, then the older call
    (False, False, [61, 61], ["old", "old"]),  # an nvidia-ml-py without it
])
def test_nvml_temperature_uses_the_call_that_replaces_the_deprecated_one(monkeypatch, with_v, driver_has_v, reads,
                                                                         calls_made):
    calls: list = []
    device = _nvml_device(monkeypatch, calls, with_v, driver_has_v)
    assert [device.temperature_c(), device.temperature_c()] == reads
    assert [c for c in calls if c in ("v", "old")] == calls_made
    assert device.energy_j() == pytest.approx(123.456) and device.power_w() == pytest.approx(250.5)  # mJ, mW


def test_nvml_is_shut_down_when_its_gpu_cannot_be_opened(monkeypatch):
    from kareus.runtime.telemetry import NVMLDevice

    calls: list = []
    fake = _fake_nvml(monkeypatch, calls)

    def missing(i):
        raise RuntimeError("invalid argument")

    fake.nvmlDeviceGetHandleByIndex = missing
    with pytest.raises(RuntimeError):
        NVMLDevice(9)
    with pytest.raises(RuntimeError):
        FREQUENCY_CONTROLLERS.build("nvml", None, config={"devices": [9]})
    assert calls == ["init", "shutdown", "init", "shutdown"]
