"""Space-filling initial designs over the encoded candidates (Latin hypercube, seeded)."""
from __future__ import annotations

import numpy as np

from kareus.types import Candidate, PartitionType


def _grid_coords(space: list[Candidate], partition: PartitionType) -> np.ndarray:
    """Each candidate as (slot rank, SM rank, clock rank), each scaled to [0, 1]."""
    order = {label: i for i, label in enumerate(partition.slot_labels)}
    cols = [
        [order.get(c.slot, len(order)) for c in space],
        [c.sms for c in space],
        [c.freq_mhz for c in space],
    ]
    out = np.zeros((len(space), 3))
    for j, col in enumerate(cols):
        levels = np.unique(col)
        rank = np.searchsorted(levels, col)
        out[:, j] = rank / max(len(levels) - 1, 1)
    return out


def latin_hypercube(space: list[Candidate], partition: PartitionType, n: int, seed: int) -> list[Candidate]:
    """``n`` distinct candidates nearest to a seeded Latin-hypercube sample of the grid levels."""
    from scipy.stats import qmc

    n = min(n, len(space))
    if n <= 0:
        return []
    coords = _grid_coords(space, partition)
    sample = qmc.LatinHypercube(d=3, seed=np.random.default_rng(seed)).random(n)
    free = np.ones(len(space), dtype=bool)
    picks = []
    rng = np.random.default_rng(seed + 1)
    for p in sample:
        d = np.sum((coords - p) ** 2, axis=1) + rng.random(len(space)) * 1e-9  # random tie-break
        d[~free] = np.inf
        i = int(np.argmin(d))
        free[i] = False
        picks.append(space[i])
    return picks
