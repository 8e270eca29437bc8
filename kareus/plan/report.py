"""Run outputs of the planning stage: the iteration frontier CSV, plan files, and a table beside Megatron.

The Megatron reference point is Megatron-LM's own layout: microbatches unsplit, every comm kernel
after its compute at the comm library's default SMs, the top clock; the caller measures it (same
backend as the search) and prices it with ``kareus.compose.fixed_option_iteration``.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional, Sequence

from kareus.compose.iteration import Assignment
from kareus.errors import KareusError
from kareus.plan.io import save_plan
from kareus.plan.model import ExecutionPlan


def exact(x: float) -> str:
    """The shortest text that reads back as the same float: a time or energy copied from a CSV into
    ``plan.deadline_s`` or ``plan.energy_budget_j`` is met by the plan it came from (the limit's own
    solve may find one at least as good; a plan found again keeps its id)."""
    return repr(float(x))


def saving_pct(ref: float | None, value: float) -> float | None:
    """The saving against ``ref`` in percent, positive = better (faster / less energy); None without one."""
    return None if not ref else 100.0 * (ref - value) / ref


def plan_file(plan: ExecutionPlan) -> str:
    """``plans/plan_<id>.yaml``, relative to the run directory."""
    return f"plans/plan_{plan.id}.yaml"


def even_spread(n: int, max_rows: int) -> set[int]:
    """Positions of at most ``max_rows`` of ``n`` rows: both ends and an even spread between them."""
    if n <= max_rows:
        return set(range(n))
    step = (n - 1) / (max_rows - 1) if max_rows > 1 else 0.0
    return {round(i * step) for i in range(max(max_rows, 1))}


def write_run_outputs(run_dir: str | Path, plans: Sequence[ExecutionPlan], selected: ExecutionPlan | None = None,
                      reference: Assignment | None = None) -> dict[str, Path]:
    """Write ``frontier_iteration.csv`` (fastest first), ``plans/plan_<id>.yaml`` and ``plan_selected.yaml``
    into ``run_dir``.

    Plan files of an earlier run in the same folder that this run does not write are removed, a
    ``plan_selected.yaml`` too when nothing is selected: a launcher reading the folder must not take
    an old plan for this run's.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_distinct_ids(plans)
    _remove_stale_plans(run_dir, {Path(plan_file(p)).name for p in plans}, keep_selected=selected is not None)
    out: dict[str, Path] = {}
    csv_path = run_dir / "frontier_iteration.csv"
    ref_t = reference.time_s if reference else None
    ref_e = reference.energy_j if reference else None
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["plan", "time_s", "energy_j", "dynamic_energy_j", "static_energy_j", "time_saving_pct",
                    "energy_saving_pct", "plan_file"])
        if reference is not None:
            w.writerow(["megatron_reference", exact(reference.time_s), exact(reference.energy_j),
                        exact(reference.dynamic_energy_j), exact(reference.static_energy_j), "0", "0", ""])
        for p in plans:
            st = p.predicted_energy_j - p.predicted_dynamic_energy_j
            ts, es = saving_pct(ref_t, p.predicted_time_s), saving_pct(ref_e, p.predicted_energy_j)
            w.writerow([p.id, exact(p.predicted_time_s), exact(p.predicted_energy_j),
                        exact(p.predicted_dynamic_energy_j), exact(st),
                        "" if ts is None else f"{ts:.4f}", "" if es is None else f"{es:.4f}", plan_file(p)])
    out["frontier_iteration"] = csv_path
    for p in plans:
        save_plan(p, run_dir / plan_file(p))
    out["plans"] = run_dir / "plans"
    if selected is not None:
        out["plan_selected"] = save_plan(selected, run_dir / "plan_selected.yaml")
    return out


def _check_distinct_ids(plans: Sequence[ExecutionPlan]) -> None:
    """Two plans that run different settings under one id would share a file: refuse rather than lose one."""
    from kareus.plan.model import plan_settings

    seen: dict[str, ExecutionPlan] = {}
    for p in plans:
        other = seen.setdefault(p.id, p)
        if other is not p and plan_settings(other.stages) != plan_settings(p.stages):
            raise KareusError(f"plans {other.index} and {p.index} of the frontier share the id {p.id}")


COMPOSED_OUTPUTS = ("frontier_iteration.csv", "plan_selected.yaml", "frontier_perseus.csv")


def remove_run_outputs(run_dir: str | Path) -> None:
    """Remove what an earlier ``mode=run`` composed in this folder (the iteration frontiers and every
    plan): a run that composes nothing (``mode=search``) leaves its search outputs beside a config that
    no longer describes them, and a launcher must not take an old plan for this run's."""
    run_dir = Path(run_dir)
    for name in COMPOSED_OUTPUTS:
        (run_dir / name).unlink(missing_ok=True)
    _remove_stale_plans(run_dir, set(), keep_selected=False)
    try:
        (run_dir / "plans").rmdir()  # only when empty: files of the user's own stay
    except OSError:
        pass


