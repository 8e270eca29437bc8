"""PNG plots of frontiers and search progress (matplotlib, Agg canvas: no display, no global state).

Functions take plain numbers (rows, Frontier objects) and a path, so they serve MLflow, benchmarks
and reports alike.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from kareus.frontier import Frontier

_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
_ENERGY_UNITS = ((1e6, "MJ"), (1e3, "kJ"), (1.0, "J"), (1e-3, "mJ"))


def _unit(values: Sequence[float], units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """Largest unit in which the biggest value is at least 1 (seconds, J, ...)."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(finite) if finite else 1.0
    for scale, name in units:
        if top >= scale:
            return scale, name
    return units[-1]


def _figure(width: float = 7.0, height: float = 4.8):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _staircase(ax, times: Sequence[float], energies: Sequence[float], **kw) -> None:
    """The frontier as the boundary of what it dominates: steps between its points."""
    ax.step(times, energies, where="post", **kw)


def plot_partition_frontier(rows: Sequence[Mapping[str, Any]], frontier: Frontier | None, path: str | Path,
                            title: str = "Partition frontier", note: str | None = None) -> Path:
    """Every measured candidate (coloured by SM clock, marker by launch slot) with the frontier on top."""
    ok = [r for r in rows if not r.get("failed") and _ok(r.get("time_s")) and _ok(r.get("energy_j"))]
    times = [r["time_s"] for r in ok] + (list(frontier.times) if frontier else [])
    energies = [r["energy_j"] for r in ok] + (list(frontier.energies) if frontier else [])
    ts, tu = _unit(times, _TIME_UNITS)
    es, eu = _unit(energies, _ENERGY_UNITS)
    from matplotlib.lines import Line2D

    fig = _figure()
    ax = fig.add_subplot()
    handles: list = []
    if ok:
        clocks = [float(r.get("freq_mhz") or 0) for r in ok]
        slots = sorted({str(r.get("slot", "")) for r in ok})
        markers = "osD^v<>ph*XP"
        lo, hi = min(clocks), max(clocks)
        sc = None
        for i, slot in enumerate(slots):
            sel = [r for r in ok if str(r.get("slot", "")) == slot]
            sc = ax.scatter([r["time_s"] / ts for r in sel], [r["energy_j"] / es for r in sel],
                            c=[float(r.get("freq_mhz") or 0) for r in sel], cmap="viridis",
                            vmin=lo, vmax=hi if hi > lo else lo + 1, marker=markers[i % len(markers)],
                            s=26, alpha=0.8, linewidths=0)
            handles.append(Line2D([], [], ls="none", marker=markers[i % len(markers)], color="dimgrey",
                                  label=f"{slot} ({len(sel)})"))
        cb = fig.colorbar(sc, ax=ax)
        cb.set_label("SM clock (MHz)")
    if frontier is not None and len(frontier):
        _staircase(ax, frontier.times / ts, frontier.energies / es, color="crimson", lw=1.4, zorder=3)
        ax.scatter(frontier.times / ts, frontier.energies / es, s=70, facecolors="none", edgecolors="crimson",
                   linewidths=1.6, zorder=4)
        handles.append(Line2D([], [], color="crimson", marker="o", mfc="none", mew=1.6,
                              label=f"Pareto frontier ({len(frontier)})"))
    ax.set_xlabel(f"time ({tu})")
    ax.set_ylabel(f"energy ({eu})")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11)
    ax.grid(True, alpha=0.3)
    if handles:
        ax.legend(handles=handles, fontsize=8, title="launch slot (measured)", title_fontsize=8, loc="upper right")
    failed = len(rows) - len(ok)
    if failed:
        ax.text(0.01, 0.01, f"{failed} failed candidate(s) not shown", transform=ax.transAxes, fontsize=8,
                color="grey")
    return _save(fig, path)


