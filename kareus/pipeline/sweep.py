"""The table a sweep (``-m``) ends with: one row per job, read from the ``summary.json`` each job wrote.

Per job: its swept values, the selected plan, its iteration time and energy, its time and energy savings
against Megatron (percent, positive = faster / less energy, as in every run's own outputs) and the
candidates it profiled. A job that failed or was refused is a failed row with its reason. The table is
printed on stdout after the last job and written as ``sweep_summary.json`` and ``sweep_summary.csv`` in
the sweep folder, so ablations are compared without opening each job's folder.
"""
from __future__ import annotations

import atexit
import csv
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback

SUMMARY_JSON = "sweep_summary.json"
SUMMARY_CSV = "sweep_summary.csv"
PLANNING_MODES = ("run", "search")  # the modes whose jobs write a summary.json
NUMBERS = ("plan", "time_s", "energy_j", "time_saving_pct", "energy_saving_pct", "profiled", "simulated")
NOT_FINISHED = "did not finish"


@dataclass
class SweepJob:
    """What the sweep knows of one job: its overrides, folder, mode and how it ended."""

    num: int
    overrides: list[str]
    run_dir: Path
    mode: str = "run"
    before: int | None = None  # its summary.json's mtime (ns) at its start: in a reused folder, not its own
    error: str | None = NOT_FINISHED  # None: it finished


def override_key(override: str) -> str:
    """``search.passes`` of ``search.passes=[total]``; ``+experiment`` stays as written."""
    return override.partition("=")[0]


def swept_keys(overrides: Sequence[Sequence[str]], argv: Sequence[str] = ()) -> list[str]:
    """The keys a sweep varies: those given several values on the command line (``argv``) and those
    whose value differs between jobs; every key when none does (a one-job sweep). In the order the
    first job lists them."""
    from kareus.config.overrides import swept_override_keys

    swept = swept_override_keys(argv)
    values: dict[str, set[str]] = {}
    for job in overrides:
        for o in job:
            values.setdefault(override_key(o), set()).add(o)
    for key, seen in values.items():
        if len(seen) > 1 or any(key not in map(override_key, job) for job in overrides):
            swept.add(key)
    order = [override_key(o) for job in overrides for o in job]
    keys = list(dict.fromkeys(k for k in order if k in swept))
    return keys or list(dict.fromkeys(order))


def summary_stamp(run_dir: Path) -> int | None:
    """The mtime (ns) of the summary.json in ``run_dir``; None when there is none."""
    try:
        return (run_dir / "summary.json").stat().st_mtime_ns
    except OSError:
        return None


def _summary(job: SweepJob) -> dict[str, Any]:
    """The summary.json the job wrote ({} when it wrote none: one left by an earlier job is not its)."""
    path = job.run_dir / "summary.json"
    try:
        if summary_stamp(job.run_dir) in (None, job.before):
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def job_row(job: SweepJob, keys: Sequence[str], summary: dict[str, Any]) -> dict[str, Any]:
    """One job's row: its swept values, status, and the numbers its ``summary`` holds (None where absent)."""
    selected = summary.get("selected") if isinstance(summary.get("selected"), dict) else {}
    choices = {override_key(o): o.partition("=")[2] for o in job.overrides if override_key(o) in keys}
    return {"job": job.num, "choices": choices, "status": "ok" if job.error is None else "failed",
            "plan": selected.get("plan"), "time_s": selected.get("time_s"), "energy_j": selected.get("energy_j"),
            "time_saving_pct": selected.get("time_saving_pct"), "energy_saving_pct": selected.get("energy_saving_pct"),
            "profiled": summary.get("profiled"), "simulated": summary.get("simulated"), "run_dir": str(job.run_dir),
            "error": job.error}


def job_error(job_return: Any) -> str | None:
    """None for a job that finished; else why not: its refusal or its exception, in one line."""
    from hydra.core.utils import JobStatus

    from kareus.errors import JobRefused

    if job_return is None:
        return NOT_FINISHED
    value = getattr(job_return, "_return_value", None)
    if job_return.status == JobStatus.FAILED:
        return f"{type(value).__name__}: {value}".splitlines()[0] if value is not None else "failed"
    if isinstance(value, JobRefused):
        return f"refused: {value.reason}" if value.reason else "refused"
    return None


def _short(text: str | None, most: int = 44) -> str:
    """A failed row's reason as the table shows it (in full in the JSON and CSV, and on stderr)."""
    text = text or ""
    return text if len(text) <= most else text[:most - 3].rstrip() + "..."


def _pct(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:+.2f}%"


def _num(value: Any, fmt: str) -> str:
    return "-" if not isinstance(value, (int, float)) or isinstance(value, bool) else format(value, fmt)


