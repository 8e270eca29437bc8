"""``run_mode``: the body of ``python -m kareus`` once the config is valid.

describe: workload, partitions and search-space sizes; nothing measured.
search:   partition searches (journaled), partition frontiers and ``search_summary.json``.
run:      search, then composition, execution plans, selection, the frontier table and MLflow record.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from kareus.errors import KareusError, OutputClosed, RefusedWithOutputs
from kareus.pipeline.context import RunContext, build_context

if TYPE_CHECKING:
    from kareus.search.base import SearchResult


class _Console(Console):
    """rich's console, but a reader that left (``| head``) raises OutputClosed for the CLI to handle
    (rich itself exits with status 1 on the spot, before the CLI can clean up)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise OutputClosed


def run_mode(cfg: DictConfig, typed: dict[str, Any], run_dir: Path,
             previous_config: bytes | None = None) -> dict[str, Any]:
    """Run the configured mode; return a small summary (also what tests read). ``previous_config``: the
    saved config of a run that ``run_dir`` already held, before Hydra rewrote it."""
    if str(getattr(cfg.mode, "value", cfg.mode)) == "reset":  # this node's GPU clocks: no workload, no console
        from kareus.runtime.clock_state import reset_locked_clocks

        return reset_locked_clocks(all_gpus=bool(cfg.reset.all))
    from kareus.tracking.progress import live_terminal

    # a plain line is never broken (a run directory is copied into resume=); tables fit the width
    console = _Console(highlight=False, soft_wrap=True)
    if not live_terminal(console):  # logs and pipes (FORCE_COLOR too): wide enough that tables stay readable
        console = _Console(highlight=False, soft_wrap=True, width=160)
    ctx = build_context(cfg, typed, run_dir, previous_config)
    mode = str(getattr(cfg.mode, "value", cfg.mode))
    if mode == "describe":
        return _describe(ctx, console)
    if mode == "check":
        from kareus.check import run_check

        return run_check(ctx, console)
    if mode == "train":
        from kareus.train.run import run_train

        return run_train(cfg, typed, run_dir, ctx.model, ctx.parallel, console)
    return _search_and_plan(ctx, console, compose=(mode == "run"))


def _describe(ctx: RunContext, console: Console) -> dict[str, Any]:
    from kareus.describe import describe
    from kareus.pipeline.searching import opened_backend, partition_types, space_sizes
    from kareus.search.space import kept_slots

    with opened_backend(ctx) as backend:
        sizes = space_sizes(ctx, backend, partition_types(ctx, backend))
    _note_initial(ctx, sizes)
    if ctx.workload is not None and ctx.partitioning is not None:
        space = ctx.typed["search"].space
        describe(console, ctx.workload, ctx.partitioning, sizes,
                 {t.key: kept_slots(t, space) for t in ctx.partitioning.types})
    else:
        for key, n in sizes.items():
            console.print(f"{key}: {n} candidates")
    return {"mode": "describe", "space_sizes": sizes}


def _search_and_plan(ctx: RunContext, console: Console, compose: bool) -> dict[str, Any]:
    from kareus.pipeline.searching import opened_backend

    with opened_backend(ctx) as backend:
        return _search_and_plan_on(ctx, console, compose, backend)


