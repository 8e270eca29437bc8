"""Plans as plain YAML: written with a schema version, read with the safe loader and a strict schema check.

Nothing in a plan file is ever evaluated; an unknown key, a missing key, a wrong type or another
schema version is a :class:`PlanFormatError` naming the file and the field.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

from kareus.errors import not_text
from kareus.plan.model import SCHEMA_VERSION, ExecutionPlan, InstructionPlan, MadeFor, PartitionSetting, StagePlan

# version 1 plans have no clock_switch_s: they load (and save again) as current plans whose switches
# were not priced; versions 1 and 2 have no made_for: they load without it (an executor refuses them)
READABLE_VERSIONS = (1, 2, SCHEMA_VERSION)


class PlanFormatError(ValueError):
    """A plan file that is not a valid plan of this schema version."""


def plan_to_dict(plan: ExecutionPlan) -> dict[str, Any]:
    def conv(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        return x

    return conv(plan)


def _check(cls: type, data: Any, where: str, optional: frozenset[str] = frozenset()) -> Any:
    """Build ``cls`` from plain data, checking keys and types field by field; every field is required
    but those named in ``optional`` (they take their defaults)."""
    if not isinstance(data, dict):
        raise PlanFormatError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise PlanFormatError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.name in optional:
                continue
            raise PlanFormatError(f"{where}: missing key {f.name!r}")
        kwargs[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


def _value(tp: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _check(tp, v, where)
    if origin is tuple:
        (inner, _) = typing.get_args(tp)
        if not isinstance(v, list):
            raise PlanFormatError(f"{where}: expected a list, got {type(v).__name__}")
        return tuple(_value(inner, x, f"{where}[{i}]") for i, x in enumerate(v))
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
        if v is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _value(inner, v, where)
    if tp is bool:
        if not isinstance(v, bool):
            raise PlanFormatError(f"{where}: expected true or false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanFormatError(f"{where}: expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise PlanFormatError(f"{where}: expected a finite number, got {v!r}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise PlanFormatError(f"{where}: expected a string, got {v!r}")
        return v
    raise PlanFormatError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover


def plan_from_dict(data: Any, where: str = "plan") -> ExecutionPlan:
    version = data.get("schema_version") if isinstance(data, dict) else None
    if isinstance(data, dict) and (isinstance(version, bool) or version not in READABLE_VERSIONS):
        raise PlanFormatError(f"{where}: schema_version {version!r} is not supported "
                              f"(expected one of {', '.join(map(str, READABLE_VERSIONS))})")
    if version == 1 and "clock_switch_s" in data:
        raise PlanFormatError(f"{where}: unknown key(s) clock_switch_s (schema_version 1 has none; 2 does)")
    if version in (1, 2) and "made_for" in data:
        raise PlanFormatError(f"{where}: unknown key(s) made_for (schema_version {version} has none; 3 does)")
    # 1: switches unpriced; 1 and 2: no model or layout recorded
    optional = frozenset(({"clock_switch_s"} if version == 1 else set()) | ({"made_for"} if version in (1, 2) else set()))
    plan = dataclasses.replace(_check(ExecutionPlan, data, where, optional), schema_version=SCHEMA_VERSION)
    _check_plan_values(plan, where)
    if len(plan.stages) != plan.num_stages:
        raise PlanFormatError(f"{where}: {len(plan.stages)} stages listed, num_stages is {plan.num_stages}")
    for i, st in enumerate(plan.stages):
        if st.stage != i:
            raise PlanFormatError(f"{where}.stages[{i}]: stage {st.stage} out of order")
        _check_instructions(st, plan.num_microbatches, f"{where}.stages[{i}]")
    return plan


def _check_plan_values(plan: ExecutionPlan, where: str) -> None:
    """Values an executor or a report would act on wrongly: a count below one, a negative price, a
    schedule that no executor follows."""
    import kareus.compose.schedule  # noqa: F401  (registers the schedules)
    from kareus.registry import SCHEDULES

    for name in ("num_stages", "num_microbatches", "gpus_per_stage"):
        if getattr(plan, name) < 1:
            raise PlanFormatError(f"{where}.{name}: must be >= 1, got {getattr(plan, name)}")
    if plan.index < 0:
        raise PlanFormatError(f"{where}.index: must be >= 0, got {plan.index}")
    for name in ("predicted_time_s", "predicted_energy_j"):
        if getattr(plan, name) <= 0:
            raise PlanFormatError(f"{where}.{name}: must be positive, got {getattr(plan, name)}")
    for name in ("static_power_w", "clock_switch_s"):
        if getattr(plan, name) < 0:
            raise PlanFormatError(f"{where}.{name}: must be >= 0, got {getattr(plan, name)}")
    if plan.schedule not in SCHEDULES:
        raise PlanFormatError(f"{where}.schedule: {plan.schedule!r} is not a schedule; allowed: "
                              f"{', '.join(sorted(SCHEDULES.names()))}")


MAX_LISTED = 64  # missing microbatches named one by one up to this many


def _check_instructions(st: StagePlan, num_microbatches: int, where: str) -> None:
    """Each direction covers every microbatch exactly once, at a positive clock and time: an executor
    must find one setting for each instruction it runs, never two."""
    seen: dict[str, list[int]] = {"fwd": [], "bwd": []}
    for j, ins in enumerate(st.instructions):
        at = f"{where}.instructions[{j}]"
        if ins.direction not in seen:
            raise PlanFormatError(f"{at}.direction: {ins.direction!r} is not fwd or bwd")
        if ins.stage != st.stage:
            raise PlanFormatError(f"{at}.stage: {ins.stage} inside stage {st.stage}")
        if ins.freq_mhz <= 0 or ins.time_s <= 0:
            raise PlanFormatError(f"{at}: freq_mhz and time_s must be positive, got {ins.freq_mhz} and {ins.time_s}")
        for k, ps in enumerate(ins.partitions):
            if ps.sms < 1 or ps.count < 0:
                raise PlanFormatError(f"{at}.partitions[{k}]: sms must be >= 1 and count >= 0, got {ps.sms} and {ps.count}")
            if any(other.partition == ps.partition for other in ins.partitions[:k]):
                raise PlanFormatError(f"{at}.partitions[{k}]: partition {ps.partition!r} is listed twice "
                                      f"(an executor needs one setting for it)")
        seen[ins.direction] += list(ins.microbatches)
    for direction, mbs in seen.items():
        once = set(mbs)
        unknown = sorted(m for m in once if not 0 <= m < num_microbatches)
        if len(mbs) == num_microbatches == len(once) and not unknown:
            continue
        dup = sorted(m for m in once if mbs.count(m) > 1)
        short = num_microbatches - (len(once) - len(unknown))
        # listed while the count is plausible: a corrupt one (say 10**9) must not build its whole range
        missing = (f"; missing {sorted(set(range(num_microbatches)) - once)}" if 0 < short <= MAX_LISTED
                   else f"; {short} missing" if short > 0 else "")
        raise PlanFormatError(f"{where}: {direction} microbatches must be 0..{num_microbatches - 1} once each"
                              + (f"; repeated {dup}" if dup else "") + missing
                              + (f"; unknown {unknown}" if unknown else ""))


def _safe_yaml() -> tuple[type, type]:
    """(dumper, loader): libyaml's safe ones where PyYAML was built with it, else the pure-Python
    ones. The same safe types and the same text; a run writes a plan per frontier point, and the
    C emitter writes them three times as fast, the C parser reads them nine times as fast."""
    import yaml

    return getattr(yaml, "CSafeDumper", yaml.SafeDumper), getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def save_plan(plan: ExecutionPlan, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# Kareus execution plan (predicted values; times in s, energies in J)\n"
    text += yaml.dump(plan_to_dict(plan), Dumper=_safe_yaml()[0], sort_keys=False, default_flow_style=None, width=120)
    path.write_text(text)
    return path


def load_plan(path: str | Path) -> ExecutionPlan:
    """Read and validate a plan file (safe YAML only; raises PlanFormatError on anything else)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_safe_yaml()[1])
    except yaml.YAMLError as e:
        raise PlanFormatError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise PlanFormatError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise PlanFormatError(f"{path}: {not_text(e)}") from None
    return plan_from_dict(data, where=str(path))


__all__ = ["PlanFormatError", "load_plan", "plan_from_dict", "plan_to_dict", "save_plan",
           "ExecutionPlan", "InstructionPlan", "MadeFor", "PartitionSetting", "StagePlan"]
