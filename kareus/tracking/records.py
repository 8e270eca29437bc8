"""Plain rows and params from events and frontiers: what the MLflow run and its tables contain.

Nothing here imports MLflow, so the shapes are testable and reusable (CSV, tables, plots).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence

from kareus.events import CandidateMeasured
from kareus.frontier import Frontier

MAX_KEY = 250  # MLflow's limit on param, metric and tag keys
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")

# Measured quantities logged per candidate (metric name -> row column); the GPU time so far goes
# beside them as gpu_hours_name(...), named as the invocation's (simulated or not)
CANDIDATE_METRICS = ("time_s", "energy_j", "dynamic_energy_j", "static_energy_j", "temperature_c",
                     "measured_freq_mhz")
KNOB_METRICS = ("sms", "freq_mhz")


def clean_key(key: str) -> str:
    """A key MLflow accepts (alphanumerics, ``_-. /``), at most 250 characters."""
    return _BAD_KEY_CHARS.sub("_", key)[:MAX_KEY]


def truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


_BUILTIN_SCALARS = frozenset({bool, int, float, str, type(None)})


def plain(value: Any) -> Any:
    """Mappings, sequences and enums down to JSON/YAML-safe builtins (enums by value)."""
    if type(value) in _BUILTIN_SCALARS:  # most calls are leaves: skip the ABC checks (a str enum is not one)
        return value
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.repr}
    return str(value)


def scalar(value: Any) -> Any:
    """A value fit for a table cell or a param: scalars as they are, anything else as JSON."""
    value = plain(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, separators=(",", ":"))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay whole (as JSON) since they are one setting."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name))
        else:
            out[name] = scalar(dict(value) if isinstance(value, Mapping) else value)
    return out


# scheme://user: then the password, up to the '@' after which the word holds no other '@' (the host's):
# a password may hold '@', '/' or spaces, as SQLAlchemy and urllib read them
_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)(.*?)@(?=[^@\s]*(?:\s|$))")


def redacted(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@host`` in it shown as ``***``: a
    store's or server's credentials (``tracking.uri``) must not reach the shared store's records or a
    printed line. Give it one value (or one line) at a time: a password runs to the host's '@'."""
    return _CREDENTIALS.sub(r"\1***@", text)


def config_params(resolved: Mapping[str, Any]) -> dict[str, str]:
    """The resolved config as MLflow params: flattened, keys cleaned, values truncated to the limits,
    credentials left out."""
    params: dict[str, str] = {}
    for key, value in flatten(resolved).items():
        params[clean_key(key)] = truncate(redacted("null" if value is None else str(value)), MAX_PARAM_VALUE)
    return params


def normal_override(item: str) -> str:
    """An override as the user types it: Hydra writes a sweep job's booleans as ``True``/``False``,
    a single run keeps ``true``/``false``; one spelling keeps tag filters and run names comparable."""
    key, sep, value = item.partition("=")
    return f"{key}={value.lower()}" if sep and value in ("True", "False") else item


def override_tags(overrides: Sequence[str]) -> dict[str, str]:
    """``["+model=qwen", "search.passes=[a,b]"]`` -> ``overrides`` plus one ``override.<key>`` tag each."""
    overrides = [redacted(normal_override(o)) for o in overrides]
    tags = {"overrides": truncate(" ".join(overrides), MAX_TAG_VALUE)} if overrides else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            continue
        key = key.lstrip("+~")
        tags[clean_key(f"override.{key}")] = truncate(value, MAX_TAG_VALUE)
    return tags


def choice_tags(choices: Mapping[str, Any]) -> dict[str, str]:
    """Config-group choices as ``choice.<group>`` tags (Hydra's own and schema groups left out)."""
    tags = {}
    for group, value in choices.items():
        if value is None or group.startswith(("hydra", "schema/")) or "/schema/" in group:
            continue
        tags[clean_key(f"choice.{group}")] = truncate(str(value), MAX_TAG_VALUE)
    return tags


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def candidate_row(event: CandidateMeasured) -> dict[str, Any]:
    """One profiled candidate as a table row: index, knobs, measurement, prediction, pass."""
    m = event.measurement
    c = m.candidate
    row: dict[str, Any] = {
        "index": event.index, "partition": c.partition, "slot": c.slot, "sms": c.sms, "freq_mhz": c.freq_mhz,
        "pass": event.pass_name or "", "failed": bool(m.failed), "cached": bool(event.cached),
        "time_s": m.time_s, "energy_j": m.energy_j, "dynamic_energy_j": m.dynamic_energy_j,
        "static_energy_j": m.static_energy_j, "static_power_w": m.static_power_w,
        "temperature_c": m.temperature_c, "measured_freq_mhz": m.freq_mhz, "repeats": m.repeats,
        "flags": ";".join(m.flags), "gpu_seconds": event.gpu_seconds,
    }
    for key, value in (event.predicted or {}).items():
        row[f"predicted_{key}"] = value
    return row