def _search_and_plan_on(ctx: RunContext, console: Console, compose: bool, backend: Any) -> dict[str, Any]:
    from kareus.pipeline.searching import checked_launcher, make_tasks, partition_types, space_sizes
    from kareus.launch.launchers import WorkerLost
    from kareus.profiler.journal import JournalMismatchError
    from kareus.search.output import write_search_outputs
    from kareus.tracking import Tracker, default_run_name, hydra_context, make_progress

    from kareus.pipeline import warm

    every = partition_types(ctx, backend)
    partitions, left_out = warm.split(ctx, every)
    sizes = space_sizes(ctx, backend, every)
    prior = warm.prior(ctx, backend, [p.key for p in every])  # checked before anything is recorded
    carried = warm.carried(prior, left_out) if prior else []
    sizes = {k: n for k, n in sizes.items() if k not in left_out or carried}
    _note_initial(ctx, {k: n for k, n in sizes.items() if k not in left_out})
    launcher = checked_launcher(ctx, partitions)
    tracker = Tracker(ctx.typed["tracking"])
    hctx = hydra_context()
    if ctx.model is None and hctx:  # a replayed table's own partitions: no layout plays a part in them
        hctx["choices"] = {k: v for k, v in hctx["choices"].items() if k != "parallel"}
        hctx["run_name"] = default_run_name(hctx["choices"], hctx["overrides"])
    summary: dict[str, Any] = {"mode": "run" if compose else "search", "run_dir": str(ctx.run_dir),
                               "hardware": ctx.hardware_label, "simulated": ctx.simulated}  # so are its numbers
    with tracker:
        tracker.start(OmegaConf.to_container(ctx.cfg, resolve=True, enum_to_str=True),
                      choices=hctx.get("choices"), overrides=hctx.get("overrides", ()), hardware=ctx.hardware_label,
                      run_name=hctx.get("run_name"), tags={"config_hash": ctx.config_hash, "run_dir": str(ctx.run_dir)},
                      simulated=ctx.simulated)
        if tracker.run_id:  # mode=train tags its runs with the invocation that made the plan
            summary["mlflow_run_id"] = tracker.run_id
        tasks = make_tasks(ctx, partitions, lambda p: [tracker.partition_listener_factory(p.key, p.slot_labels)],
                           prior)
        progress = make_progress(ctx.numbers_kind, bool(ctx.cfg.progress), console=console)
        try:
            with progress:
                results = launcher.run(tasks, listeners=[progress])
        except JournalMismatchError as err:
            raise KareusError(f"journal: {err}") from None
        except WorkerLost as err:
            raise KareusError(f"{err}; what it measured is kept: continue with resume={ctx.run_dir}") from None
        searched = results
        if carried:  # outside search.only: the warm-start run's frontiers, at no profile of this run's
            results = [*results, *carried]
            summary["carried"] = [r.partition for r in carried]
            summary["warm_start"] = [str(d) for d in warm.warm_dirs(ctx)]
        search_summary = write_search_outputs(ctx.run_dir, results, sizes)
        for r in carried:
            search_summary[r.partition]["carried"] = True
        profiled = sum(len(r.measurements) for r in searched)
        gpu_seconds = sum(r.gpu_seconds for r in results)
        now = sum(r.measured_now for r in results)
        now_seconds = sum(r.measured_now_gpu_seconds for r in results)
        summary.update(search=search_summary, profiled=profiled, profiling_gpu_seconds=gpu_seconds,
                       measured_now=now, measured_now_gpu_seconds=now_seconds)
        summary.update(getattr(launcher, "summary", dict)())  # launcher=ray on several nodes: per-node GPU-hours
        _print_search_summary(console, search_summary, gpu_seconds, ctx)
        if ctx.cfg.get("resume") and profiled:  # what the journal answered, apart from what this run paid for
            label = _hours_label(ctx)
            console.print(f"resume: {profiled - now} candidates answered from the journal "
                          f"({(gpu_seconds - now_seconds) / 3600:.2f} {label}GPU-hours when they were measured), "
                          f"{now} measured now ({now_seconds / 3600:.2f} {label}GPU-hours)")
        from kareus.tracking.records import gpu_hours_name

        # before composing: a run whose plan is refused still records what its search cost
        tracker.log_summary({"profiled_candidates": profiled,
                             gpu_hours_name(ctx.simulated, "profiling_"): gpu_seconds / 3600.0})
        bare = no_frontier(results)
        if bare:  # nothing to plan from: a search-only run must not read as a success either
            _write_summary(ctx, summary)
            raise RefusedWithOutputs(f"search: {bare} (every measurement and its reason are in {ctx.journal_path})")
        if compose and ctx.partitioning is not None:
            summary.update(_compose_and_plan(ctx, console, backend, results, tracker))
            if "selection_error" in summary:  # refused once everything, the summary too, is on disk
                _write_summary(ctx, summary)
                raise RefusedWithOutputs(f"plan: {summary['selection_error']} (the frontier and all plans are in "
                                  f"{ctx.run_dir})")
        else:
            from kareus.plan import remove_run_outputs

            remove_run_outputs(ctx.run_dir)
    _write_summary(ctx, summary)
    console.print(f"run directory: {ctx.run_dir}")  # where resume= and the frontiers point
    return summary


def no_frontier(results: list[SearchResult]) -> str | None:
    """The partitions where every profile failed, with the first failure's reason, in one phrase; None
    when every partition has a frontier. A hardware description no candidate survives (a link of
    1e-300 GB/s overflows every time) would otherwise end a search-only run with exit 0 and empty
    frontiers, and a full run with a composer error that names no cause."""
    bare = [r for r in results if r.measurements and all(m.failed for m in r.measurements)]
    if not bare:
        return None
    first = next((m.flags[0] for m in bare[0].measurements if m.flags), "no reason recorded")
    parts = ", ".join(f"{r.partition} ({len(r.measurements)} profiles)" for r in bare)
    return f"every profile failed in {parts}, so there is no frontier to plan from; first reason: {first}"


