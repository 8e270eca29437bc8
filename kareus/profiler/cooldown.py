"""Cooldown policies: how long the GPU idles after a measurement so the next one starts cool.

Each policy is registered in ``COOLDOWNS`` with its config dataclass; ``cool(backend)`` idles the
backend (real sleep on GPUs, virtual time on the simulated GPU) and returns the seconds it idled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from kareus.hardware.base import HardwareBackend
from kareus.registry import COOLDOWNS


class CooldownPolicy(Protocol):
    def cool(self, backend: HardwareBackend) -> float:
        """Idle the GPU as the policy says; return the seconds idled."""


@dataclass
class FixedCooldownConfig:
    name: str = "fixed"
    seconds: float = 5.0  # the published protocol

    def problems(self, ctx: Any = None) -> list[str]:
        return [] if self.seconds >= 0 else [f"seconds={self.seconds} must be >= 0"]


@COOLDOWNS.register("fixed", FixedCooldownConfig)
class FixedCooldown:
    """Idle a fixed time after every measurement (the published 5 s)."""

    def __init__(self, cfg: FixedCooldownConfig) -> None:
        self.cfg = cfg

    def cool(self, backend: HardwareBackend) -> float:
        if self.cfg.seconds > 0:
            backend.idle(self.cfg.seconds)
        return self.cfg.seconds


@dataclass
class NoCooldownConfig:
    name: str = "none"


@COOLDOWNS.register("none", NoCooldownConfig)
class NoCooldown:
    """Measure back to back: cheapest, biased by the heat the previous candidate left."""

    def __init__(self, cfg: NoCooldownConfig) -> None:
        self.cfg = cfg

    def cool(self, backend: HardwareBackend) -> float:
        return 0.0


@dataclass
class TemperatureCooldownConfig:
    name: str = "temperature"
    delta_c: float = 2.0  # done when within this many degrees of the idle temperature
    timeout_s: float = 30.0  # never idle longer than this
    poll_s: float = 0.5  # temperature polling period

    def problems(self, ctx: Any = None) -> list[str]:
        out = []
        if self.delta_c < 0:
            out.append(f"delta_c={self.delta_c} must be >= 0")
        if self.timeout_s < 0:
            out.append(f"timeout_s={self.timeout_s} must be >= 0")
        if self.poll_s <= 0:
            out.append(f"poll_s={self.poll_s} must be > 0")
        return out


@COOLDOWNS.register("temperature", TemperatureCooldownConfig)
class TemperatureCooldown:
    """Poll the temperature until it is within ``delta_c`` of idle (or ``timeout_s`` passed)."""

    def __init__(self, cfg: TemperatureCooldownConfig) -> None:
        self.cfg = cfg

    def cool(self, backend: HardwareBackend) -> float:
        target = backend.idle_temperature() + self.cfg.delta_c
        waited = 0.0
        while backend.temperature() > target and waited < self.cfg.timeout_s - 1e-12:
            step = min(self.cfg.poll_s, self.cfg.timeout_s - waited)
            backend.idle(step)
            waited += step
        return waited


@dataclass
class PredictiveCooldownConfig:
    """Cool exactly as long as a first-order thermal model, fitted online, says is needed.

    Instead of polling (each poll costs an NVML call and rounds the wait up to the poll period) it
    fits the cooling time constant from the temperatures it sees and idles once for
    ``tau * ln((T - T_idle) / delta_c)``, then tops up by polling if the model was optimistic.
    """

    name: str = "predictive"
    delta_c: float = 2.0  # target: within this many degrees of idle
    tau_s: float = 10.0  # initial guess of the cooling time constant, refined from observations
    timeout_s: float = 30.0
    poll_s: float = 0.25  # top-up polling period when the prediction fell short

    def problems(self, ctx: Any = None) -> list[str]:
        out = []
        if self.delta_c <= 0:
            out.append(f"delta_c={self.delta_c} must be > 0")
        if self.tau_s <= 0:
            out.append(f"tau_s={self.tau_s} must be > 0")
        if self.timeout_s < 0:
            out.append(f"timeout_s={self.timeout_s} must be >= 0")
        if self.poll_s <= 0:
            out.append(f"poll_s={self.poll_s} must be > 0")
        return out


@COOLDOWNS.register("predictive", PredictiveCooldownConfig)
class PredictiveCooldown:
    """Idle once for the predicted cooling time; learn the time constant from each cooldown."""

    def __init__(self, cfg: PredictiveCooldownConfig) -> None:
        self.cfg = cfg
        self.tau = cfg.tau_s
        self._fits: list[float] = []

    def cool(self, backend: HardwareBackend) -> float:
        idle_t = backend.idle_temperature()
        t0 = backend.temperature()
        excess = t0 - idle_t
        if excess <= self.cfg.delta_c:
            return 0.0
        wait = min(self.tau * math.log(excess / self.cfg.delta_c), self.cfg.timeout_s)
        waited = 0.0
        if wait > 0:
            backend.idle(wait)
            waited = wait
            t1 = backend.temperature()
            self._learn(excess, t1 - idle_t, wait)
        while backend.temperature() > idle_t + self.cfg.delta_c and waited < self.cfg.timeout_s - 1e-12:
            step = min(self.cfg.poll_s, self.cfg.timeout_s - waited)
            backend.idle(step)
            waited += step
        return waited

    def _learn(self, before: float, after: float, seconds: float) -> None:
        """Refit tau from one exponential decay (median of fits: robust to odd readings)."""
        if before <= 0 or after <= 0 or after >= before or seconds <= 0:
            return
        self._fits.append(seconds / math.log(before / after))
        fits = sorted(self._fits[-15:])
        self.tau = fits[len(fits) // 2]


@dataclass
class CompensatedCooldownConfig:
    """Do not wait for the heat to leave: measure how much energy it adds, and take that out.

    Residual heat biases a window through temperature-dependent static (leakage) power, and a GPU's
    leakage slope dP/dT does not depend on the workload, only on the clock (voltage). So once per GPU
    a probe fits it: ``cycles`` times, idle ``probe_idle_s``, then run windows back to back at the
    top clock (the GPU heats) and then at a low clock (it cools), and regress each window's power on
    its mean temperature per clock; the heating curve also gives the thermal time constant. A window
    that starts ``dT0`` above idle then runs on average ``dT0 * tau/W * (1 - exp(-W/tau))`` hotter
    than a fully cooled one; that much leakage energy is subtracted (the raw readings stay in the
    journal, the measurement carries a ``thermal:`` flag). The profiler keeps the fit in the journal,
    so every partition search of a run on that GPU, and a resumed run, reuse it.
    """

    name: str = "compensated"
    seconds: float = 0.0  # idle after each candidate anyway
    cycles: int = 2  # heat/cool sweeps of the probe
    probe_idle_s: float = 30.0  # idle before each sweep (spreads the temperatures seen)
    probe_windows: int = 8  # windows per clock per sweep (long sweeps span more degrees)
    probe_window_s: float = 10.0  # longer than the profiling window: less counter quantization
    probe_clocks: list[int] = field(default_factory=list)  # [] = the top clock and ~60% of it
    tau_s: float = 25.0  # fallback time constant when the probe cannot fit one
    min_span_c: float = 1.0  # a probe spanning fewer degrees cannot fit a slope: no correction then

    def problems(self, ctx: Any = None) -> list[str]:
        out = []
        if self.seconds < 0 or self.probe_idle_s < 0:
            out.append("seconds and probe_idle_s must be >= 0")
        if self.cycles < 1 or self.probe_windows < 2 or self.probe_window_s <= 0:
            out.append("cycles >= 1, probe_windows >= 2 and probe_window_s > 0 are required")
        if self.tau_s <= 0:
            out.append(f"tau_s={self.tau_s} must be > 0")
        return out


def _within_slope(groups: list[tuple[list[float], list[float]]]) -> float:
    """One slope for several sweeps, each with its own intercept (pooled within-group regression)."""
    sxy = sxx = 0.0
    for xs, ys in groups:
        if len(xs) < 2:
            continue
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxy += sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        sxx += sum((x - mx) ** 2 for x in xs)
    return sxy / sxx if sxx > 0 else 0.0


@COOLDOWNS.register("compensated", CompensatedCooldownConfig)
class CompensatedCooldown:
    """Short (or no) cooldown plus a fitted leakage correction of each window's energy."""

    def __init__(self, cfg: CompensatedCooldownConfig) -> None:
        self.cfg = cfg
        self.calibrated = False
        self.tau = cfg.tau_s
        self.slopes: dict[int, float] = {}  # clock -> dP/dT (W per degree C)
        self.probe_seconds = 0.0  # GPU-time the probe took (0 when loaded from the journal)

    def cool(self, backend: HardwareBackend) -> float:
        if self.cfg.seconds > 0:
            backend.idle(self.cfg.seconds)
        return self.cfg.seconds

    # -- the fitted state, kept in the journal ---------------------------------------------------
    def state(self) -> dict:
        return {"tau_s": self.tau, "slopes": {str(k): v for k, v in self.slopes.items()}}

    def load_state(self, state: dict) -> None:
        self.tau = float(state["tau_s"])
        self.slopes = {int(k): float(v) for k, v in state["slopes"].items()}
        self.calibrated = True

    # -- the probe -------------------------------------------------------------------------------
    def probe_clocks(self, backend: HardwareBackend) -> list[int]:
        if self.cfg.probe_clocks:
            return sorted(set(int(f) for f in self.cfg.probe_clocks), reverse=True)
        g = backend.gpu
        low = g.max_mhz - ((g.max_mhz - max(g.min_mhz, int(0.6 * g.max_mhz))) // g.step_mhz) * g.step_mhz
        return [g.max_mhz, low] if low < g.max_mhz else [g.max_mhz]

    def calibrate(self, backend: HardwareBackend, read_at) -> None:
        """Fit leakage slopes and tau from heat/cool sweeps; ``read_at(mhz, window_s) -> Reading``."""
        self.calibrated = True
        began = backend.now()
        clocks = self.probe_clocks(backend)
        sweeps: dict[int, list[list[tuple[float, float, float]]]] = {f: [] for f in clocks}  # (t0, t1, power)
        taus: list[float] = []
        w = self.cfg.probe_window_s
        for _ in range(self.cfg.cycles):
            backend.idle(self.cfg.probe_idle_s)
            for mhz in clocks:
                points: list[tuple[float, float, float]] = []
                ends = [backend.temperature()]
                for j in range(self.cfg.probe_windows + 1):
                    t0 = backend.temperature()
                    try:
                        r = read_at(mhz, w)
                    except Exception:
                        r = None
                    ends.append(backend.temperature())
                    # the first window's counter still holds the power before it (other clock or idle)
                    if j == 0 or r is None or not r.ok or not (r.time_s > 0 and r.energy_j > 0):
                        continue
                    points.append((t0, ends[-1], r.energy_j / r.time_s))
                sweeps[mhz].append(points)
                d = [b - a for a, b in zip(ends, ends[1:])]
                num = sum(a * b for a, b in zip(d, d[1:]))
                den = sum(a * a for a in d[:-1])
                ratio = num / den if den > 0 else 0.0
                if 0.0 < ratio < 1.0 and abs(ends[-1] - ends[0]) >= self.cfg.min_span_c:
                    taus.append(-w / math.log(ratio))
        if taus:
            self.tau = sorted(taus)[len(taus) // 2]
        decay = math.exp(-w / self.tau)
        g = self.tau / w * (1.0 - decay)

        def mean_c(t0: float, t1: float) -> float:  # a window's mean temperature on the exponential
            target = (t1 - t0 * decay) / (1.0 - decay)
            return target + (t0 - target) * g

        for mhz, groups in sweeps.items():
            fit = [([mean_c(a, b) for a, b, _ in pts], [p for _, _, p in pts]) for pts in groups]
            seen = [t for xs, _ in fit for t in xs]
            if len(seen) >= 3 and max(seen) - min(seen) >= self.cfg.min_span_c:
                self.slopes[mhz] = float(max(0.0, _within_slope(fit)))
        self.probe_seconds = backend.now() - began

    # -- the correction --------------------------------------------------------------------------
    def slope_at(self, mhz: float) -> float:
        """Leakage slope at a clock: linear between probed clocks, constant beyond them."""
        if not self.slopes:
            return 0.0
        pts = sorted(self.slopes.items())
        if mhz <= pts[0][0]:
            return pts[0][1]
        for (f0, k0), (f1, k1) in zip(pts, pts[1:]):
            if mhz <= f1:
                return k0 + (k1 - k0) * (mhz - f0) / (f1 - f0)
        return pts[-1][1]

    def excess_energy(self, reading, start_c: float, idle_c: float) -> float:
        """Energy per execution the window's residual heat added, against a fully cooled start."""
        d0 = max(0.0, start_c - idle_c)
        w = max(reading.window_s, 1e-9)
        mean_excess = d0 * self.tau / w * (1.0 - math.exp(-w / self.tau))
        return self.slope_at(reading.freq_mhz) * mean_excess * reading.time_s
