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
ENERGY_FLOOR = 0.0  # J: energies below it are drawn at it, and the figure says how many


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


def _legend_below(fig, handles: Sequence[Any] | None = None, **kw) -> None:
    """One legend for the figure, below its axes: a legend inside the data area covers points."""
    if handles is None:
        handles = [h for ax in fig.axes for h in ax.get_legend_handles_labels()[0]]
    if handles:
        fig.legend(handles=list(handles), loc="outside lower center", ncols=min(3, len(handles)),
                   fontsize=8, frameon=False, **kw)


def clip_energies(energies: Sequence[float], floor: float = ENERGY_FLOOR) -> tuple[list[float], int]:
    """Energies with those below ``floor`` raised to it, and how many were raised.

    Dynamic energy can come out negative (a composed option's static share overestimated); such
    points are drawn at the floor and counted in a note rather than stretching the axis below 0.
    """
    clipped = [max(float(e), floor) for e in energies]
    return clipped, sum(1 for e in energies if float(e) < floor)


def _clip_note(count: int, energy: str, floor: float = ENERGY_FLOOR) -> str:
    """The figure's statement of how many points were drawn at the floor instead of their value."""
    return f"{count} point{'s' if count != 1 else ''} with {energy} below {floor:g} J drawn at {floor:g} (▼)"


def partition_frontier_figure(rows: Sequence[Mapping[str, Any]], frontier: Frontier | None,
                              title: str = "Partition frontier", note: str | None = None):
    """The figure of :func:`plot_partition_frontier` (returned for inspection)."""
    ok = [r for r in rows if not r.get("failed") and _ok(r.get("time_s")) and _ok(r.get("energy_j"))]
    times = [r["time_s"] for r in ok] + (list(frontier.times) if frontier else [])
    energies = [r["energy_j"] for r in ok] + (list(frontier.energies) if frontier else [])
    ts, tu = _unit(times, _TIME_UNITS)
    es, eu = _unit(energies, _ENERGY_UNITS)
    from matplotlib.lines import Line2D

    fig = _figure(7.0, 5.4)
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
    failed = len(rows) - len(ok)
    lines = [title, note, f"{failed} failed candidate(s) not shown" if failed else None]
    ax.set_title("\n".join(x for x in lines if x), fontsize=11)
    ax.grid(True, alpha=0.3)
    _legend_below(fig, handles, title="launch slot (measured)", title_fontsize=8)
    return fig


def plot_partition_frontier(rows: Sequence[Mapping[str, Any]], frontier: Frontier | None, path: str | Path,
                            title: str = "Partition frontier", note: str | None = None) -> Path:
    """Every measured candidate (coloured by SM clock, marker by launch slot) with the frontier on top."""
    return _save(partition_frontier_figure(rows, frontier, title, note), path)


RATIO_LABEL = "hypervolume ratio (0-1)"


def hypervolume_figure(profiled: Sequence[int], ratios: Sequence[float],
                       title: str = "Hypervolume ratio against profiled candidates", note: str | None = None,
                       budget: int | None = None, reference: tuple[float, float] | None = None):
    """The figure of :func:`plot_hypervolume` (returned for inspection)."""
    fig = _figure(6.4, 4.4)
    ax = fig.add_subplot()
    if len(profiled):
        ax.step(list(profiled), list(ratios), where="post", color="tab:blue", lw=1.6, label="measured front")
        ax.plot(list(profiled), list(ratios), "o", color="tab:blue", ms=4)
        ax.annotate(f"{ratios[-1]:.4f}", (profiled[-1], ratios[-1]), textcoords="offset points", xytext=(-4, 6),
                    ha="right", fontsize=8, color="tab:blue")
    if budget:
        ax.axvline(budget, color="grey", ls="--", lw=1, label=f"budget ({budget})")
    ax.set_xlabel("profiled candidates")
    ax.set_ylabel(RATIO_LABEL)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlim(left=0)
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11)
    ax.grid(True, alpha=0.3)
    _legend_below(fig, title=_ratio_caption(reference), title_fontsize=8)
    return fig