def _note_initial(ctx: RunContext, sizes: dict[str, int]) -> None:
    """Warn before the searches start (on stderr: stdout carries the results) where ``search.initial``
    takes a partition's whole budget."""
    import sys

    from kareus.search.config import budget_for, initial_fills_budget

    cfg = ctx.typed["search"]
    full = initial_fills_budget(cfg, sizes)
    if full:
        budgets = sorted({budget_for(cfg, sizes[k]) for k in full})
        print(f"note: search.initial={cfg.initial} takes the whole budget ({', '.join(map(str, budgets))} "
              f"profiles) of {', '.join(full)}: {cfg.name} guides no batch there; lower search.initial "
              f"or raise the budget", file=sys.stderr)


def _write_summary(ctx: RunContext, summary: dict[str, Any]) -> None:
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _compose_and_plan(ctx: RunContext, console: Console, backend: Any, results: list, tracker: Any) -> dict[str, Any]:
    from kareus.pipeline.composing import compose, measure_fixed_work, measure_perseus_space
    from kareus.plan import PlanSelectionError, frontier_table, make_plans, select_plan, write_run_outputs
    from kareus.plan.model import MadeFor
    from kareus.plan.report import compared_to, plan_file, plan_summary, saving_pct
    from kareus.profiler import Journal, Profiler, ProfilerConfig
    from kareus.registry import to_dataclass
    from kareus.tracking import summary_metrics
    from kareus.tracking.records import gpu_hours_name

    journal = Journal.open(ctx.journal_path, ctx.config_hash)
    searched = {m.candidate.key for r in results for m in r.measurements}  # their cost is the search's
    try:
        with Profiler(to_dataclass(ProfilerConfig, ctx.typed["profiler"]), backend, journal) as profiler:
            fixed = measure_fixed_work(ctx, profiler, results)
            fixed_costs = {k: c for k, c in profiler.costs().items() if k not in searched}
            if ctx.typed["plan"].compare_perseus:  # the baseline's own profiles, counted apart
                fixed = measure_perseus_space(ctx, profiler, fixed)
            perseus_costs = {k: c for k, c in profiler.costs().items() if k not in searched and k not in fixed_costs}
    finally:
        journal.close()
    # journaled costs included, so a resumed run reports what its measurements cost
    fixed_gpu_seconds, perseus_gpu_seconds = sum(fixed_costs.values()), sum(perseus_costs.values())
    console.print(f"fixed work (Megatron's reference, residual ops): {fixed_gpu_seconds / 3600:.2f} "
                  f"{_hours_label(ctx)}GPU-hours")
    tracker.log_summary({gpu_hours_name(ctx.simulated, "fixed_work_"): fixed_gpu_seconds / 3600.0})
    comp = compose(ctx, results, fixed)
    plans = make_plans(comp.frontier, [ctx.partitioning, fixed.megatron], config_hash=ctx.config_hash,
                       hardware=ctx.hardware_label,
                       made_for=None if ctx.model is None else MadeFor.of(ctx.model, ctx.parallel))
    selected, selection_error = None, None
    try:
        selected = select_plan(plans, ctx.typed["plan"])
    except PlanSelectionError as err:
        selection_error = str(err)
    outputs = write_run_outputs(ctx.run_dir, plans, selected, comp.reference)
    label = ctx.numbers_kind or ctx.hardware_name
    console.print(frontier_table(plans, comp.reference, selected,
                                 title=f"Iteration frontier ({label} {ctx.gpu.name}, predicted)"))
    ref_t, ref_e = comp.reference.time_s, comp.reference.energy_j
    perseus = _against_perseus(ctx, console, comp, plans, label, perseus_gpu_seconds)
    tracker.log_microbatch_frontiers(_microbatch_frontiers(comp))
    tracker.log_iteration_frontier(comp.frontier.frontier, reference=(ref_t, ref_e),
                                   selected=(selected.predicted_time_s, selected.predicted_energy_j) if selected else None,
                                   baseline=comp.perseus.frontier if comp.perseus is not None else None)
    out: dict[str, Any] = {"plans": len(plans), "reference": {"time_s": ref_t, "energy_j": ref_e},
                           "fixed_work_gpu_seconds": fixed_gpu_seconds}
    if perseus:
        tracker.log_summary({f"perseus.{k}": v for k, v in perseus.items()})
        out["perseus"] = perseus
    if selected is not None:
        tracker.log_plan(outputs["plan_selected"])
        # the search's cost is logged already, the reference with the iteration frontier: once each
        metrics = {k: v for k, v in summary_metrics(selected.predicted_time_s, selected.predicted_energy_j, ref_t,
                                                    ref_e, simulated=ctx.simulated).items()
                   if not k.startswith("reference.")}
        switches = selected.switches
        tracker.log_summary({**metrics, "plan.clock_switches": switches}, tags={"plan.id": selected.id})
        # savings against Megatron in percent, positive = better, as in the tables, CSVs and MLflow
        out["selected"] = {"plan": selected.id, "plan_file": plan_file(selected),
                           "time_s": selected.predicted_time_s, "energy_j": selected.predicted_energy_j,
                           "time_saving_pct": saving_pct(ref_t, selected.predicted_time_s),
                           "energy_saving_pct": saving_pct(ref_e, selected.predicted_energy_j),
                           "clock_switches": switches}
        s = out["selected"]
        gpus = selected.num_stages * selected.gpus_per_stage
        console.print(f"selected plan {selected.id} ({_selection_rule(ctx.typed['plan'])}): {s['time_s']:.4f} s and "
                      f"{s['energy_j']:,.1f} J per iteration (energy of all {gpus} GPUs), "
                      f"{compared_to(s['time_saving_pct'], 'faster', 'slower')} and "
                      f"{compared_to(s['energy_saving_pct'], 'less energy', 'more energy')} than Megatron ({label}); "
                      f"{switches} clock switches per iteration over {selected.num_stages} stages, "
                      f"{_switch_pricing(selected.clock_switch_s)}")
        console.print(f"selected plan file: {outputs['plan_selected']}")
        for line in plan_summary(selected):
            console.print(f"  {line}")
        cost = _selected_cost(ctx, console, selected, label)
        if cost:
            out["selected"]["cost"] = cost
        out.update(_payback(ctx, console, comp, selected, label, tracker))
    if selection_error is not None:
        out["selection_error"] = selection_error
    return out


