"""The simulated GPU backend (``hardware=a100_sim``, the default): physics from model.py plus state.

State is what makes profiling on it realistic: a thermal state (back-to-back windows run hotter and
read more energy through temperature-dependent static power), an NVML-like energy counter that
updates every ``counter_period_s`` (short windows are quantized), seeded noise, a board power cap
that throttles the clock, and a virtual clock (``now``) that windows and cooldowns advance.

Reading noise is drawn per window from a stream of its own, keyed by the seed, what the window
measures and how many windows measured it before: a reading depends on the GPU's state (its heat)
but not on which other windows (a policy's probes and anchors, other candidates) drew noise first,
so two profiling policies over the same candidates compare without reading noise in between.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

from kareus.hardware.base import GPUSpec, LockedClock
from kareus.hardware.model import Outcome, simulate, simulate_partition
from kareus.hardware.sim_config import SimConfig
from kareus.registry import HARDWARE
from kareus.types import Candidate, Op, PartitionType, Reading


class SimulatedGPU(LockedClock):
    """One simulated GPU of a TP group; readings are per GPU for one execution of the partition."""

    def __init__(self, cfg: SimConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.gpu: GPUSpec = cfg.gpu_spec()
        self.name = f"sim:{cfg.gpu}"
        self._seed = seed
        self._draws: dict[str, int] = {}  # windows taken per noise key
        self._clock = self.gpu.max_mhz
        self._temp = self.idle_temperature()
        self._now = 0.0
        self._power = cfg.idle_power_w  # power since the last state change (the counter integrates it)
        self._phase = random.Random(f"{seed}|phase").uniform(0.0, cfg.counter_period_s)
        self._cache: dict[tuple, Outcome] = {}

    # -- clock, temperature, virtual time ----------------------------------------------------------


    def temperature(self) -> float:
        return self._temp

    def idle_temperature(self) -> float:
        return self.cfg.ambient_c + self.cfg.thermal_r_c_per_w * self.cfg.idle_power_w

    def now(self) -> float:
        return self._now

    def idle(self, seconds: float) -> None:
        """A cooldown: the GPU idles and cools toward its idle temperature; never sleeps."""
        if seconds <= 0:
            return
        self._temp = self._relax(self.idle_temperature(), seconds)[0]
        self._power = self.cfg.idle_power_w
        self._now += seconds

    # -- physics with the power cap ----------------------------------------------------------------
    def outcome(self, partition: PartitionType | None, slot: str, sms: int, mhz: int,
                ops: Sequence[Op] = ()) -> Outcome:
        """Noise-free execution at ``mhz``, throttled down in clock steps while it exceeds the TDP."""
        key = (partition.key if partition is not None else tuple(ops), slot, sms, mhz)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        f = mhz
        while True:
            if partition is not None:
                out = simulate_partition(self.cfg, partition, slot, sms, f)
            else:
                out = simulate(self.cfg, tuple(ops), None, f, 0, None, None, host_gap=False)
            power = self.steady_power(out)
            if power <= self.cfg.tdp_w or f - self.gpu.step_mhz < self.gpu.min_mhz:
                break
            f -= self.gpu.step_mhz
        self._cache[key] = out
        return out

    def steady_power(self, out: Outcome) -> float:
        """Board power of ``out`` run without end, at the temperature it settles to: what the power cap
        judges. Static power grows with the temperature that the power itself sets, so the two are
        solved together (linear in the temperature; ``problems`` keeps the loop gain below 1)."""
        if out.time_s <= 0:
            return 0.0
        c = self.cfg
        dyn_w = out.dynamic_j / out.time_s
        s = c.static_power_w * out.static_scale
        gain = c.thermal_r_c_per_w * s * c.static_temp_coeff
        temp = (c.ambient_c + c.thermal_r_c_per_w * (dyn_w + s * (1.0 - c.static_temp_coeff * c.static_ref_c))) / (1.0 - gain)
        return dyn_w + self._static_w(out, temp)

    def _static_w(self, out: Outcome, temp_c: float) -> float:
        c = self.cfg
        return c.static_power_w * out.static_scale * max(0.0, 1.0 + c.static_temp_coeff * (temp_c - c.static_ref_c))

    def _relax(self, target: float, seconds: float) -> tuple[float, float]:
        """(end temperature, mean temperature) after ``seconds`` relaxing toward ``target``."""
        tau = self.cfg.thermal_tau_s
        decay = math.exp(-seconds / tau)
        end = target + (self._temp - target) * decay
        mean = target + (self._temp - target) * tau / seconds * (1.0 - decay)
        return end, mean

    # -- measurements ------------------------------------------------------------------------------
    def run_once(self, partition: PartitionType, candidate: Candidate) -> float:
        self.check_clock(candidate)
        t = self.outcome(partition, candidate.slot, candidate.sms, self._clock).time_s
        self._now += t
        return t

    def measure(self, partition: PartitionType, candidate: Candidate, window_s: float) -> Reading:
        self.check_clock(candidate)
        if not 0 < candidate.sms < self.gpu.sms:
            raise ValueError(f"comm SMs must be in 1..{self.gpu.sms - 1}, got {candidate.sms}")
        out = self.outcome(partition, candidate.slot, candidate.sms, self._clock)
        return self._window(out, window_s, f"{partition.key}|{candidate.slot}|{candidate.sms}|{self._clock}")

    def measure_ops(self, ops: Sequence[Op], window_s: float) -> Reading:
        return self._window(self.outcome(None, "ops", 0, self._clock, ops), window_s, f"ops|{ops!r}|{self._clock}")

    def space(self, partition: PartitionType) -> list[Candidate] | None:
        return None


    def _noise(self, key: str) -> random.Random:
        """The noise stream of the next window measuring ``key`` (see the module docstring)."""
        n = self._draws.get(key, 0)
        self._draws[key] = n + 1
        return random.Random(f"{self._seed}|{key}|{n}")

    def _window(self, out: Outcome, window_s: float, key: str) -> Reading:
        c = self.cfg
        rng = self._noise(key)
        period = c.counter_period_s
        if window_s < period:
            self._now += max(window_s, 0.0)
            return Reading(math.nan, math.nan, self._temp, out.freq_mhz, window_s, 0, False,
                           f"window {window_s:.3g} s is shorter than the energy counter's {period:g} s update period")
        t = out.time_s * (1.0 + c.time_noise * rng.gauss(0.0, 1.0))
        n = max(1, round(window_s / t))
        w = n * t
        if c.fail_rate > 0 and rng.random() < c.fail_rate:
            self._now += w
            return Reading(math.nan, math.nan, self._temp, out.freq_mhz, w, n, False, "injected failure (fail_rate)")
        dyn_w = out.dynamic_j / out.time_s
        power = dyn_w + self._static_w(out, self._temp)
        for _ in range(2):  # the temperature follows the power; static power follows the temperature
            end, mean = self._relax(c.ambient_c + c.thermal_r_c_per_w * power, w)
            power = dyn_w + self._static_w(out, mean)
        power *= 1.0 + c.power_noise * rng.gauss(0.0, 1.0)
        start = self._now
        stop = start + w
        # the counter holds the energy up to its last update; power before the window was self._power
        u0 = self._last_update(start)
        u1 = self._last_update(stop)
        self._now = stop
        self._temp = end
        previous, self._power = self._power, power
        if u1 < start:  # a window of whole executions that came out shorter than the period can miss every update
            return Reading(math.nan, math.nan, self._temp, out.freq_mhz, w, n, False,
                           f"window {w:.3g} s saw no update of the energy counter ({period:g} s period)")
        counted = power * (u1 - start) + previous * (start - u0)
        return Reading(w / n, counted / n, self._temp, out.freq_mhz, w, n)

    def _last_update(self, x: float) -> float:
        p = self.cfg.counter_period_s
        return self._phase + math.floor((x - self._phase) / p) * p


@HARDWARE.register("sim", SimConfig)
def build_sim(cfg: SimConfig, seed: int = 0) -> SimulatedGPU:
    """Simulated GPU calibrated from datasheets, the published paper and the real A100 table."""
    return SimulatedGPU(cfg, seed)