def _ratio_caption(reference: tuple[float, float] | None) -> str:
    """What the ratio is a share of, in the reference's own units."""
    if reference is None:
        return "share of the rectangle (0 s, 0 J)-reference point that the measured front dominates"
    ts, tu = _unit([reference[0]], _TIME_UNITS)
    es, eu = _unit([reference[1]], _ENERGY_UNITS)
    return (f"share of the rectangle (0, 0)-({reference[0] / ts:.4g} {tu}, {reference[1] / es:.4g} {eu}) "
            "that the measured front dominates")


def plot_hypervolume(profiled: Sequence[int], ratios: Sequence[float], path: str | Path,
                     title: str = "Hypervolume ratio against profiled candidates", note: str | None = None,
                     budget: int | None = None, reference: tuple[float, float] | None = None) -> Path:
    """How the dominated share of the search's fixed reference rectangle grows as it spends its budget;
    the axis runs 0..1 so a late gain of 0.001 looks as small as it is."""
    return _save(hypervolume_figure(profiled, ratios, title, note, budget, reference), path)


def iteration_frontier_figure(frontier: Frontier, reference: tuple[float, float] | None = None,
                              selected: tuple[float, float] | None = None, title: str = "Iteration frontier",
                              note: str | None = None, reference_label: str = "Megatron (reference)",
                              baseline: Frontier | None = None, baseline_label: str = "Megatron + Perseus"):
    """The figure of :func:`plot_iteration_frontier` (returned for inspection)."""
    extra = [p for p in (reference, selected) if p is not None]
    if baseline is not None:
        extra += list(zip(baseline.times, baseline.energies))
    ts, tu = _unit(list(frontier.times) + [p[0] for p in extra], _TIME_UNITS)
    es, eu = _unit(list(frontier.energies) + [p[1] for p in extra], _ENERGY_UNITS)
    fig = _figure(7.0, 5.2)
    ax = fig.add_subplot()
    if len(frontier):
        ax.plot(frontier.times / ts, frontier.energies / es, "-o", color="tab:blue", ms=4, lw=1.4, zorder=3,
                label=f"Kareus frontier ({len(frontier)} plans)")
    if baseline is not None and len(baseline):
        ax.plot(baseline.times / ts, baseline.energies / es, "--s", color="tab:gray", ms=4, lw=1.2, zorder=3,
                label=f"{baseline_label} ({len(baseline)} points)")
    if reference is not None:  # hollow and beneath: a frontier point at Megatron's own setting stays visible
        ax.plot(reference[0] / ts, reference[1] / es, marker="*", ms=16, mfc="none", mec="crimson", mew=1.6,
                ls="none", zorder=2, label=reference_label)
    if selected is not None:
        ax.plot(selected[0] / ts, selected[1] / es, marker="o", ms=12, mfc="none", mec="black", mew=2, ls="none",
                zorder=4, label="selected plan")
        if reference is not None and reference[1] > 0 and reference[0] > 0:
            # savings as in the terminal, CSVs and MLflow: positive = faster / less energy
            te = 100.0 * (1 - selected[0] / reference[0]), 100.0 * (1 - selected[1] / reference[1])
            ax.annotate(f"saving vs reference:\ntime {te[0]:+.1f}%\nenergy {te[1]:+.1f}%",
                        (selected[0] / ts, selected[1] / es),
                        textcoords="offset points", xytext=(12, 12), fontsize=9)
    ax.set_xlabel(f"iteration time ({tu})")
    ax.set_ylabel(f"iteration energy ({eu})")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=11)
    ax.grid(True, alpha=0.3)
    _legend_below(fig)
    return fig