def _against_perseus(ctx: RunContext, console: Console, comp: Any, plans: list, label: str,
                     gpu_seconds: float) -> dict[str, float]:
    """Each point of the Megatron + Perseus frontier beside the least-energy plan within its time:
    a table, ``frontier_perseus.csv`` and a line; returns the savings summary ({} without it) with
    the GPU-hours its own profiles took."""
    from kareus.pipeline.composing import perseus_clocks
    from kareus.plan.baseline import equal_time, equal_time_table, savings_summary, write_equal_time_csv
    from kareus.tracking.records import gpu_hours_name

    path = ctx.run_dir / "frontier_perseus.csv"
    if comp.perseus is None or not len(comp.perseus):
        path.unlink(missing_ok=True)  # an earlier run's in this folder would name plans this run does not write
        return {}
    rows = equal_time(plans, [(p.time_s, p.energy_j) for p in comp.perseus.frontier])
    write_equal_time_csv(path, rows)
    n_clocks = len(perseus_clocks(ctx))
    console.print(equal_time_table(rows, f"Against Megatron + Perseus (Megatron's layout, one of {n_clocks} clocks per "
                                         f"instruction) at equal time ({label}, predicted)"))
    s = savings_summary(plans, rows, comp.reference.time_s)
    if s:
        at = (f"{s['energy_saving_at_reference_pct']:+.1f}% at Megatron's time, "
              if "energy_saving_at_reference_pct" in s else "")
        points = int(s["baseline_points"])
        over = (f"{s['energy_saving_min_pct']:+.1f}% to {s['energy_saving_max_pct']:+.1f}% over its {points} points"
                if points > 1 else f"{s['energy_saving_min_pct']:+.1f}% at its one point")
        console.print(f"against Megatron + Perseus at equal time: energy saving {at}{over} ({label})")
        console.print(f"Megatron + Perseus' own profiles: {gpu_seconds / 3600:.2f} {_hours_label(ctx)}GPU-hours")
        if n_clocks < 2:
            console.print("note: the search space has one clock (search.space.freq_mhz), so Megatron + Perseus "
                          "is Megatron's reference alone")
        s[gpu_hours_name(ctx.simulated)] = gpu_seconds / 3600.0
    return s


