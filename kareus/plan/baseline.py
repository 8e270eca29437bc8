"""Plans against a baseline frontier at equal time: the comparison the energy claims rest on.

For each point of the baseline (Megatron + Perseus: Megatron's layout with a clock per instruction),
the least-energy plan no slower than it, and the energy that plan saves. Plans faster than every
baseline point have no counterpart there; their savings are stated against the Megatron reference.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from kareus.plan.model import ExecutionPlan
from kareus.plan.report import even_spread, exact
from kareus.frontier import within_limit


@dataclass(frozen=True)
class EqualTime:
    """One baseline point and the least-energy plan within its time (None: no plan is that fast)."""

    baseline_time_s: float
    baseline_energy_j: float
    plan: ExecutionPlan | None

    @property
    def energy_saving_pct(self) -> float | None:
        """The plan's energy saving against the baseline point, positive = less energy."""
        if self.plan is None or self.baseline_energy_j <= 0:
            return None
        return 100.0 * (1.0 - self.plan.predicted_energy_j / self.baseline_energy_j)


def equal_time(plans: Sequence[ExecutionPlan], baseline: Sequence[tuple[float, float]]) -> list[EqualTime]:
    """Every baseline (time, energy) point, fastest first, beside the least-energy plan within its time."""
    out = []
    for t, e in sorted(baseline):
        within = [p for p in plans if within_limit(p.predicted_time_s, t)]
        best = min(within, key=lambda p: (p.predicted_energy_j, p.predicted_time_s)) if within else None
        out.append(EqualTime(float(t), float(e), best))
    return out


def least_energy_within(points: Iterable[tuple[float, float]], time_s: float) -> float | None:
    """The least energy among (time, energy) points no slower than ``time_s`` (None: none is)."""
    within = [e for t, e in points if within_limit(t, time_s)]
    return min(within) if within else None


def savings_summary(plans: Sequence[ExecutionPlan], rows: Sequence[EqualTime],
                    reference_time_s: float) -> dict[str, float]:
    """The energy saved at the reference's time (Megatron's: the least-energy plan within it against
    the baseline's least energy within it), and the least and most over the baseline's frontier."""
    s = [r.energy_saving_pct for r in rows if r.energy_saving_pct is not None]
    if not s:
        return {}
    out = {"baseline_points": float(len(rows)), "baseline_min_time_s": rows[0].baseline_time_s,
           "baseline_min_energy_j": min(r.baseline_energy_j for r in rows),
           "energy_saving_min_pct": min(s), "energy_saving_max_pct": max(s)}
    base = least_energy_within([(r.baseline_time_s, r.baseline_energy_j) for r in rows], reference_time_s)
    if base is not None:
        [at] = equal_time(plans, [(reference_time_s, base)])
        if at.energy_saving_pct is not None:
            out["energy_saving_at_reference_pct"] = at.energy_saving_pct
    return out


def write_equal_time_csv(path: str | Path, rows: Sequence[EqualTime]) -> Path:
    """The baseline frontier with each point's least-energy plan within its time."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["time_s", "energy_j", "plan", "plan_time_s", "plan_energy_j", "energy_saving_pct"])
        for r in rows:
            p, s = r.plan, r.energy_saving_pct
            w.writerow([exact(r.baseline_time_s), exact(r.baseline_energy_j), "" if p is None else p.id,
                        "" if p is None else exact(p.predicted_time_s),
                        "" if p is None else exact(p.predicted_energy_j), "" if s is None else f"{s:.4f}"])
    return path


def equal_time_table(rows: Sequence[EqualTime], title: str, max_rows: int = 8):
    """A rich Table: baseline points (both ends and an even spread) beside their least-energy plans."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("baseline time (s)", "baseline energy (J)", "plan", "plan time (s)", "plan energy (J)",
                "energy saving"):
        table.add_column(col, justify="left" if col == "plan" else "right", overflow="fold")  # never cut a number
    for r in (rows[i] for i in sorted(even_spread(len(rows), max_rows))):
        p, s = r.plan, r.energy_saving_pct
        table.add_row(f"{r.baseline_time_s:.4f}", f"{r.baseline_energy_j:.1f}",
                      "none this fast" if p is None else f"plan {p.id}",
                      "-" if p is None else f"{p.predicted_time_s:.4f}",
                      "-" if p is None else f"{p.predicted_energy_j:.1f}", "-" if s is None else f"{s:+.2f}%")
    return table
