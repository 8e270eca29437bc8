"""Cooldown policies: how long the GPU idles after a measurement so the next one starts cool.

Each policy is registered in ``COOLDOWNS`` with its config dataclass; ``cool(backend)`` idles the
backend (real sleep on GPUs, virtual time on the simulated GPU) and returns the seconds it idled.

Policies that correct instead of wait may also implement optional hooks the profiler looks for:
``calibrate(backend, read_at)`` (a one-off probe, ``compensated``), ``before_window(backend,
read_ops_at, mhz)`` (anchor windows in the stream, ``thermal``), ``observe(reading, start_c, end_c,
idle_c)`` (every window's temperatures) and ``excess_energy(reading, start_c, idle_c)`` (the
residual-heat energy per execution to subtract; raw readings are kept), plus ``state()`` /
``load_state()`` so the journal keeps what they learned.

On a tensor-parallel group each rank runs its own policy on its own GPU, but they measure in
lockstep: a decision that changes what a rank runs (an anchor window, one more cooldown poll) must
come out the same on every rank, or their collectives mismatch and the group hangs. Such decisions
go through ``group_max`` (the backend's ``agree_max``; a no-op on a single GPU): cooldowns wait for
the group's hottest GPU, and the group takes an anchor when any of its GPUs calls for one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from kareus.config.bounds import out_of_bounds
from kareus.errors import KareusError
from kareus.hardware.base import HardwareBackend
from kareus.registry import COOLDOWNS
from kareus.types import Op, OpKind


class CooldownPolicy(Protocol):
    def cool(self, backend: HardwareBackend) -> float:
        """Idle the GPU as the policy says; return the seconds idled."""


def group_max(backend: HardwareBackend, value: float) -> float:
    """The largest ``value`` over the backend's group of ranks (the value itself on a single GPU)."""
    agree = getattr(backend, "agree_max", None)
    return float(agree(value)) if callable(agree) else float(value)


