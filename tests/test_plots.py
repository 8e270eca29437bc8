"""Plots render readable PNGs from plain rows and frontiers, including awkward inputs."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kareus.events import CandidateMeasured
from kareus.frontier import Frontier
from kareus.tracking import plots
from kareus.tracking.records import candidate_row
from tracking_fakes import search_events


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _rows(n: int = 24):
    events = search_events("fwd_attn", n=n, batch=8)
    return [candidate_row(e) for e in events if isinstance(e, CandidateMeasured)], events[-1].frontier


def test_partition_frontier_plot(tmp_path):
    rows, frontier = _rows()
    out = plots.plot_partition_frontier(rows, frontier, tmp_path / "sub" / "f.png", note="hardware: sim (simulated)")
    w, h = _png_size(out)
    assert w > 600 and h > 400


def test_units_follow_the_magnitudes():
    assert plots._unit([2.5e-3, 1e-3], plots._TIME_UNITS) == (1e-3, "ms")
    assert plots._unit([3.2, 0.5], plots._TIME_UNITS) == (1.0, "s")
    assert plots._unit([2500.0], plots._ENERGY_UNITS) == (1e3, "kJ")
    assert plots._unit([0.25], plots._ENERGY_UNITS) == (1e-3, "mJ")
    assert plots._unit([float("nan")], plots._ENERGY_UNITS) == (1.0, "J")


@pytest.mark.parametrize("case", ["empty", "all_failed", "one_clock"])
def test_partition_plot_survives_awkward_inputs(tmp_path, case):
    rows, frontier = _rows(6)
    if case == "empty":
        rows, frontier = [], Frontier(())
    elif case == "all_failed":
        rows = [{**r, "failed": True, "time_s": float("nan"), "energy_j": float("nan")} for r in rows]
        frontier = Frontier(())
    else:
        rows = [{**r, "freq_mhz": 1410} for r in rows]
    _png_size(plots.plot_partition_frontier(rows, frontier, tmp_path / f"{case}.png"))


def test_iteration_hypervolume_and_grid_plots(tmp_path):
    it = Frontier.from_arrays([1.0, 1.1, 1.3], [1000.0, 900.0, 850.0])
    _png_size(plots.plot_iteration_frontier(it, tmp_path / "it.png", reference=(1.02, 1050.0), selected=(1.1, 900.0)))
    _png_size(plots.plot_iteration_frontier(Frontier(()), tmp_path / "empty.png"))
    base = Frontier.from_arrays([1.02, 1.4, 2.0], [1000.0, 950.0, 940.0])  # beyond the frontier's range
    _png_size(plots.plot_iteration_frontier(it, tmp_path / "base.png", reference=(1.02, 1050.0), baseline=base))
    _png_size(plots.plot_hypervolume([8, 16, 24], [0.1, 0.2, 0.21], tmp_path / "hv.png", budget=30))
    w, h = _png_size(plots.plot_frontiers({f"stage{i}.fwd": it for i in range(4)}, tmp_path / "grid.png",
                                          references={"stage0.fwd": (1.02, 1050.0)}))
    assert w > h  # 4 panels: 3 columns, 2 rows