def _selected_cost(ctx: RunContext, console: Console, selected: Any, label: str) -> dict[str, Any]:
    """The selected plan's money and carbon (plan.price, plan.carbon), when any price or intensity is set."""
    from kareus.plan.cost import describe, plan_cost

    pc = ctx.typed["plan"]
    priced = (pc.select.value == "cost" or pc.price.energy_per_kwh or pc.price.gpu_hour or pc.price.profile
              or pc.carbon.g_per_kwh or pc.carbon.profile)
    if not priced:
        return {}
    c = describe(plan_cost(selected.predicted_time_s, selected.predicted_energy_j,
                           selected.num_stages * selected.gpus_per_stage, pc), pc)
    per = f"the job's {c['iterations']} iterations" if c["per"] == "job" else "iteration"
    console.print(f"cost per {per}: {c['total']:.4g} (energy {c['energy_cost']:.4g}, GPU time {c['gpu_cost']:.4g}, "
                  f"carbon {c['carbon_cost']:.4g}); {c['energy_kwh']:.4g} kWh, {c['carbon_kg']:.4g} kg CO2e ({label}); "
                  "one plan for the whole job (the runtime does not switch plans between iterations)")
    return c


def _payback(ctx: RunContext, console: Console, comp: Any, selected: Any, label: str, tracker: Any) -> dict[str, Any]:
    """The energy this run's measurements burned, and after how many iterations the selected plan saves it."""
    from kareus.plan.payback import measurement_energy_j, payback_iterations, perseus_energy_at
    from kareus.profiler import Journal

    groups = {t.key: int(t.comm.group_size) for t in ctx.partitioning.types}
    with Journal.open(ctx.journal_path, ctx.config_hash) as journal:
        cost_j = measurement_energy_j(journal.entries(), groups, ctx.gpu.idle_power_w)
    vs_megatron = comp.reference.energy_j - selected.predicted_energy_j
    mp = (perseus_energy_at(selected.predicted_time_s, [(p.time_s, p.energy_j) for p in comp.perseus.frontier])
          if comp.perseus is not None and len(comp.perseus) else None)
    vs_perseus = None if mp is None else mp - selected.predicted_energy_j
    payback = {"megatron": payback_iterations(cost_j, vs_megatron), "perseus": payback_iterations(cost_j, vs_perseus)}
    said = {k: "never (it saves nothing)" if v is None else f"{v:,} iterations" for k, v in payback.items()}
    console.print(f"net: this run's measurements drew {cost_j / 3.6e6:.3g} kWh ({label}); the selected plan pays it "
                  f"back after {said['megatron']} against Megatron"
                  + ("" if mp is None else f", {said['perseus']} against Megatron + Perseus"))
    tracker.log_summary({"measurement_energy_kwh": cost_j / 3.6e6}
                        | {f"payback_iterations.{k}": float(v) for k, v in payback.items() if v is not None})
    return {"measurement_energy_j": cost_j, "payback_iterations": payback}


def _switch_pricing(clock_switch_s: float) -> str:
    """How the plan's predicted time treats its clock switches."""
    if clock_switch_s:
        return f"{1e3 * clock_switch_s:.3g} ms each in its time"
    return "not priced (hardware.clock_switch_s=0)"


def _selection_rule(plan: Any) -> str:
    if plan.deadline_s is not None:
        return f"least energy within {plan.deadline_s} s"
    if plan.energy_budget_j is not None:
        return f"fastest within {plan.energy_budget_j} J"
    return plan.select.value


def _microbatch_frontiers(comp: Any) -> dict[str, Any]:
    from kareus.frontier import Frontier

    return {f"stage{s}.{d.value}": Frontier.from_arrays([o.time_s for o in opts], [o.dynamic_energy_j for o in opts],
                                                        opts, objective="dynamic")
            for (s, d), opts in sorted(comp.options.items(), key=lambda kv: (kv[0][0], kv[0][1].value))}


def _print_search_summary(console: Console, summary: dict[str, Any], gpu_seconds: float, ctx: RunContext) -> None:
    from rich.table import Table

    label = _hours_label(ctx)
    table = Table(title=f"Partition searches ({ctx.cfg.search.name}, {label}{ctx.gpu.name})")
    for col in ("partition", "space", "profiled", "failed", "frontier points"):
        table.add_column(col, justify="right" if col != "partition" else "left")
    for key, s in summary.items():
        table.add_row(key, str(s["space"]), str(s["profiled"]), str(s["failed"]), str(s.get("frontier_points", "")))
    console.print(table)
    console.print(f"profiling cost: {gpu_seconds / 3600:.2f} {label}GPU-hours")


def _hours_label(ctx: RunContext) -> str:
    """What kind of GPU-hours a run's costs are: ``simulated ``, ``replayed `` or (real GPUs) none."""
    return f"{ctx.numbers_kind} " if ctx.numbers_kind else ""
