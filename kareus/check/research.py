"""The command ``mode=check`` prints when something drifted: re-search only the drifted partitions,
warm-started from the checked run.

It is the checked run's own command line (``.hydra/overrides.yaml``: its model, layout, searcher and
mode) with the check's hardware overrides (the hardware as the check found it), plus
``search.warm_start`` (the checked run last, after any run it was warm-started from itself) and
``search.only`` (the drifted partitions). The partitions that did not drift are carried from the
checked run's journal; the drifted ones are searched anew, their old measurements prior points.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Sequence

DROPPED = ("mode", "resume", "search.warm_start", "search.only", "hydra.run.dir")  # set anew or not carried over


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def research_command(checked_run: Path, check_overrides: Sequence[str], drifted: Sequence[str]) -> str:
    """``python -m kareus ...`` that re-searches ``drifted`` warm-started from ``checked_run``."""
    from omegaconf import OmegaConf

    saved = checked_run / ".hydra" / "overrides.yaml"
    run = [str(o) for o in OmegaConf.load(saved)] if saved.is_file() else list(_workload(check_overrides))
    warm = [str(checked_run)]
    config = checked_run / ".hydra" / "config.yaml"
    if config.is_file():
        earlier = OmegaConf.select(OmegaConf.load(config), "search.warm_start")
        if earlier:
            from kareus.search.warm import warm_start_dirs

            warm = [d for d in warm_start_dirs(earlier) if d != str(checked_run)] + warm
    hardware = [o for o in check_overrides if _key(o) == "hardware" or _key(o).startswith("hardware.")]
    hw_keys = {_key(o) for o in hardware}
    kept = [o for o in run if _key(o) not in DROPPED and not _key(o).startswith("check.") and _key(o) not in hw_keys]
    mode = [o for o in run if _key(o) == "mode" and o.split("=", 1)[1] != "check"]
    only = f"search.only=[{','.join(drifted)}]"
    start = f"search.warm_start={warm[0]}" if len(warm) == 1 else f"search.warm_start=[{','.join(warm)}]"
    return " ".join(shlex.quote(a) for a in ["python", "-m", "kareus", *kept, *hardware, *mode, start, only])


def _workload(overrides: Sequence[str]) -> list[str]:
    """A check's own overrides less what only a check takes (a run saved without its overrides)."""
    return [o for o in overrides if _key(o) != "mode" and not _key(o).startswith("check.")]
