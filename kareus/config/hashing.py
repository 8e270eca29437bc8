"""A stable hash of what a measurement depends on, so a journal is never continued under another setup."""
from __future__ import annotations

import hashlib
import json
from typing import Any

# Sections that change what is measured or which candidates are chosen. Display, tracking, the
# launcher and the later composition/plan stages may change freely between a run and its resume.
MEASURED_SECTIONS = ("model", "parallel", "hardware", "partitioner", "profiler", "search", "seed")


def config_hash(cfg: Any) -> str:
    """sha256 (16 hex digits) of the measurement-relevant sections of a resolved config."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) if not isinstance(cfg, dict) else cfg
    picked = {k: container.get(k) for k in MEASURED_SECTIONS}
    blob = json.dumps(picked, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
