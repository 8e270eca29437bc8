"""The profiler's typed config: the measurement protocol, every step a value under ``profiler:``.

Defaults follow the published protocol: lock the clock, settle, warm up, size the window from a
calibration run to about 5 s of back-to-back executions, read energy over it, cool down 5 s.
``cooldown`` and ``frequency`` are component sections (``name:`` picks the policy / controller from
``COOLDOWNS`` / ``FREQUENCY_CONTROLLERS``); their option files under ``conf/profiler/cooldown`` and
``conf/profiler/frequency`` type them at composition, :meth:`ProfilerConfig.problems` re-checks them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kareus.config.bounds import out_of_bounds
from kareus.config.store import register_schema


@dataclass
class ProfilerConfig:
    """How one candidate is measured. Times are GPU-seconds (virtual on the simulated GPU)."""

    settle_s: float = 0.1  # after a clock change, before anything runs (clocks take ms to lock)
    warmup_runs: int = 3  # executions thrown away (caches, clocks, lazy init)
    calibration_runs: int = 3  # executions timed to size the window (their median)
    target_window_s: float = 5.0  # the window covers about this much back-to-back execution
    min_window_s: float = 0.5  # below this the energy counter (~100 ms period on A100) is too coarse
    max_executions: int = 1_000_000  # cap on executions per window
    repeats: int = 1  # measurement windows per candidate
    retries: int = 2  # extra tries of a failed read before the candidate is recorded as failed
    mad_threshold: float = 3.5  # with 5+ repeats, those further than this many scaled MADs from the median are outliers
    cooldown_between_repeats: bool = False  # cool down between repeats too, not only after a candidate
    cooldown: Any = field(default_factory=lambda: {"name": "fixed"})
    frequency: Any = field(default_factory=lambda: {"name": "sim"})

    def problems(self, ctx: Any = None) -> list[str]:
        """Every cross-field problem at once (empty when the config is usable)."""
        out = out_of_bounds(self, "profiler.", positive=("target_window_s", "mad_threshold"),
                            nonnegative=("min_window_s", "settle_s", "warmup_runs", "retries"),
                            at_least_one=("calibration_runs", "max_executions", "repeats"))
        if self.min_window_s > self.target_window_s:
            out.append(f"profiler.min_window_s={self.min_window_s} exceeds target_window_s={self.target_window_s}")
        out += _component_problems("profiler.cooldown", self.cooldown, "COOLDOWNS", ctx)
        out += self._short_cooldown_windows()
        out += _component_problems("profiler.frequency", self.frequency, "FREQUENCY_CONTROLLERS", ctx)
        return out

    def _short_cooldown_windows(self) -> list[str]:
        """A policy's own windows (thermal anchors, the compensated probe) shorter than a profiling
        window: the energy counter's steps skew them, and below its period every read fails, which
        silently leaves the policy neither cooling nor correcting."""
        try:
            sec = section(self.cooldown)
        except TypeError:
            return []  # reported with the section
        out = []
        for key in ("anchor_window_s", "probe_window_s"):
            v = sec.get(key)
            if isinstance(v, (int, float)) and 0 < v < self.min_window_s:
                out.append(f"profiler.cooldown.{key}={v:g} is shorter than profiler.min_window_s={self.min_window_s:g}; "
                           f"allowed: at least {self.min_window_s:g} s")
        return out


def section(value: Any) -> dict[str, Any]:
    """A component section as a plain dict (accepts dict, DictConfig or dataclass)."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.structured(value), resolve=True)  # type: ignore[return-value]
    if isinstance(value, dict):
        return dict(value)
    from omegaconf import DictConfig, OmegaConf

    if isinstance(value, DictConfig):
        return OmegaConf.to_container(value, resolve=True)  # type: ignore[return-value]
    raise TypeError(f"expected a config section, got {type(value).__name__}")


def _component_problems(where: str, value: Any, registry_name: str, ctx: Any = None) -> list[str]:
    import kareus.profiler  # noqa: F401  (registers the built-in policies and controllers)
    from kareus import registry

    reg = getattr(registry, registry_name)
    try:
        sec = section(value)
    except TypeError as e:
        return [f"{where}: {e}"]
    name = sec.get("name")
    if not name:
        return [f"{where}.name is missing; known: {', '.join(reg.names())}"]
    if name not in reg:
        return [f"{where}.name={name!r} is unknown; known: {', '.join(reg.names())}"]
    entry = reg.get(name)
    if entry.config_cls is None:
        return []
    try:
        cfg = registry.to_dataclass(entry.config_cls, sec)
    except Exception as e:  # omegaconf validation errors: one line is enough
        return [f"{where}: {str(e).splitlines()[0]}"]
    check = getattr(cfg, "problems", None)
    return [f"{where}.{p}" for p in check(ctx)] if callable(check) else []


register_schema("profiler", "default", ProfilerConfig)
