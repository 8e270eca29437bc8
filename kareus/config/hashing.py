"""Stable hashes of configs, so a journal is never continued under another setup."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

# Sections that change what is measured or which candidates are chosen. Display, tracking, the
# launcher and the later composition/plan stages may change freely between a run and its resume.
MEASURED_SECTIONS = ("model", "parallel", "hardware", "partitioner", "profiler", "search", "seed")
# keys of those sections that only shape composition (the clock-switch price, how many microbatches an
# iteration runs and in which order): a resume may change them and re-compose from the same measurements
UNMEASURED_KEYS = {"hardware": ("clock_switch_s",), "parallel": ("num_microbatches", "schedule")}


def stable_hash(obj: Any) -> str:
    """sha256 (16 hex digits) of any config: dict, list, DictConfig or dataclass, interpolations resolved."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(obj, (DictConfig, ListConfig)):
        obj = OmegaConf.to_container(obj, resolve=True, enum_to_str=True)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def config_hash(cfg: Any) -> str:
    """The hash of a run's measurement-relevant sections (what its journal is keyed by)."""
    return stable_hash(measured_sections(cfg))


def measured_sections(cfg: Any) -> dict[str, Any]:
    """The sections (and keys) of a config that change what is measured, as plain data."""
    from omegaconf import DictConfig, OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if isinstance(cfg, DictConfig) else cfg
    measured = {}
    for k in MEASURED_SECTIONS:
        section = container.get(k)
        if isinstance(section, dict) and k in UNMEASURED_KEYS:
            section = {key: v for key, v in section.items() if key not in UNMEASURED_KEYS[k]}
        measured[k] = section
    hw = measured.get("hardware")
    if isinstance(hw, dict) and hw.get("table"):  # a recorded table answers the candidates: its contents count
        measured["hardware"] = {**hw, "table_sha256": file_digest(str(hw["table"]))}
    return measured


def file_digest(path: str) -> str:
    """sha256 (16 hex digits) of a file's bytes, or "unreadable" (the run's own checks name why)."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unreadable"


def measured_differences(old: Any, new: Any) -> list[str]:
    """``key (old -> new)`` for every measurement-relevant value two configs set differently."""
    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for k, v in node.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: node}

    a, b = flat(measured_sections(old)), flat(measured_sections(new))
    keys = sorted((k for k in set(a) | set(b) if a.get(k) != b.get(k)),
                  key=lambda k: (not k.endswith(".name"), k))  # another component first: it explains the rest
    return [f"{k} ({a.get(k, '-')} -> {b.get(k, '-')})" for k in keys]
