"""``search.warm_start`` and ``search.only`` in a run: which partitions are searched, their prior points,
and the carried frontiers of the rest.

A partition outside ``search.only`` is not searched. With ``search.warm_start`` set its frontier is
*carried*: built from the warm-start run's measurements of it (the first directory that has them),
as that run's frontier was, so ``mode=run`` composes every partition; the carried partitions cost this
run no profile and are named in ``summary.json`` (``carried``). Without a warm start they are left
out (``mode=search`` only: ``mode=run`` refuses, as it needs every frontier).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from kareus.errors import KareusError
from kareus.search.base import SearchResult
from kareus.types import Measurement, PartitionType


def warm_dirs(ctx: Any) -> list[Path]:
    """The configured warm-start run directories, against the folder the command was started in."""
    from kareus.config.paths import from_start_dir
    from kareus.search.warm import warm_start_dirs

    return [from_start_dir(d) for d in warm_start_dirs(getattr(ctx.typed["search"], "warm_start", None))]


def split(ctx: Any, partitions: Sequence[PartitionType]) -> tuple[list[PartitionType], list[str]]:
    """(partitions to search, keys of those left out) by ``search.only``; an unknown key is one line."""
    only = [str(k) for k in (getattr(ctx.typed["search"], "only", None) or [])]
    if not only:
        return list(partitions), []
    keys = [p.key for p in partitions]
    unknown = [k for k in only if k not in keys]
    if unknown:
        raise KareusError(f"search.only: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a partition "
                          f"of this layout; allowed: {', '.join(keys)}")
    return [p for p in partitions if p.key in only], [k for k in keys if k not in only]


def prior(ctx: Any, backend: Any, keys: Sequence[str]) -> dict[str, list[Measurement]]:
    """Prior points per partition key from the warm-start runs' journals (rows of ``backend``'s
    hardware); {} without a warm start. Any problem is one ``search.warm_start: ...`` line."""
    dirs = warm_dirs(ctx)
    if not dirs:
        return {}
    from kareus.search.warm import load_prior

    try:
        return load_prior(dirs, str(backend.name), list(keys))
    except ValueError as err:
        raise KareusError(str(err)) from None


def carried(points: dict[str, list[Measurement]], keys: Sequence[str]) -> list[SearchResult]:
    """Search results of partitions outside ``search.only``, from the warm-start runs' measurements;
    one line naming those the runs never measured."""
    from kareus.frontier import Frontier

    bare = [k for k in keys if not points.get(k)]
    if bare:
        raise KareusError(f"search.only: {', '.join(bare)} {'is' if len(bare) == 1 else 'are'} not searched and "
                          f"search.warm_start has no measurement of {'it' if len(bare) == 1 else 'them'} to carry; "
                          f"add {'it' if len(bare) == 1 else 'them'} to search.only")
    out = []
    for k in keys:
        ms = [m for m in points[k] if not m.failed]
        t, e, d = ([getattr(m, a) for m in ms] for a in ("time_s", "energy_j", "dynamic_energy_j"))
        out.append(SearchResult(partition=k, measurements=list(ms), settings=list(ms),
                                frontier=Frontier.from_arrays(t, e, ms, "total"),
                                dynamic_frontier=Frontier.from_arrays(t, d, ms, "dynamic")))
    return out
