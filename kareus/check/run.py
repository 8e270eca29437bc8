"""``mode=check``: has the hardware moved since a run measured it?

``python -m kareus <the run's model, layout and hardware> mode=check check.run=RUN_DIR`` re-measures, per
partition the run searched, ``check.samples`` of its settings (:mod:`kareus.check.samples`) with the run's
profiler protocol, ``check.repeats`` times each in rounds over all of them (so each reading, like the
run's one, follows other settings and their heat), and tests each partition's shift in time and energy
against the spread of those readings (:mod:`kareus.check.drift`). Every reading is journaled in the
check's own run directory as it arrives; the checked run is only read. The result: a table,
``check_summary.json``, an MLflow run tagged ``kareus.kind=check``, and the exit status 0 (nothing
drifted) or 3 (something did), for a cron job or a training launcher to act on.

The fresh readings draw their noise from a stream of their own (``check.seed``), so a simulated
check reads the GPU anew rather than replaying the run's draws.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

from kareus.check.drift import METRICS, Sample, Shift, noise_levels, verdicts
from kareus.check.samples import choose, plan_usage
from kareus.errors import KareusError
from kareus.types import Measurement

DRIFT_EXIT = 3
SAME_KEYS = ("model", "parallel")  # what must match the checked run (the hardware may have moved: that is the point)


def check_seed(seed: int, check_seed_value: int) -> int:
    """The backend seed of a check: its own noise stream, apart from the run's (``seed``)."""
    return zlib.crc32(f"check|{seed}|{check_seed_value}".encode())


def run_dir_of(cfg: Any) -> Path:
    from kareus.config.paths import from_start_dir

    return from_start_dir(str(cfg.check.run))


def layout_mismatch(saved: Path, cfg: Any) -> str:
    """One line naming the first model, layout or GPU key where the run's saved config differs, else ""."""
    from omegaconf import OmegaConf

    if not saved.is_file():
        return ""
    old = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    new = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for section in SAME_KEYS:
        a, b = old.get(section) or {}, new.get(section) or {}
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return (f"check.run: the run was made for {section}.{key}={a.get(key)!r}, this check has "
                        f"{b.get(key)!r}; give the run's own model and layout")
    for key in ("name", "gpu"):
        a, b = (old.get("hardware") or {}).get(key), (new.get("hardware") or {}).get(key)
        if a != b:
            return f"check.run: the run measured hardware.{key}={a!r}, this check has {b!r}; check on the run's GPU"
    return ""


def run_check(ctx: Any, console: Any) -> dict[str, Any]:
    """Re-measure, test, report; the summary carries ``exit_code`` (0 or 3)."""
    from kareus.pipeline.searching import partition_types
    from kareus.profiler.journal import JournalError, read_measurements

    cc = ctx.cfg.check
    source = run_dir_of(ctx.cfg)
    problem = layout_mismatch(source / ".hydra" / "config.yaml", ctx.cfg)
    if problem:
        raise KareusError(problem)
    try:
        old = read_measurements(source / "journal.sqlite")
    except JournalError as err:
        raise KareusError(f"check.run: {err}") from None
    latest = {m.candidate: m for m in old}  # the row a resumed search would be answered with
    used = _plan_usage(source)
    with _opened(ctx) as backend:
        partitions = {p.key: p for p in partition_types(ctx, backend)}
    chosen = {key: choose(key, [m for m in latest.values() if m.candidate.partition == key], used, int(cc.samples))
              for key in partitions}
    chosen = {k: v for k, v in chosen.items() if v}
    if not chosen:
        raise KareusError(f"check.run: {source} measured none of this layout's partitions successfully")
    fresh = _remeasure(ctx, partitions, chosen, console)
    samples = {key: [_sample(m, fresh[m.candidate]) for m in ms if _usable(fresh[m.candidate])]
               for key, ms in chosen.items()}
    result = verdicts(samples, float(cc.alpha), float(cc.min_shift))
    summary = _summary(ctx, source, chosen, fresh, samples, result)
    if summary["drifted"]:  # what re-searches the drifted partitions alone, warm-started from the checked run
        from kareus.check.research import research_command
        from kareus.tracking import hydra_context

        summary["research_command"] = research_command(source, hydra_context().get("overrides", ()),
                                                       summary["drifted"])
    _print(console, summary, ctx.numbers_kind)
    path = ctx.run_dir / "check_summary.json"
    path.write_text(json.dumps(summary, indent=2, allow_nan=False))
    _track(ctx, summary, path)
    console.print(f"check summary: {path}")
    return summary