def plot_iteration_frontier(frontier: Frontier, path: str | Path, reference: tuple[float, float] | None = None,
                            selected: tuple[float, float] | None = None, title: str = "Iteration frontier",
                            note: str | None = None, reference_label: str = "Megatron (reference)",
                            baseline: Frontier | None = None,
                            baseline_label: str = "Megatron + Perseus") -> Path:
    """The iteration time-energy frontier, the Megatron reference point, the selected plan and the
    ``baseline`` frontier (Megatron + Perseus)."""
    return _save(iteration_frontier_figure(frontier, reference, selected, title, note, reference_label, baseline,
                                           baseline_label), path)


def frontiers_figure(frontiers: Mapping[str, Frontier], title: str = "Microbatch frontiers",
                     note: str | None = None, references: Mapping[str, tuple[float, float]] | None = None,
                     energy: str = "energy"):
    """The figure of :func:`plot_frontiers` (returned for inspection)."""
    from matplotlib.lines import Line2D

    keys = list(frontiers)
    refs = {k: v for k, v in (references or {}).items() if k in frontiers}
    n = max(1, len(keys))
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = _figure(4.0 * ncols, 3.2 * nrows + 1.0)
    # one unit per figure: panels side by side in s and ms read as if on one scale
    ts, tu = _unit([t for f in frontiers.values() for t in f.times] + [r[0] for r in refs.values()], _TIME_UNITS)
    es, eu = _unit([e for f in frontiers.values() for e in f.energies] + [r[1] for r in refs.values()],
                   _ENERGY_UNITS)
    floor, clipped_total = ENERGY_FLOOR, 0
    for i, key in enumerate(keys):
        f = frontiers[key]
        ref = refs.get(key)
        ax = fig.add_subplot(nrows, ncols, i + 1)
        shown, clipped = clip_energies(list(f.energies))
        clipped_total += clipped
        if len(f):
            ax.plot(f.times / ts, [e / es for e in shown], "-o", ms=3, lw=1.2, color="tab:blue", zorder=3)
        if clipped:
            low = [(t / ts, floor / es) for t, e in zip(f.times, f.energies) if e < floor]
            ax.plot([p[0] for p in low], [p[1] for p in low], "v", ms=6, color="tab:orange", ls="none", zorder=4,
                    clip_on=False)
        if ref:
            ax.plot(ref[0] / ts, ref[1] / es, "*", ms=12, mfc="none", mec="crimson", mew=1.4, zorder=2)
        ax.set_title(f"{key} ({len(f)} points" + (f", {clipped} at {floor:g} J" if clipped else "") + ")",
                     fontsize=9)
        ax.set_xlabel(f"time ({tu})", fontsize=8)
        ax.set_ylabel(f"{energy} ({eu})", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color="tab:blue", marker="o", ms=3, lw=1.2, label="frontier")]
    if refs:
        handles.append(Line2D([], [], ls="none", marker="*", ms=10, mfc="none", mec="crimson",
                              label="Megatron (reference)"))
    if clipped_total:
        handles.append(Line2D([], [], ls="none", marker="v", color="tab:orange", label=f"{energy} below {floor:g} J"))
    lines = [title + (f" ({note})" if note else ""), _clip_note(clipped_total, energy) if clipped_total else None]
    fig.suptitle("\n".join(x for x in lines if x), fontsize=11)
    _legend_below(fig, handles)
    return fig


def plot_frontiers(frontiers: Mapping[str, Frontier], path: str | Path, title: str = "Microbatch frontiers",
                   note: str | None = None, references: Mapping[str, tuple[float, float]] | None = None,
                   energy: str = "energy") -> Path:
    """Several frontiers (e.g. one per stage and direction), one panel each, in a grid, all in one time
    and one energy unit; ``energy`` names what their energy axis holds (the microbatch frontiers hold
    dynamic energy, which can be negative: such points are drawn at 0 J and counted in the title)."""
    return _save(frontiers_figure(frontiers, title, note, references, energy), path)


def _ok(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