def sweep_table(rows: Sequence[dict[str, Any]], keys: Sequence[str], common: Sequence[str] = (),
                where: Path | None = None):
    """A rich Table of the jobs: savings against Megatron in percent, positive = faster / less energy."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    simulated = {r["simulated"] for r in rows if r["simulated"] is not None}
    kind = "simulated, predicted" if simulated == {True} else "predicted"
    table = Table(title=f"Sweep: {len(rows)} jobs ({kind}); savings against Megatron, positive = faster / "
                        f"less energy")
    for col in ("job", *keys):
        table.add_column(Text(col), justify="left", overflow="fold")
    for col in ("plan", "time (s)", "energy (J)", "time saving", "energy saving", "profiled"):
        table.add_column(col, justify="left" if col == "plan" else "right", overflow="fold")  # never cut a number
    table.add_column("", justify="left", no_wrap=True, overflow="ellipsis")  # a failure's reason: in full on disk
    for r in rows:
        failed = r["status"] != "ok"
        table.add_row(str(r["job"]), *(Text(r["choices"].get(k, "")) for k in keys), r["plan"] or "-",
                      _num(r["time_s"], ".4f"), _num(r["energy_j"], ".1f"), _pct(r["time_saving_pct"]),
                      _pct(r["energy_saving_pct"]), _num(r["profiled"], "d"),
                      Text(f"failed: {_short(r['error'])}" if failed else ""), style="red" if failed else None)
    notes = [f"in every job: {' '.join(common)}" if common else "",
             f"all in {where / SUMMARY_CSV} and {SUMMARY_JSON}" if where is not None else ""]
    table.caption = escape("; ".join(n for n in notes if n)) or None  # overrides hold [ ]: no markup
    return table


def write_sweep_summary(sweep_dir: Path, rows: Sequence[dict[str, Any]], keys: Sequence[str],
                        common: Sequence[str]) -> tuple[Path, Path]:
    """``sweep_summary.json`` (rows with their choices nested) and ``sweep_summary.csv`` (one column per
    swept key) in ``sweep_dir``."""
    data = {"sweep_dir": str(sweep_dir), "swept": list(keys), "common": list(common),
            "savings": "percent against Megatron, positive = faster / less energy", "jobs": list(rows)}
    json_path = sweep_dir / SUMMARY_JSON
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    csv_path = sweep_dir / SUMMARY_CSV
    fixed = ["status", *NUMBERS, "run_dir", "error"]
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job", *keys, *fixed])
        for r in rows:
            w.writerow([r["job"], *(r["choices"].get(k, "") for k in keys),
                        *("" if r[c] is None else r[c] for c in fixed)])
    return json_path, csv_path


def common_overrides(overrides: Sequence[Sequence[str]], keys: Sequence[str]) -> list[str]:
    """The overrides every job shares, the swept keys left out."""
    if not overrides:
        return []
    return [o for o in overrides[0] if override_key(o) not in keys and all(o in job for job in overrides[1:])]


def report(jobs: Sequence[SweepJob], sweep_dir: Path, argv: Sequence[str] = (), console: Any = None) -> list[dict]:
    """Print the table of ``jobs`` and, when a job wrote its summary, write it into ``sweep_dir``;
    returns the rows."""
    jobs = sorted(jobs, key=lambda j: j.num)
    overrides = [j.overrides for j in jobs]
    keys = swept_keys(overrides, argv)
    summaries = [_summary(j) for j in jobs]
    rows = [job_row(j, keys, s) for j, s in zip(jobs, summaries)]
    common = common_overrides(overrides, keys)
    # only where a job of this sweep left results: a sweep whose every job was refused leaves no folder
    # (kareus.cli.RunDirCallback), nor rewrites an earlier sweep's table in a folder it reuses
    written = sweep_dir.is_dir() and any(summaries)
    if written:
        write_sweep_summary(sweep_dir, rows, keys, common)
    (console or _console()).print(sweep_table(rows, keys, common, sweep_dir if written else None))
    return rows


def _console() -> Any:
    """rich's console on stdout, as wide as a run's tables when it is no terminal; quiet once the reader
    has left (``| head``): the sweep's results are already on disk."""
    from rich.console import Console

    from kareus.tracking.progress import live_terminal

    class _Quiet(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True

    console = _Quiet(highlight=False, soft_wrap=True)
    return console if live_terminal(console) else _Quiet(highlight=False, soft_wrap=True, width=160)


class SweepSummaryCallback(Callback):
    """Collects each job of a sweep and ends the sweep with their table (see the module's docstring).

    Hydra skips ``on_multirun_end`` when a job raised; an exit hook then reports the jobs that ran,
    the one that raised as a failed row."""

    def __init__(self) -> None:
        self.jobs: dict[int, SweepJob] = {}
        self.sweep_dir: Path | None = None
        self.argv: list[str] = []
        self._done = False

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from kareus.config.overrides import hydra_value

        self.sweep_dir = Path(os.path.abspath(hydra_value(config, "hydra.sweep.dir", as_job=False)))
        self.argv = list(sys.argv[1:])
        atexit.register(self.finish)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        if self.sweep_dir is None:  # a single run (no hydra.job.num): no sweep, no table
            return
        mode = config.get("mode")
        hydra = config.hydra
        num = int(hydra.job.num)
        run_dir = Path(hydra.runtime.output_dir)
        self.jobs[num] = SweepJob(num, [str(o) for o in hydra.overrides.task], run_dir,
                                  str(getattr(mode, "value", mode)), summary_stamp(run_dir))

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        if self.sweep_dir is None:
            return
        job = self.jobs.get(int(config.hydra.job.num))
        if job is not None:
            job.error = job_error(job_return)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self.finish()

    def finish(self) -> None:
        """Report once: at the sweep's end, or at exit when the sweep stopped early."""
        if self._done or self.sweep_dir is None:
            return
        self._done = True
        jobs = list(self.jobs.values())
        if any(j.mode in PLANNING_MODES for j in jobs):  # describe, reset and train write no summary.json
            report(jobs, self.sweep_dir, self.argv)
