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


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _figures():
    rows, frontier = _rows()
    it = Frontier.from_arrays([1.0, 1.1, 1.3], [1000.0, 900.0, 850.0])
    return {"partition": plots.partition_frontier_figure(rows, frontier, note="hardware: sim (simulated)"),
            "hypervolume": plots.hypervolume_figure([8, 16, 24], [0.5, 0.52, 0.53], budget=30,
                                                    reference=(3e-3, 0.6)),
            "iteration": plots.iteration_frontier_figure(it, reference=(1.02, 1050.0), selected=(1.1, 900.0),
                                                         baseline=Frontier.from_arrays([1.02], [1050.0])),
            "grid": plots.frontiers_figure({"stage0.fwd": it, "stage0.bwd": it},
                                           references={"stage0.fwd": (1.02, 1050.0)})}


@pytest.mark.parametrize("name", ["partition", "hypervolume", "iteration", "grid"])
def test_legends_sit_outside_every_axes(name):
    """A legend in the data area covered measured points (upper right, where slow, costly ones lie)."""
    fig = _figures()[name]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert fig.legends and all(ax.get_legend() is None for ax in fig.axes)
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        assert not any(_overlaps(box, ax.get_window_extent(renderer)) for ax in fig.axes)


def test_hypervolume_plot_is_a_ratio_from_zero_to_one():
    """The raw s x J axis was zoomed to 0.01160-0.01180: a 0.1% gain filled the plot."""
    fig = plots.hypervolume_figure([8, 16, 24], [0.5, 0.5004, 0.5006], reference=(3e-3, 0.6))
    [ax] = fig.axes
    assert ax.get_ylim() == (0.0, 1.0) and "ratio" in ax.get_ylabel()
    assert "(0, 0)-(3 ms, 600 mJ)" in fig.legends[0].get_title().get_text()


def test_microbatch_panels_share_one_time_unit_and_clip_negative_energy():
    """Panels in s beside panels in ms read as one scale; a negative dynamic energy stretched the axis."""
    fwd = Frontier.from_arrays([0.2, 0.4, 0.6], [20.0, 2.0, -3.0])  # ms-sized alone
    bwd = Frontier.from_arrays([0.5, 0.8, 1.1], [40.0, 10.0, -0.5])
    fig = plots.frontiers_figure({"stage0.fwd": fwd, "stage0.bwd": bwd}, energy="dynamic energy")
    assert {ax.get_xlabel() for ax in fig.axes} == {"time (s)"}
    assert {ax.get_ylabel() for ax in fig.axes} == {"dynamic energy (J)"}
    for ax in fig.axes:
        frontier_line, clipped = ax.get_lines()
        assert min(frontier_line.get_ydata()) == 0.0
        assert list(clipped.get_ydata()) == [0.0] and clipped.get_marker() == "v"
        assert ", 1 at 0 J)" in ax.get_title()
    assert "2 points with dynamic energy below 0 J drawn at 0" in fig.get_suptitle()
    assert plots.clip_energies([1.0, -2.0, 0.0]) == ([1.0, 0.0, 0.0], 1)


def test_a_one_point_baseline_at_the_reference_stays_visible():
    """A 1-point Perseus frontier at Megatron's own setting was hidden under the filled reference star."""
    it = Frontier.from_arrays([1.0, 1.1], [1000.0, 900.0])
    fig = plots.iteration_frontier_figure(it, reference=(1.02, 1050.0), baseline=Frontier.from_arrays([1.02], [1050.0]))
    [ax] = fig.axes
    lines = {line.get_label().split(" (")[0]: line for line in ax.get_lines()}
    star, perseus = lines["Megatron"], lines["Megatron + Perseus"]
    assert star.get_markerfacecolor() == "none" and star.get_zorder() < perseus.get_zorder()
