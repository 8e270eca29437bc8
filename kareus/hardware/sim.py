"""The simulated GPU backend (``hardware=a100_sim``, the default): physics from model.py plus state.

State is what makes profiling on it realistic: a thermal state (back-to-back windows run hotter and
read more energy through temperature-dependent static power; every execution heats, read or not), an
NVML-like energy counter that integrates what the GPU draws and updates every ``counter_period_s``
(short windows are quantized, and a reading reaches back to the update before the window), seeded
noise, a board power cap that throttles the clock, and a virtual clock (``now``) that executions,
windows and cooldowns advance.

Reading noise is drawn per window from a stream of its own, keyed by the seed, what the window
measures and how many windows measured it before: a reading depends on the GPU's state (its heat)
but not on which other windows (a policy's probes and anchors, other candidates) drew noise first,
so two profiling policies over the same candidates compare without reading noise in between.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Sequence

from kareus.hardware.base import GPUSpec, LockedClock
from kareus.hardware.heat import HeatNetwork
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
        # heat physics of another form (heat.py), integrated numerically; None: the shipped model, exact
        self._net = HeatNetwork(cfg, self._temp) if cfg.heat_options_on else None
        self._now = 0.0
        self._drawn: list[tuple[float, float, float]] = []  # (start, end, W) of the last counter periods
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
        if self._net is not None:
            self._net.run(lambda _: self.cfg.idle_power_w, seconds)
            self._temp = self._net.temperature()
        else:
            self._temp = self._relax(self.idle_temperature(), seconds)
        self._advance(seconds, self.cfg.idle_power_w)

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
        if self.cfg.drift:  # the same power for longer: time and dynamic energy scale alike
            k = 1.0 + self.cfg.drift
            out = dataclasses.replace(out, time_s=out.time_s * k, dynamic_j=out.dynamic_j * k,
                                      overlap_s=out.overlap_s * k, exposed_comm_s=out.exposed_comm_s * k)
        self._cache[key] = out
        return out

    def steady_power(self, out: Outcome) -> float:
        """Board power of ``out`` run without end, at the temperature it settles to: what the power cap
        judges."""
        if out.time_s <= 0:
            return 0.0
        if self._net is not None:
            return self._draw(out, self._net.settle(lambda t: self._draw(out, t)))
        return out.dynamic_j / out.time_s + self._static_w(out, self._settling(out)[0])

    def _draw(self, out: Outcome, temp_c: float) -> float:
        """Board power of ``out`` run back to back at die temperature ``temp_c``."""
        return out.dynamic_j / out.time_s + self._static_w(out, temp_c)

    def _settling(self, out: Outcome) -> tuple[float, float]:
        """(temperature, time constant) that running ``out`` settles toward. Static power grows with
        the temperature the power itself sets, a loop of gain g (``SimConfig.thermal_loop_gain`` at the
        setting's voltage; below 1, ``problems``): the two settle together, at a temperature 1/(1 - g)
        further and a time constant 1/(1 - g) longer than without the loop. Linear while static power
        is above its 0 W floor."""
        c = self.cfg
        s = c.static_power_w * out.static_scale
        loop = 1.0 - c.thermal_loop_gain * out.static_scale
        drive = c.ambient_c + c.thermal_r_c_per_w * (out.dynamic_j / out.time_s + s * (1.0 - c.static_temp_coeff * c.static_ref_c))
        return drive / loop, c.thermal_tau_s / loop

    def _static_w(self, out: Outcome, temp_c: float) -> float:
        c = self.cfg
        return c.static_power_w * out.static_scale * max(0.0, c.static_scale_at(temp_c))

    def _heat(self, out: Outcome, seconds: float) -> float:
        """Run ``out`` back to back for ``seconds``: the temperature follows the power and static power
        the temperature (solved exactly, so how a stretch is split into calls does not matter). Returns
        the mean power; every execution heats the GPU, read or not."""
        if seconds <= 0 or out.time_s <= 0:
            return self.cfg.idle_power_w
        if self._net is not None:
            mean = self._net.run(lambda t: self._draw(out, t), seconds)
            self._temp = self._net.temperature()
            return mean
        settled, tau = self._settling(out)
        decay = math.exp(-seconds / tau)
        mean = settled + (self._temp - settled) * tau / seconds * (1.0 - decay)
        self._temp = settled + (self._temp - settled) * decay
        return out.dynamic_j / out.time_s + self._static_w(out, mean)

    def _advance(self, seconds: float, watts: float) -> None:
        """The GPU draws ``watts`` for ``seconds``: the virtual clock moves on, the energy counter
        integrates it. What the counter's next reading can reach back to (one period) is kept."""
        if seconds <= 0:
            return
        horizon = self._now - 2 * self.cfg.counter_period_s  # a reading from now on reaches back one period
        while self._drawn and self._drawn[0][1] < horizon:
            self._drawn.pop(0)
        self._drawn.append((self._now, self._now + seconds, watts))
        self._now += seconds

    def _energy(self, a: float, b: float) -> float:
        """Energy the board drew in [a, b] (``a`` at most a period before the last advance): the
        recorded draw, and idle power before the GPU's first record."""
        first = self._drawn[0][0] if self._drawn else b
        e = self.cfg.idle_power_w * max(0.0, min(b, first) - a)
        for s, t, w in self._drawn:
            e += w * max(0.0, min(b, t) - max(a, s))
        return e

    def _relax(self, target: float, seconds: float) -> float:
        """The temperature after ``seconds`` relaxing toward ``target`` (an idle GPU: no loop)."""
        return target + (self._temp - target) * math.exp(-seconds / self.cfg.thermal_tau_s)

    # -- measurements ------------------------------------------------------------------------------
    def run_once(self, partition: PartitionType, candidate: Candidate) -> float:
        self.check_clock(candidate)
        out = self.outcome(partition, candidate.slot, candidate.sms, self._clock)
        self._advance(out.time_s, self._heat(out, out.time_s))
        return out.time_s

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
            self._advance(window_s, self._heat(out, window_s))
            return Reading(math.nan, math.nan, self._temp, out.freq_mhz, window_s, 0, False,
                           f"window {window_s:.3g} s is shorter than the energy counter's {period:g} s update period")
        if out.time_s <= 0:
            return Reading(math.nan, math.nan, self._temp, out.freq_mhz, 0.0, 0, False,
                           "nothing to run: the execution takes no time")
        t = out.time_s * (1.0 + c.time_noise * rng.gauss(0.0, 1.0))
        n = max(1, round(window_s / t))
        w = n * t
        if c.fail_rate > 0 and rng.random() < c.fail_rate:
            self._advance(w, self._heat(out, w))
            return Reading(math.nan, math.nan, self._temp, out.freq_mhz, w, n, False, "injected failure (fail_rate)")
        power = self._heat(out, w) * (1.0 + c.power_noise * rng.gauss(0.0, 1.0))
        start = self._now
        self._advance(w, power)
        # the counter holds the energy up to its last update: a reading spans [u0, u1], not the window
        u0 = self._last_update(start)
        u1 = self._last_update(self._now)
        if u1 < start:  # a window of whole executions that came out shorter than the period can miss every update
            return Reading(math.nan, math.nan, self._temp, out.freq_mhz, w, n, False,
                           f"window {w:.3g} s saw no update of the energy counter ({period:g} s period)")
        return Reading(w / n, self._energy(u0, u1) / n, self._temp, out.freq_mhz, w, n)

    def _last_update(self, x: float) -> float:
        p = self.cfg.counter_period_s
        return self._phase + math.floor((x - self._phase) / p) * p


@HARDWARE.register("sim", SimConfig)
def build_sim(cfg: SimConfig, seed: int = 0) -> SimulatedGPU:
    """Simulated GPU calibrated from datasheets, the published paper and the real A100 table."""
    return SimulatedGPU(cfg, seed)