def payload_columns(payload: Any) -> dict[str, Any]:
    """Columns describing a frontier point's payload (a Candidate, a Measurement, a dict, choices ...)."""
    if payload is None:
        return {}
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(payload):
            if not f.repr:
                continue
            value = getattr(payload, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                out.update(payload_columns(value))  # e.g. Measurement.candidate -> its knobs
            elif isinstance(value, Mapping) and value:
                out.update(flatten(plain(value), f.name))  # e.g. choices per partition -> their knobs
            elif f.name not in out:
                out[f.name] = scalar(list(value) if isinstance(value, tuple) else value)
        return out
    if isinstance(payload, Mapping):
        return flatten(payload)
    return {"payload": scalar(payload)}


def frontier_rows(frontier: Frontier) -> list[dict[str, Any]]:
    """The frontier's points, fastest first, with their payload's columns."""
    rows = []
    for rank, point in enumerate(frontier.points):
        row: dict[str, Any] = {"rank": rank, "time_s": point.time_s, "energy_j": point.energy_j,
                               "objective": frontier.objective}
        for key, value in payload_columns(point.payload).items():
            if key in row:  # the payload's own time/energy: keep it only if it differs (another objective)
                if value != row[key]:
                    row[f"payload_{key}"] = value
                continue
            row[key] = value
        rows.append(row)
    return rows


FRONTIER_HEADER = ("rank", "time_s", "energy_j", "objective")  # an empty frontier's columns


def frontier_artifacts(frontier: Frontier) -> tuple[str, dict[str, list[Any]]]:
    """The frontier as CSV text and as an MLflow table; an empty one (every candidate failed) as a
    header alone, so that it is recorded as the run directory records it, not left out."""
    rows = frontier_rows(frontier)
    return to_csv(rows, FRONTIER_HEADER), to_table(rows, FRONTIER_HEADER)


def columns(rows: Sequence[Mapping[str, Any]], header: Sequence[str] = ()) -> list[str]:
    """Union of the rows' keys in order of first appearance; ``header`` when there are no rows."""
    if not rows:
        return list(header)
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def to_csv(rows: Sequence[Mapping[str, Any]], header: Sequence[str] = ()) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(rows, header), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: scalar(v) for k, v in row.items()})
    return buf.getvalue()


def to_table(rows: Sequence[Mapping[str, Any]], header: Sequence[str] = ()) -> dict[str, list[Any]]:
    """Column-wise dict for ``MlflowClient.log_table``; NaN becomes None (JSON has no NaN)."""
    cols = columns(rows, header)
    table: dict[str, list[Any]] = {c: [] for c in cols}
    for row in rows:
        for c in cols:
            v = scalar(row.get(c))
            table[c].append(None if isinstance(v, float) and not math.isfinite(v) else v)
    return table


def mark_frontier(rows: Iterable[dict[str, Any]], frontier: Frontier) -> None:
    """Set ``on_frontier`` on candidate rows whose knobs (or, lacking those, numbers) are on the frontier."""
    keys, values = set(), set()
    for p in frontier.points:
        cols = payload_columns(p.payload)
        if {"slot", "sms", "freq_mhz"} <= cols.keys():
            keys.add((cols["slot"], cols["sms"], cols["freq_mhz"]))
        values.add((round(p.time_s, 12), round(p.energy_j, 9)))
    for row in rows:
        knob = (row.get("slot"), row.get("sms"), row.get("freq_mhz"))
        num = (round(row["time_s"], 12), round(row["energy_j"], 9)) if finite(row.get("time_s")) else None
        row["on_frontier"] = (knob in keys) if keys else (num in values)


def gpu_hours_name(simulated: bool | None, prefix: str = "") -> str:
    """``<prefix>gpu_hours_simulated`` on the simulated GPU, ``<prefix>gpu_hours`` on real (or replayed real) GPUs."""
    return f"{prefix}gpu_hours" + ("" if simulated is False else "_simulated")