def plot_hypervolume(profiled: Sequence[int], hypervolume: Sequence[float], path: str | Path,
                     title: str = "Hypervolume against profiled candidates", note: str | None = None,
                     budget: int | None = None) -> Path:
    """How the dominated area grows as the search spends its profiling budget."""
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    if len(profiled):
        ax.step(list(profiled), list(hypervolume), where="post", color="tab:blue", lw=1.6)
        ax.plot(list(profiled), list(hypervolume), "o", color="tab:blue", ms=4)
    if budget:
        ax.axvline(budget, color="grey", ls="--", lw=1, label=f"budget ({budget})")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("profiled candidates")
    ax.set_ylabel("hypervolume (s × J)")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_iteration_frontier(frontier: Frontier, path: str | Path, reference: tuple[float, float] | None = None,
                            selected: tuple[float, float] | None = None, title: str = "Iteration frontier",
                            note: str | None = None, reference_label: str = "Megatron (reference)",
                            baseline: Frontier | None = None,
                            baseline_label: str = "Megatron + Perseus") -> Path:
    """The iteration time-energy frontier, the Megatron reference point, the selected plan and the
    ``baseline`` frontier (Megatron + Perseus)."""
    extra = [p for p in (reference, selected) if p is not None]
    if baseline is not None:
        extra += list(zip(baseline.times, baseline.energies))
    ts, tu = _unit(list(frontier.times) + [p[0] for p in extra], _TIME_UNITS)
    es, eu = _unit(list(frontier.energies) + [p[1] for p in extra], _ENERGY_UNITS)
    fig = _figure()
    ax = fig.add_subplot()
    if len(frontier):
        ax.plot(frontier.times / ts, frontier.energies / es, "-o", color="tab:blue", ms=4, lw=1.4,
                label=f"Kareus frontier ({len(frontier)} plans)")
    if baseline is not None and len(baseline):
        ax.plot(baseline.times / ts, baseline.energies / es, "--s", color="tab:gray", ms=3, lw=1.2,
                label=f"{baseline_label} ({len(baseline)} points)")
    if reference is not None:
        ax.plot(reference[0] / ts, reference[1] / es, marker="*", ms=16, color="crimson", ls="none",
                label=reference_label)
    if selected is not None:
        ax.plot(selected[0] / ts, selected[1] / es, marker="o", ms=12, mfc="none", mec="black", mew=2, ls="none",
                label="selected plan")
        if reference is not None and reference[1] > 0 and reference[0] > 0:
            de = 100.0 * (1 - selected[1] / reference[1])
            dt = 100.0 * (selected[0] / reference[0] - 1)
            ax.annotate(f"vs reference:\nenergy {-de:+.1f}%\ntime {dt:+.1f}%", (selected[0] / ts, selected[1] / es),
                        textcoords="offset points", xytext=(12, 12), fontsize=9)
    ax.set_xlabel(f"iteration time ({tu})")
    ax.set_ylabel(f"iteration energy ({eu})")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=9)
    return _save(fig, path)


def plot_frontiers(frontiers: Mapping[str, Frontier], path: str | Path, title: str = "Microbatch frontiers",
                   note: str | None = None, references: Mapping[str, tuple[float, float]] | None = None,
                   energy: str = "energy") -> Path:
    """Several frontiers (e.g. one per stage and direction), one panel each, in a grid; ``energy``
    names what their energy axis holds (the microbatch frontiers hold dynamic energy)."""
    keys = list(frontiers)
    n = max(1, len(keys))
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = _figure(4.0 * ncols, 3.2 * nrows + 0.5)
    for i, key in enumerate(keys):
        f = frontiers[key]
        ref = (references or {}).get(key)
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ts, tu = _unit(list(f.times) + ([ref[0]] if ref else []), _TIME_UNITS)
        es, eu = _unit(list(f.energies) + ([ref[1]] if ref else []), _ENERGY_UNITS)
        if len(f):
            ax.plot(f.times / ts, f.energies / es, "-o", ms=3, lw=1.2, color="tab:blue")
        if ref:
            ax.plot(ref[0] / ts, ref[1] / es, "*", ms=12, color="crimson")
        ax.set_title(f"{key} ({len(f)} points)", fontsize=9)
        ax.set_xlabel(f"time ({tu})", fontsize=8)
        ax.set_ylabel(f"{energy} ({eu})", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title + (f" ({note})" if note else ""), fontsize=11)
    return _save(fig, path)


def _ok(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