def _remove_stale_plans(run_dir: Path, current: set[str], keep_selected: bool) -> None:
    stale = [p for p in (run_dir / "plans").glob("plan_*.yaml") if p.name not in current]
    if not keep_selected:
        stale.append(run_dir / "plan_selected.yaml")
    for path in stale:
        path.unlink(missing_ok=True)


def frontier_table(plans: Sequence[ExecutionPlan], reference: Assignment | None = None,
                   selected: Optional[ExecutionPlan] = None, max_rows: int = 16, title: str | None = None):
    """A rich Table of the iteration frontier beside the Megatron reference, with savings (predicted).

    Savings are against the reference, positive = better (faster / less energy); plans are listed
    fastest first and named by their ``id``.
    """
    from rich.table import Table

    table = Table(title=title or "Iteration frontier (predicted)")
    for col, just in (("plan", "left"), ("time (s)", "right"), ("energy (J)", "right"),
                      ("time saving", "right"), ("energy saving", "right"), ("", "left")):
        table.add_column(col, justify=just, overflow="fold")  # a narrow terminal wraps a number, never cuts it
    if reference is not None:
        table.add_row("Megatron (its own layout, top clock)", f"{reference.time_s:.4f}", f"{reference.energy_j:.1f}",
                      "-", "-", "reference", style="bold")
    rows = list(plans)
    if len(rows) > max_rows:  # keep both ends, the selected plan and an even spread
        keep = even_spread(len(rows), max_rows)
        if selected is not None:
            keep |= {i for i, p in enumerate(rows) if p.id == selected.id}
        rows = [p for i, p in enumerate(rows) if i in keep]
        table.caption = f"showing {len(rows)} of {len(plans)} plans (all in frontier_iteration.csv)"
    if plans:
        gpus = plans[0].num_stages * plans[0].gpus_per_stage
        table.title = f"{table.title}; energy per iteration, all {gpus} GPUs"
    ref_t = reference.time_s if reference else None
    ref_e = reference.energy_j if reference else None
    for p in rows:
        ts, es = saving_pct(ref_t, p.predicted_time_s), saving_pct(ref_e, p.predicted_energy_j)
        mark = "selected" if selected is not None and p.id == selected.id else ""
        table.add_row(f"plan {p.id}", f"{p.predicted_time_s:.4f}", f"{p.predicted_energy_j:.1f}",
                      "-" if ts is None else f"{ts:+.2f}%", "-" if es is None else f"{es:+.2f}%", mark,
                      style="green" if mark else None)
    return table


def compared_to(saving_pct: float, better: str, worse: str) -> str:
    """``6.1% faster`` / ``2.3% slower``: a saving against a reference, said the way it reads."""
    return f"{abs(saving_pct):.1f}% {better if saving_pct >= 0 else worse}"


def _ranges(mbs: Sequence[int]) -> str:
    """``0-3, 6`` for microbatches 0, 1, 2, 3, 6."""
    out, run = [], [mbs[0]]
    for m in mbs[1:]:
        if m == run[-1] + 1:
            run.append(m)
            continue
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [m]
    out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def plan_summary(plan: ExecutionPlan) -> list[str]:
    """A few lines that say what a plan runs: per stage and direction each clock with its microbatches,
    and per partition type the slots and comm SMs its instructions choose (how many use each)."""
    from collections import Counter, defaultdict

    lines = []
    for st in plan.stages:
        clocks = []
        for d in ("fwd", "bwd"):
            by_clock: dict[int, list[int]] = defaultdict(list)
            for ins in st.instructions:
                if ins.direction == d:
                    by_clock[ins.freq_mhz] += list(ins.microbatches)
            clocks.append(f"{d} " + ", ".join(f"{mhz} MHz (mb {_ranges(sorted(mbs))})"
                                              for mhz, mbs in sorted(by_clock.items(), key=lambda kv: min(kv[1]))))
        lines.append(f"stage {st.stage}: " + "; ".join(clocks))
    from kareus.partition.sequential import MEGATRON_PREFIX

    settings: dict[str, Counter] = defaultdict(Counter)
    megatron = total = 0
    for st in plan.stages:
        for ins in st.instructions:
            n = len(ins.microbatches)
            total += n
            if ins.partitions and all(p.partition.startswith(MEGATRON_PREFIX) for p in ins.partitions):
                megatron += n  # Megatron's own layout: its slots and SMs are megatron-core's
                continue
            for p in ins.partitions:
                settings[p.partition][(p.slot, p.sms)] += n
    lines.append(f"Megatron's layout in {megatron} of {total} instructions")
    for key in sorted(settings):
        used = sum(settings[key].values())
        choices = ", ".join(f"{slot} / {sms} SMs" + (f" ({n})" if len(settings[key]) > 1 else "")
                            for (slot, sms), n in settings[key].most_common())
        lines.append(f"{key} ({used} instruction{'s' if used != 1 else ''}): {choices}")
    return lines