def _plan_usage(source: Path) -> Any:
    from collections import Counter

    from kareus.plan.io import load_plan

    path = source / "plan_selected.yaml"
    if not path.is_file():  # a search-only run: the front alone is sampled
        return Counter()
    try:
        return plan_usage(load_plan(path))
    except (OSError, ValueError) as err:
        raise KareusError(f"check.run: {path} is not a readable plan ({err})") from None


def _opened(ctx: Any) -> Any:
    """A backend as a partition search builds its own (closed on the way out), on the check's noise stream."""
    from kareus.pipeline.searching import opened_backend

    return opened_backend(ctx, check_seed(int(ctx.cfg.seed), int(ctx.cfg.check.seed)))


def _remeasure(ctx: Any, partitions: dict, chosen: dict[str, list[Measurement]],
               console: Any) -> dict[Any, list[Measurement]]:
    """Each chosen setting measured ``check.repeats`` times anew, as the run measured it: partition by
    partition on a backend built as its search built one (a simulated GPU of its own), by the run's
    profiler protocol, in rounds over the partition's settings, so each reading follows other settings'
    heat as the run's one did and the readings' spread holds the noise of one occasion. Journaled here."""
    from kareus.launch.task import thermal_device_of
    from kareus.profiler import Journal, Profiler, ProfilerConfig
    from kareus.registry import to_dataclass

    pcfg = to_dataclass(ProfilerConfig, ctx.cfg.profiler)
    out: dict[Any, list[Measurement]] = {m.candidate: [] for ms in chosen.values() for m in ms}
    rounds = int(ctx.cfg.check.repeats)
    with Journal.open(ctx.journal_path, ctx.config_hash) as journal:
        for key, ms in chosen.items():
            with _opened(ctx) as backend:
                device = thermal_device_of(ctx.section("hardware"), key, backend)
                with Profiler(pcfg, backend, journal, lambda event: None, device_id=device) as profiler:
                    for r in range(rounds):
                        for m in ms:
                            measure = profiler.measure if r == 0 else profiler.remeasure
                            out[m.candidate].append(measure(partitions[key], m.candidate))
            console.print(f"re-measured {key}: {len(ms)} settings x {rounds}")
    return out


def _sample(old: Measurement, new: list[Measurement]) -> Sample:
    ok = [m for m in new if not m.failed]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return Sample(old={"time": old.time_s, "energy": old.energy_j}, n_old=1,
                  new={"time": [m.time_s for m in ok], "energy": [m.energy_j for m in ok]},
                  new_value={"time": mean([m.time_s for m in ok]), "energy": mean([m.energy_j for m in ok])})


