"""Heat physics of the simulated GPU beyond its shipped model, as options that are off by default.

The shipped model (sim.py) is one thermal stage whose static power is linear in temperature, solved
exactly: the very form the cooldown policies assume. These options give the GPU heat physics of
another form, so that a check of a policy's heat correction is not passed by construction
(``benchmarks/cooldown.py``, "mismatched"):

- two stages (a Foster network): a fast die-to-heatsink stage beside the slow heatsink-to-air one,
  so a cooldown is the sum of two exponentials (``thermal_fast_frac``, ``thermal_fast_tau_s``);
- leakage growing exponentially with temperature, so static power rises faster than linearly
  (``static_temp_curvature``; ``SimConfig.static_scale_at``);
- a fan step: above ``fan_on_c`` the fans go high and the heatsink-to-air resistance, and with it
  that stage's time constant (its heat capacity is unchanged), drops by ``fan_r_scale``; they go
  back low below ``fan_on_c - fan_hysteresis_c``.

Nonlinear, so integrated numerically: RK4 in steps of at most a tenth of the fastest time constant,
the fans switching at step ends (``MAX_STEP_S`` apart at most).
"""
from __future__ import annotations

import math
from typing import Callable

MAX_STEP_S = 0.25  # integration step cap; also how late a fan switch may come


class HeatNetwork:
    """Die temperature of a GPU whose heat flows through a fast and a slow stage to the air."""

    def __init__(self, cfg, temp_c: float) -> None:
        self.cfg = cfg
        self.fan_high = False
        rise = temp_c - cfg.ambient_c
        self.rise = [rise * cfg.thermal_fast_frac, rise * (1.0 - cfg.thermal_fast_frac)]  # at steady state

    def temperature(self) -> float:
        return self.cfg.ambient_c + self.rise[0] + self.rise[1]

    def stages(self, fan_high: bool) -> tuple[tuple[float, float], tuple[float, float]]:
        """(thermal resistance C/W, time constant s) of the fast and the slow stage."""
        c = self.cfg
        fan = c.fan_r_scale if fan_high else 1.0
        r = c.thermal_r_c_per_w
        return (r * c.thermal_fast_frac, c.thermal_fast_tau_s), (r * (1.0 - c.thermal_fast_frac) * fan,
                                                                c.thermal_tau_s * fan)

    def run(self, power: Callable[[float], float], seconds: float) -> float:
        """Draw ``power(die temperature)`` watts for ``seconds``; returns the mean power."""
        if seconds <= 0:
            return power(self.temperature())
        taus = [tau for r, tau in self.stages(self.fan_high) if r > 0] or [self.cfg.thermal_tau_s]
        n = max(1, math.ceil(seconds / min(MAX_STEP_S, 0.1 * min(taus))))
        h = seconds / n
        energy = 0.0
        for _ in range(n):
            energy += self._step(power, h)
            self._switch_fans()
        return energy / seconds

    def _step(self, power: Callable[[float], float], h: float) -> float:
        """One RK4 step of the two rises and the energy drawn (returned)."""
        (r0, t0), (r1, t1) = self.stages(self.fan_high)
        amb = self.cfg.ambient_c

        def deriv(y: tuple[float, float]) -> tuple[float, float, float]:
            p = power(amb + y[0] + y[1])
            return (r0 * p - y[0]) / t0, (r1 * p - y[1]) / t1, p

        y = (self.rise[0], self.rise[1])
        k1 = deriv(y)
        k2 = deriv((y[0] + 0.5 * h * k1[0], y[1] + 0.5 * h * k1[1]))
        k3 = deriv((y[0] + 0.5 * h * k2[0], y[1] + 0.5 * h * k2[1]))
        k4 = deriv((y[0] + h * k3[0], y[1] + h * k3[1]))
        self.rise = [y[i] + h / 6.0 * (k1[i] + 2 * k2[i] + 2 * k3[i] + k4[i]) for i in (0, 1)]
        return h / 6.0 * (k1[2] + 2 * k2[2] + 2 * k3[2] + k4[2])

    def _switch_fans(self) -> None:
        if self.cfg.fan_r_scale >= 1.0:
            return
        t = self.temperature()
        if not self.fan_high and t > self.cfg.fan_on_c:
            self.fan_high = True
        elif self.fan_high and t < self.cfg.fan_on_c - self.cfg.fan_hysteresis_c:
            self.fan_high = False

    def settle(self, power: Callable[[float], float]) -> float:
        """Die temperature that drawing ``power(T)`` without end settles to (what the power cap
        judges): with the fans low, or high if that temperature would switch them on."""
        low = self._steady(power, False)
        return self._steady(power, True) if self.cfg.fan_r_scale < 1.0 and low > self.cfg.fan_on_c else low

    def _steady(self, power: Callable[[float], float], fan_high: bool) -> float:
        """The lowest root of ``T = amb + R p(T)``, the stable one (above another, exponential leakage
        runs away): iterated up from the ambient, converging at the loop gain's rate (a few percent)."""
        r = sum(ri for ri, _ in self.stages(fan_high))
        t = self.cfg.ambient_c
        for _ in range(500):
            nxt = self.cfg.ambient_c + r * power(t)
            if abs(nxt - t) < 1e-9 or nxt > 1000.0:
                return nxt
            t = nxt
        return t