def group_all(backend: HardwareBackend, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank of the backend's group (``flag`` itself on a single GPU):
    a rank that acted on its own ``True`` while a peer's was ``False`` would leave collectives unmatched."""
    return group_max(backend, 0.0 if flag else 1.0) == 0


def group_mean(backend: HardwareBackend, value: float) -> float:
    """The mean of ``value`` over the backend's group of ranks (the value itself on a single GPU):
    what each rank derives from its own GPU but records as the group's (a heat correction)."""
    agree = getattr(backend, "agree_mean", None)
    return float(agree(value)) if callable(agree) else float(value)


def group_excess_c(backend: HardwareBackend) -> float:
    """Degrees above its idle temperature of the group's hottest GPU."""
    return group_max(backend, backend.temperature() - backend.idle_temperature())


@dataclass
class FixedCooldownConfig:
    name: str = "fixed"
    seconds: float = 5.0  # the published protocol

    def problems(self, ctx: Any = None) -> list[str]:
        return out_of_bounds(self, nonnegative=("seconds",))


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
        return out_of_bounds(self, positive=("poll_s",), nonnegative=("delta_c", "timeout_s"))


@COOLDOWNS.register("temperature", TemperatureCooldownConfig)
class TemperatureCooldown:
    """Poll the temperature until it is within ``delta_c`` of idle (or ``timeout_s`` passed)."""

    def __init__(self, cfg: TemperatureCooldownConfig) -> None:
        self.cfg = cfg

    def cool(self, backend: HardwareBackend) -> float:
        waited = 0.0
        while waited < self.cfg.timeout_s - 1e-12 and group_excess_c(backend) > self.cfg.delta_c:
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
        return out_of_bounds(self, positive=("delta_c", "tau_s", "poll_s"), nonnegative=("timeout_s",))


@COOLDOWNS.register("predictive", PredictiveCooldownConfig)
class PredictiveCooldown:
    """Idle once for the predicted cooling time; learn the time constant from each cooldown."""

    def __init__(self, cfg: PredictiveCooldownConfig) -> None:
        self.cfg = cfg
        self.tau = cfg.tau_s
        self._fits: list[float] = []

    def cool(self, backend: HardwareBackend) -> float:
        excess = group_excess_c(backend)
        if excess <= self.cfg.delta_c:
            return 0.0
        wait = min(self.tau * math.log(excess / self.cfg.delta_c), self.cfg.timeout_s)
        waited = 0.0
        if wait > 0:
            backend.idle(wait)
            waited = wait
            self._learn(excess, group_excess_c(backend), wait)
        while waited < self.cfg.timeout_s - 1e-12 and group_excess_c(backend) > self.cfg.delta_c:
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
        # min_span_c: nan or negative turned the correction off without a word, after a full probe
        out = out_of_bounds(self, positive=("probe_window_s", "tau_s"),
                            nonnegative=("seconds", "probe_idle_s", "min_span_c"), at_least_one=("cycles",))
        if self.probe_windows < 2:
            out.append(f"probe_windows: must be >= 2, got {self.probe_windows}")
        return out + _clock_problems(ctx, "probe_clocks", self.probe_clocks)


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


# The anchor workload: one tiny kernel issued back to back, so the GPU draws almost only static power.
# Leakage depends on voltage (the clock) and temperature, not on the workload; measured where dynamic
# power and its noise are smallest, a few seconds of it pin the leakage down far better than a busy window.
ANCHOR_OPS = (Op("leakage_anchor", OpKind.ELEMENTWISE, flops=0.0, bytes=4096.0),)


@dataclass
class ThermalCooldownConfig:
    """Measure warm, correct to cold: leakage anchors taken in the stream plus a fitted thermal model.

    No upfront probe and no waiting. Before a candidate's window the policy may run short *anchor*
    windows of a near-empty kernel (``ANCHOR_OPS``): its power is the GPU's static power, which grows
    with temperature. Anchors at one reference clock, taken first on the cold GPU and then whenever the
    running GPU is hotter than any anchor so far, fit the relative leakage coefficient ``c`` (per degree
    C, the same at every clock to first order: leakage current ~ exp(T), so dP/dT ~ P_static); one
    anchor at each clock the candidates use gives that clock's static level ``S(f)``, so the slope at a
    clock is ``c * S(f)``. The stream of windows (start and end temperature, power) fits the thermal
    time constant. A window starting ``dT0`` above idle then runs on average ``dT0 * tau/W * (1 -
    exp(-W/tau))`` hotter than a fully cooled one, and that leakage energy is subtracted: the raw
    readings stay in the measurement and the journal, the corrected value is what the measurement
    carries (flag ``thermal:<pct>``); the anchors are kept in the journal for a resumed run.
    """

    name: str = "thermal"
    seconds: float = 0.0  # idle after each candidate anyway
    anchor_window_s: float = 3.0  # one anchor window (30 periods of a ~0.1 s energy counter)
    reference_mhz: int = 0  # clock of the leakage-coefficient anchors; 0 = the top clock
    growth: float = 1.5  # re-anchor when the GPU runs this many times hotter (above idle) than any anchor ...
    min_step_c: float = 2.0  # ... and at least this many degrees hotter
    target_rel_se: float = 0.04  # keep adding hot anchors while c's relative standard error exceeds this
    hot_frac: float = 0.75  # such extra anchors only when the GPU is this close to its hottest so far
    max_anchors: int = 30  # cap on anchor windows per GPU (reference and per-clock together)
    per_clock: bool = True  # anchor every clock a candidate uses; False: interpolate S(f) between anchors
    max_failed_anchors: int = 3  # stop anchoring after this many failed anchor reads (backend without ops)
    noise_floor: float = 0.005  # assumed relative noise of one anchor window while too few to estimate it
    tau_s: float = 25.0  # thermal time constant until the stream has enough windows to fit one
    min_fit_windows: int = 8  # windows before the time constant is fitted

    def problems(self, ctx: Any = None) -> list[str]:
        # finite values only: nan passed every comparison and turned the anchoring off without a word
        out = out_of_bounds(self, positive=("anchor_window_s", "tau_s", "target_rel_se", "noise_floor"),
                            nonnegative=("seconds", "min_step_c"), at_least_one=("growth",))
        if not 0 < self.hot_frac <= 1:
            out.append(f"hot_frac: must be in (0, 1], got {self.hot_frac}")
        # 0 failed anchors allowed would spend the policy before its first anchor: no cooldown, no correction
        for key, least in (("max_anchors", 2), ("min_fit_windows", 3), ("max_failed_anchors", 1)):
            if getattr(self, key) < least:
                out.append(f"{key}: must be >= {least}, got {getattr(self, key)}")
        return out + _clock_problems(ctx, "reference_mhz", [self.reference_mhz] if self.reference_mhz else [])


def _clock_problems(ctx: Any, key: str, clocks: list[int]) -> list[str]:
    """Clocks the GPU cannot lock: every probe or anchor at one would fail, and the policy would give
    up its correction without a word (the run then pays neither a cooldown nor a correction)."""
    gpu = getattr(ctx, "gpu", None)
    if gpu is None:
        return []
    return [f"{key}: {why}" for mhz in clocks if (why := gpu.clock_problem(int(mhz)))]


def window_mean(t0: float, t1: float, w: float, tau: float) -> float:
    """Mean temperature of a window that relaxed exponentially from ``t0`` to ``t1`` over ``w`` s."""
    decay = math.exp(-w / tau)
    if decay >= 1.0 - 1e-12:
        return 0.5 * (t0 + t1)
    target = (t1 - t0 * decay) / (1.0 - decay)
    return target + (t0 - target) * tau / w * (1.0 - decay)


def fit_tau(windows: list[tuple[float, float, float, float]], prior: float) -> float:
    """Thermal time constant from windows ``(t0, t1, w, power)``: ``t1 = t0 d + (1 - d)(A + R p)``.

    ``d = exp(-w/tau)``; ``A`` (ambient) and ``R`` (thermal resistance) are nuisance parameters solved
    by least squares for each ``tau`` on a log grid; the best ``tau`` wins. No GPU time: it uses the
    windows the profiler measures anyway.
    """
    import numpy as np

    if len(windows) < 3:
        return prior
    a = np.asarray(windows, dtype=float)
    t0, t1, w, p = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    if np.ptp(p) <= 0 or np.ptp(t0) <= 0:
        return prior
    taus = np.geomspace(1.0, 400.0, 161)
    d = np.exp(-w[None, :] / taus[:, None])  # one row per candidate tau
    y = t1[None, :] - t0[None, :] * d
    u, v = 1.0 - d, (1.0 - d) * p[None, :]  # y = A u + (A R) v: two-parameter least squares per row
    suu, suv, svv = (u * u).sum(1), (u * v).sum(1), (v * v).sum(1)
    suy, svy = (u * y).sum(1), (v * y).sum(1)
    det = suu * svv - suv * suv
    ok = det > 1e-12 * np.maximum(suu * svv, 1e-300)
    safe = np.where(ok, det, 1.0)
    a = (svv * suy - suv * svy) / safe
    b = (suu * svy - suv * suy) / safe
    sse = np.where(ok, ((y - a[:, None] * u - b[:, None] * v) ** 2).sum(1), np.inf)
    if not np.isfinite(sse).any():
        return prior
    return float(taus[int(np.argmin(sse))])


@COOLDOWNS.register("thermal", ThermalCooldownConfig)
class ThermalCooldown:
    """No cooldown; leakage anchors in the stream and a thermal model remove the residual heat's energy."""

    def __init__(self, cfg: ThermalCooldownConfig) -> None:
        self.cfg = cfg
        self.tau = cfg.tau_s
        self.coeff: float | None = None  # relative leakage rise per degree C above idle
        self.coeff_rel_se = math.inf
        self.static: dict[int, float] = {}  # clock -> anchor power at the idle temperature (W)
        self.anchors: list[dict] = []  # {"mhz", "t0", "t1", "w", "p", "idle"}
        self.windows: list[tuple[float, float, float, float]] = []  # (t0, t1, w, power) for the tau fit
        self.hottest_c = 0.0  # largest excess over idle any window started at
        self.anchor_seconds = 0.0  # GPU-time the anchors took (not counting the re-lock after them)
        self.failed_anchors = 0

    def cool(self, backend: HardwareBackend) -> float:
        if self.cfg.seconds > 0:
            backend.idle(self.cfg.seconds)
        return self.cfg.seconds

    # -- anchors ---------------------------------------------------------------------------------
    def reference_mhz(self, backend: HardwareBackend) -> int:
        return int(self.cfg.reference_mhz) if self.cfg.reference_mhz else int(backend.gpu.max_mhz)

    def before_window(self, backend: HardwareBackend, read_ops_at, mhz: int) -> int:
        """Run the anchor windows this moment calls for; ``read_ops_at(mhz, ops, window_s) -> Reading``.

        Returns how many were taken (the profiler re-locks the candidate's clock after any).
        """
        ref = self.reference_mhz(backend)
        taken = 0
        began = backend.now()
        if self._group_takes(backend, self._wants_reference(backend, ref)):
            taken += self._take(backend, read_ops_at, ref)
        if self._group_takes(backend, self.cfg.per_clock and int(mhz) not in {a["mhz"] for a in self.anchors}):
            taken += self._take(backend, read_ops_at, int(mhz))
        self.anchor_seconds += backend.now() - began
        if taken:
            self._fit()
        return taken

    def _wants_reference(self, backend: HardwareBackend, ref: int) -> bool:
        """Whether this GPU calls for a reference-clock anchor now: none yet, or hotter than any so far
        (by ``growth`` and ``min_step_c``), or hot while the leakage coefficient is still uncertain."""
        cfg = self.cfg
        x_now = backend.temperature() - backend.idle_temperature()
        ref_x0 = [a["t0"] - a["idle"] for a in self.anchors if a["mhz"] == ref]
        if not ref_x0:
            return True
        if x_now >= max(max(ref_x0) * cfg.growth, max(ref_x0) + cfg.min_step_c):
            return True
        return (self.coeff_rel_se > cfg.target_rel_se and x_now >= cfg.min_step_c
                and x_now >= cfg.hot_frac * max(self.hottest_c, max(ref_x0)))

    def _group_takes(self, backend: HardwareBackend, wants: bool) -> bool:
        """Whether the group runs this anchor: some GPU wants it and none has used up its anchors.

        One agreed value (2 out of anchors, 1 wants one, 0 neither), so that ranks whose histories
        differ (one resumed from the journal, another not) still run the same windows.
        """
        spent = len(self.anchors) >= self.cfg.max_anchors or self.failed_anchors >= self.cfg.max_failed_anchors
        return group_max(backend, 2.0 if spent else (1.0 if wants else 0.0)) == 1.0

    def _take(self, backend: HardwareBackend, read_ops_at, mhz: int) -> int:
        t0 = backend.temperature()
        try:
            r = read_ops_at(int(mhz), ANCHOR_OPS, self.cfg.anchor_window_s)
        except KareusError:  # a configuration error stops the search, anchors or not
            raise
        except Exception:  # an anchor is optional: a failed one is skipped, the candidate goes on
            r = None
        if r is None or not (r.ok and r.time_s > 0 and r.energy_j > 0 and math.isfinite(r.energy_j)
                             and r.window_s > 0):
            self.failed_anchors += 1  # a backend that cannot run the anchor kernel stops costing time soon
            return 0
        t1 = backend.temperature()
        p = r.energy_j / r.time_s
        self.anchors.append({"mhz": int(mhz), "t0": t0, "t1": t1, "w": r.window_s, "p": p,
                             "idle": backend.idle_temperature()})
        self.windows.append((t0, t1, r.window_s, p))
        return 1

    # -- fits ------------------------------------------------------------------------------------
    def observe(self, reading, start_c: float, end_c: float, idle_c: float) -> None:
        """A candidate window's temperatures and power: data for the time constant (free)."""
        if not (reading.ok and reading.time_s > 0 and reading.energy_j > 0 and reading.window_s > 0):
            return
        self.hottest_c = max(self.hottest_c, start_c - idle_c)
        self.windows.append((start_c, end_c, reading.window_s, reading.energy_j / reading.time_s))
        del self.windows[:-400]
        if len(self.windows) >= self.cfg.min_fit_windows:
            self.tau = fit_tau(self.windows, self.cfg.tau_s)

    def _fit(self) -> None:
        """Relative leakage coefficient ``c`` and static levels ``S(f)``: ``p = S(f) (1 + c x)``."""
        groups: dict[int, list[tuple[float, float]]] = {}
        for a in self.anchors:
            x = window_mean(a["t0"], a["t1"], a["w"], self.tau) - a["idle"]
            groups.setdefault(a["mhz"], []).append((x, a["p"]))

        def levels(c: float) -> tuple[dict[int, float], float]:
            s, sse = {}, 0.0
            for f, pts in groups.items():
                num = sum(p * (1 + c * x) for x, p in pts)
                den = sum((1 + c * x) ** 2 for x, _ in pts)
                s[f] = num / den
                sse += sum((p - s[f] * (1 + c * x)) ** 2 for x, p in pts)
            return s, sse

        spread = [max(x for x, _ in pts) - min(x for x, _ in pts) for pts in groups.values() if len(pts) > 1]
        if not spread or max(spread) < self.cfg.min_step_c:
            self.coeff, self.coeff_rel_se = None, math.inf
            self.static = levels(0.0)[0]
            return
        lo, hi = 0.0, 0.1  # golden-section search: the SSE is convex in c near its minimum
        g = (math.sqrt(5) - 1) / 2
        for _ in range(60):
            m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
            if levels(m1)[1] <= levels(m2)[1]:
                hi = m2
            else:
                lo = m1
        c = 0.5 * (lo + hi)
        s, sse = levels(c)
        n = sum(len(p) for p in groups.values())
        dof = n - len(groups) - 1
        mean_p = sum(a["p"] for a in self.anchors) / n
        var = max(sse / dof if dof > 0 else 0.0, (self.cfg.noise_floor * mean_p) ** 2)
        lever = 0.0
        for f, pts in groups.items():
            xm = sum(x for x, _ in pts) / len(pts)
            lever += s[f] ** 2 * sum((x - xm) ** 2 for x, _ in pts)
        self.coeff = c
        self.static = s
        self.coeff_rel_se = math.sqrt(var / lever) / c if lever > 0 and c > 0 else math.inf

    # -- the correction --------------------------------------------------------------------------
    def slope_at(self, mhz: float) -> float:
        """Leakage slope (W per degree C) at a clock: ``c * S(f)``, S interpolated between anchors."""
        if not self.coeff or not self.static:
            return 0.0
        pts = sorted(self.static.items())
        if mhz <= pts[0][0]:
            s = pts[0][1]
        elif mhz >= pts[-1][0]:
            s = pts[-1][1]
        else:
            s = pts[-1][1]
            for (f0, s0), (f1, s1) in zip(pts, pts[1:]):
                if f0 <= mhz <= f1:
                    s = s0 + (s1 - s0) * (mhz - f0) / (f1 - f0)
                    break
        return self.coeff * s

    def excess_energy(self, reading, start_c: float, idle_c: float) -> float:
        """Energy per execution the window's residual heat added, against a fully cooled start."""
        d0 = max(0.0, start_c - idle_c)
        w = max(reading.window_s, 1e-9)
        mean_excess = d0 * self.tau / w * (1.0 - math.exp(-w / self.tau))
        return self.slope_at(reading.freq_mhz) * mean_excess * reading.time_s

    # -- journal state and report ------------------------------------------------------------------
    def state(self) -> dict:
        return {"anchors": self.anchors, "windows": [list(w) for w in self.windows[-400:]],
                "hottest_c": self.hottest_c}

    def load_state(self, state: dict) -> None:
        self.anchors = [dict(a) for a in state.get("anchors", [])]
        self.windows = [tuple(w) for w in state.get("windows", [])]  # type: ignore[misc]
        self.hottest_c = float(state.get("hottest_c", 0.0))
        if len(self.windows) >= self.cfg.min_fit_windows:
            self.tau = fit_tau(self.windows, self.cfg.tau_s)
        self._fit()

    def report(self) -> dict:
        return {"anchors": len(self.anchors), "failed_anchors": self.failed_anchors,
                "anchor_gpu_seconds": self.anchor_seconds, "tau_s": self.tau,
                "leak_coeff_per_c": self.coeff, "leak_coeff_rel_se": self.coeff_rel_se,
                "static_w": {str(k): v for k, v in sorted(self.static.items())}}