def _summary(ctx: Any, source: Path, chosen: dict, fresh: dict, samples: dict,
             result: dict[str, list[Shift]]) -> dict[str, Any]:
    cc = ctx.cfg.check
    parts = {}
    for key, shifts in result.items():
        by = {s.metric: s for s in shifts}
        parts[key] = {
            "samples": [{"slot": m.candidate.slot, "sms": m.candidate.sms, "freq_mhz": m.candidate.freq_mhz,
                         "run_time_s": m.time_s, "run_energy_j": m.energy_j,
                         "check_time_s": [x.time_s for x in fresh[m.candidate] if not x.failed],
                         "check_energy_j": [x.energy_j for x in fresh[m.candidate] if not x.failed]}
                        for m in chosen[key] if _usable(fresh[m.candidate])],
            "failed": sum(1 for m in chosen[key] if not _usable(fresh[m.candidate])),
            "drifted": any(s.drifted for s in shifts),
            **{f"{metric}_shift": _finite(by[metric].shift) for metric in METRICS},
            **{f"{metric}_p_value": _finite(by[metric].p_value) for metric in METRICS},
        }
    drifted = sorted(k for k, v in parts.items() if v["drifted"])
    return {"mode": "check", "checked_run": str(source), "run_dir": str(ctx.run_dir), "hardware": ctx.hardware_label,
            "simulated": ctx.simulated, "alpha": float(cc.alpha), "min_shift": float(cc.min_shift),
            "repeats": int(cc.repeats),
            "noise": {k: _finite(v) for k, v in noise_levels(samples).items()}, "partitions": parts, "drifted": drifted,
            "exit_code": DRIFT_EXIT if drifted else 0}


def _usable(readings: list[Measurement]) -> bool:
    """Two successful readings at least: a spread needs two."""
    return sum(not m.failed for m in readings) >= 2


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _fmt(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 100:+.2f}%"


def _print(console: Any, summary: dict[str, Any], kind: str) -> None:
    from rich.table import Table

    label = f" ({kind})" if kind else ""
    table = Table(title=f"Drift check of {summary['checked_run']}{label}")
    for col in ("partition", "settings", "time shift", "energy shift", "p (time)", "p (energy)", "verdict"):
        table.add_column(col, justify="left" if col in ("partition", "verdict") else "right")
    for key, p in summary["partitions"].items():
        pv = lambda x: "-" if x is None or not math.isfinite(x) else f"{x:.2g}"  # noqa: E731
        table.add_row(key, str(len(p["samples"])), _fmt(p["time_shift"]), _fmt(p["energy_shift"]),
                      pv(p["time_p_value"]), pv(p["energy_p_value"]), "DRIFTED" if p["drifted"] else "ok")
    console.print(table)
    noise = {k: "-" if v is None else f"{v * 100:.2f}%" for k, v in summary["noise"].items()}
    console.print(f"one reading's noise: {noise['time']} time, {noise['energy']} energy; "
                  f"flagged: p < {summary['alpha']:g} over all tests (Bonferroni) and a shift above "
                  f"{summary['min_shift'] * 100:g}%")
    if summary["drifted"]:
        console.print(f"drifted: {', '.join(summary['drifted'])} (exit {DRIFT_EXIT}); re-search them before the "
                      f"plan is trusted again, warm-started from the checked run:")
        console.print(f"  {summary['research_command']}", markup=False)  # the brackets of search.only are no markup
    else:
        console.print("no partition drifted")


def _track(ctx: Any, summary: dict[str, Any], path: Path) -> None:
    from omegaconf import OmegaConf

    from kareus.tracking import Tracker, hydra_context

    tracker = Tracker(ctx.typed["tracking"])
    hctx = hydra_context()
    with tracker:
        tracker.start(OmegaConf.to_container(ctx.cfg, resolve=True, enum_to_str=True), choices=hctx.get("choices"),
                      overrides=hctx.get("overrides", ()), hardware=ctx.hardware_label, run_name=hctx.get("run_name"),
                      tags={"kareus.kind": "check", "checked_run": summary["checked_run"],
                            "drifted": ",".join(summary["drifted"]) or "none", "run_dir": str(ctx.run_dir)},
                      simulated=ctx.simulated)
        metrics = {"drifted_partitions": float(len(summary["drifted"]))}
        for key, p in summary["partitions"].items():
            for metric in METRICS:
                if p[f"{metric}_shift"] is not None:
                    metrics[f"{key}.{metric}_shift"] = p[f"{metric}_shift"]
        tracker.log_summary(metrics)
        tracker.log_artifact(path)
