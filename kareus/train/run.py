"""``mode=train``: real megatron-core training with a plan applied, measured, and compared with Megatron's
own layout.

``torchrun --nproc-per-node=N -m kareus mode=train +model=M parallel=P train.plan=PATH|megatron`` builds
a megatron-core GPTModel of the model and layout with Kareus' layer spec, feeds it megatron-core's mock
GPT data and trains it through megatron-core's schedule (``get_forward_backward_func()``, 1F1B where
pp > 1) with AdamW. The plan hooks lock each instruction's clock; the layer spec runs each partition's
slot and comm SMs. ``train.compare=true`` runs the plan and Megatron's layout in alternating blocks in the
same process group and reports the measured saving beside the predicted one. Ranks map to (pp, tp, dp) as
megatron-core's ``parallel_state`` does; each rank's executor follows its own stage.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kareus.errors import KareusError
from kareus.train.plans import MEGATRON, TrainPlan, resolve_plan


def run_train(cfg: Any, typed: dict[str, Any], run_dir: Path, model: Any, parallel: Any, console: Any) -> dict:
    """Check the plan, start the process group, train, measure; rank 0 writes ``train_summary.json``."""
    from hydra.utils import get_original_cwd

    tc = cfg.train
    tplan = resolve_plan(tc.plan, Path(get_original_cwd()))
    if tplan.plan is not None:  # before any process group or model: a wrong plan trains nothing
        from kareus.runtime.partitioned import PlanLayoutError, check_plan_layout

        try:
            check_plan_layout(tplan.plan, model, parallel)
        except PlanLayoutError as err:
            raise KareusError(f"train.plan: {err}") from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    need = parallel.tp * parallel.pp * parallel.cp
    if world % need:
        raise KareusError(f"mode=train: parallel tp={parallel.tp} x pp={parallel.pp} x cp={parallel.cp} needs a "
                          f"multiple of {need} processes, got {world}: torchrun --nproc-per-node={need} -m kareus "
                          "mode=train ...")
    from kareus.train.loop import Trainer

    from kareus.runtime.clock_guard import ClockGuard

    trainer = Trainer(cfg, typed, model, parallel, tplan, console)
    try:
        with ClockGuard(trainer.timer):  # clocks given back at every exit: end, error, SIGTERM/HUP, Ctrl-C
            result = trainer.run()
        trainer.note_run_dir(run_dir)
    finally:
        trainer.close()
    if trainer.rank != 0:  # its own Hydra folder goes, unless every rank shares rank 0's (hydra.run.dir=...)
        return {"mode": "train", "rank": trainer.rank, "remove_run_dir": trainer.first_run_dir != str(run_dir)}
    summary = _summary(cfg, tplan, trainer, result)
    path = run_dir / "train_summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    _track(cfg, typed, run_dir, tplan, summary, path)
    _print(console, summary, path)
    return {"mode": "train", "rank": 0, "run_dir": str(run_dir), "train_summary": str(path)}


def _summary(cfg: Any, tplan: TrainPlan, trainer: Any, result: dict) -> dict:
    its = result["iterations"]
    mine = [i for i in its if i.layout == ("plan" if tplan.plan is not None else "megatron")]
    out: dict[str, Any] = {
        "plan": tplan.source, "plan_id": None if tplan.plan is None else tplan.plan.id,
        "invocation_run_id": tplan.invocation_run_id, "device": result["device"], "world_size": result["world"],
        "warmup": int(cfg.train.warmup), "energy": result["energy"],
        "iterations": [{"iteration": i.iteration, "layout": i.layout, "block": i.block, "loss": i.loss,
                        "time_s": i.time_s, "energy_j": i.energy_j, "clock_switches": i.clock_switches} for i in its],
        "partitions_overlapped": result["overlapped"], "partitions_sequential": result["sequential"],
        "clock_switches": sum(i.clock_switches for i in mine),
        "clock_switch_s": result["switch_s"],
        "predicted": {"time_s": None if tplan.plan is None else tplan.plan.predicted_time_s,
                      "energy_j": None if tplan.plan is None else tplan.plan.predicted_energy_j,
                      "megatron_time_s": tplan.reference[0] if tplan.reference else None,
                      "megatron_energy_j": tplan.reference[1] if tplan.reference else None},
    }
    if cfg.train.compare:
        out["comparison"] = _comparison(tplan, its)
    return out


def _comparison(tplan: TrainPlan, its: list) -> dict:
    from kareus.train.measure import paired_saving

    blocks = sorted({i.block for i in its})

    def per_block(layout: str, what: str) -> list[list[float]]:
        return [[getattr(i, what) for i in its if i.layout == layout and i.block == b] for b in blocks]

    def saving(what: str) -> dict:
        plan, ref = per_block("plan", what), per_block("megatron", what)
        if any(v is None for blk in plan + ref for v in blk):
            return {"measured": None, "low": None, "high": None}
        s = paired_saving(plan, ref)
        return {"measured": None if s is None else s.mean, "low": None if s is None else s.low,
                "high": None if s is None else s.high}

    t, e = saving("time_s"), saving("energy_j")
    pt, pe = tplan.predicted_saving()
    return {"blocks": len(blocks),
            "measured_time_saving": t["measured"], "measured_time_saving_ci": [t["low"], t["high"]],
            "measured_energy_saving": e["measured"], "measured_energy_saving_ci": [e["low"], e["high"]],
            "predicted_time_saving": pt, "predicted_energy_saving": pe,
            "time_prediction_error": None if pt is None or t["measured"] is None else t["measured"] - pt,
            "energy_prediction_error": None if pe is None or e["measured"] is None else e["measured"] - pe,
            "energy_unavailable_reason": None if e["measured"] is not None else "unmeasured on at least one rank"}


def _track(cfg: Any, typed: dict, run_dir: Path, tplan: TrainPlan, summary: dict, path: Path) -> None:
    from omegaconf import OmegaConf

    from kareus.tracking import Tracker, hydra_context

    tracker = Tracker(typed["tracking"])
    hctx = hydra_context()
    tags = {"kareus.kind": "train", "plan": tplan.source, "run_dir": str(run_dir)}
    if tplan.invocation_run_id:
        tags["kareus.plan_run_id"] = tplan.invocation_run_id
    with tracker:
        tracker.start(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), choices=hctx.get("choices"),
                      overrides=hctx.get("overrides", ()), hardware=summary["device"], run_name=hctx.get("run_name"),
                      tags=tags, simulated=False)
        for it in summary["iterations"]:
            prefix = "" if not cfg.train.compare else f"{it['layout']}."
            metrics = {f"{prefix}loss": it["loss"], f"{prefix}time_s": it["time_s"]}
            if it["energy_j"] is not None:
                metrics[f"{prefix}energy_j"] = it["energy_j"]
            tracker.log_metrics(metrics, step=it["iteration"])
        comp = summary.get("comparison") or {}
        tracker.log_summary({k: v for k, v in comp.items() if isinstance(v, float)}
                            | {"partitions_overlapped": summary["partitions_overlapped"],
                               "clock_switches": summary["clock_switches"]})
        tracker.log_artifact(path)


def _print(console: Any, summary: dict, path: Path) -> None:
    from rich.table import Table

    its = summary["iterations"]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    table = Table(title=f"mode=train on {summary['device']} ({summary['world_size']} ranks)")
    for col in ("layout", "iterations", "time s/it", "energy J/it", "last loss"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for layout in ("plan", "megatron"):
        mine = [i for i in its if i["layout"] == layout]
        if not mine:
            continue
        energies = [i["energy_j"] for i in mine]
        table.add_row(layout, str(len(mine)), f"{mean([i['time_s'] for i in mine]):.4f}",
                      "unavailable" if None in energies else f"{mean(energies):.1f}", f"{mine[-1]['loss']:.4f}")
    console.print(table)
    comp = summary.get("comparison")
    if comp:
        def pct(v: Any) -> str:
            return "unavailable" if v is None else f"{100 * v:+.1f}%"

        def ci(v: list) -> str:
            return "" if None in v else f" [{100 * v[0]:+.1f}%, {100 * v[1]:+.1f}%]"

        console.print(f"measured saving over Megatron's layout ({comp['blocks']} blocks each, 95% CI): time "
                      f"{pct(comp['measured_time_saving'])}{ci(comp['measured_time_saving_ci'])}, energy "
                      f"{pct(comp['measured_energy_saving'])}{ci(comp['measured_energy_saving_ci'])}; predicted: time "
                      f"{pct(comp['predicted_time_saving'])}, energy {pct(comp['predicted_energy_saving'])}")
    console.print(f"partitions overlapped: {summary['partitions_overlapped']}; clock switches: "
                  f"{summary['clock_switches']}")
    console.print(str(path.parent))


__all__ = ["MEGATRON", "run_train"]
