#!/usr/bin/env python
"""Check in headless Chromium that MLflow's UI opens Kareus' experiment on its runs, with metric columns.

Left to itself, MLflow 3 opens an experiment in its GenAI view (traces, an assistant panel), and its runs
table shows no metric column and counts every nested partition run. This script records a real short run
(``python -m kareus +model=tiny parallel=pp1_tp2``) into a temporary SQLite store, serves it with
``mlflow server`` on a free localhost port, renders the link docs/mlflow.md gives
(:func:`kareus.tracking.ui.runs_url`) with ``chromium --headless --dump-dom`` and checks:

- the experiment carries the tags ``mlflow.experimentKind`` and the saved view (over the REST API);
- the page is the runs page of the model-training view, not the GenAI overview or traces;
- the invocation run is listed with every headline metric as a column, and its partition runs are
  not counted.

Everything is written under one temporary folder, removed at the end. Output is one line.
Exit 0: passed, or skipped because Chromium is missing (the line starts with ``skipped:``);
exit 1: a check failed (the line says which).

Usage: python scripts/mlflow_ui_check.py [--chromium /usr/bin/chromium] [--timeout 300]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

CHROMIUM = "/usr/bin/chromium"
EXPERIMENT = "kareus"
RUN_ARGS = ("+model=tiny", "parallel=pp1_tp2", "progress=false", "tracking.plots=false")
RUN_NAME = "tiny pp1_tp2 mbo"  # the invocation's derived name
BUDGETS_MS = (20000, 60000)  # Chromium's virtual time for the app to render; the second try is longer
GENAI_MARKERS = ("Observability", "Token Usage", "Tool calls")  # the GenAI view's sidebar and overview


class CheckFailed(Exception):
    """One failed check; its message is the script's one line."""


def find_chromium(path: str | None) -> str | None:
    """The Chromium to use: the given path alone, else /usr/bin/chromium, else one on PATH."""
    candidates = (path,) if path else (CHROMIUM, shutil.which("chromium"), shutil.which("chromium-browser"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _env() -> dict[str, str]:
    """No Hydra state, telemetry or background jobs inherited from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", NO_COLOR="1",
               PYTHONWARNINGS="ignore")
    return env


def record_run(tmp: Path, timeout_s: float) -> str:
    """Run a tiny planning invocation with its MLflow record in ``tmp``; return the store's URI."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    args = [sys.executable, "-m", "kareus", *RUN_ARGS, f"tracking.uri={uri}",
            f"tracking.artifact_location={tmp / 'mlartifacts'}"]
    res = subprocess.run(args, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        raise CheckFailed(f"python -m kareus {' '.join(RUN_ARGS)} exited {res.returncode}: {last}")
    return uri


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(uri: str, tmp: Path, timeout_s: float) -> Iterator[str]:
    """``mlflow server`` on the store, on a free localhost port; yields its base URL, stops it after."""
    port = _free_port()
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                                 "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                                cwd=tmp, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_until_up(base, proc, log_path, timeout_s)
            yield base
        finally:
            _stop(proc)


def _wait_until_up(base: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
            raise CheckFailed(f"mlflow server exited {proc.returncode}: {tail[0]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise CheckFailed(f"mlflow server not up within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """The server and its worker processes (one process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


def experiment_tags(base: str) -> tuple[str, dict[str, str]]:
    """The experiment's id and tags, as the UI reads them over REST."""
    query = urllib.parse.urlencode({"experiment_name": EXPERIMENT})
    with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=30) as r:
        exp = json.loads(r.read())["experiment"]
    return exp["experiment_id"], {t["key"]: t["value"] for t in exp.get("tags", [])}


def tag_problem(tags: dict[str, str]) -> str | None:
    """Why the experiment's tags would not open the UI as intended (None if they would)."""
    from kareus.tracking import ui

    kind = tags.get(ui.EXPERIMENT_KIND_TAG)
    if kind != ui.MODEL_TRAINING:
        return f"experiment tag {ui.EXPERIMENT_KIND_TAG} is {kind!r}, not {ui.MODEL_TRAINING!r}"
    if ui.experiment_tags(tags):
        return f"experiment tag {ui.VIEW_TAG} is missing or not this version's saved view"
    return None


def render(chromium: str, url: str, tmp: Path, budget_ms: int, timeout_s: float) -> str:
    """The page's DOM after Chromium ran its scripts for ``budget_ms`` of virtual time (fresh profile)."""
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=tmp))
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
            "--no-default-browser-check", f"--user-data-dir={profile}", "--window-size=1920,1080",
            f"--virtual-time-budget={budget_ms}", "--dump-dom", url]
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"chromium did not finish within {timeout_s:.0f} s") from None
    if res.returncode != 0 or not res.stdout.strip():
        last = (res.stderr.strip() or "no output").splitlines()[-1]
        raise CheckFailed(f"chromium exited {res.returncode} with {len(res.stdout)} bytes of DOM: {last}")
    return res.stdout


def visible_text(dom: str) -> str:
    """The DOM's text, without styles, scripts and markup, whitespace collapsed."""
    text = re.sub(r"<(style|script)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    text = re.sub(r"<[^>]+>", " ", text)
    return re.sub(r"\s+", " ", text).replace("&amp;", "&").strip()


def dom_problem(dom: str, run_name: str, metrics: Sequence[str]) -> str | None:
    """Why the rendered page is not the runs list with the headline metrics (None if it is)."""
    title = re.search(r"<title>(.*?)</title>", dom, flags=re.S)
    title_text = title.group(1).strip() if title else ""
    text = visible_text(dom)
    genai = [marker for marker in GENAI_MARKERS if marker in text]
    if genai:
        return f"the page is in the GenAI view (shows {', '.join(genai)}; title {title_text!r})"
    if not title_text.startswith("Runs"):
        return f"the page is not the runs page (title {title_text!r})"
    if run_name not in text:
        return f"the run {run_name!r} is not listed"
    missing = [name for name in metrics if f"metrics.`{name}`" not in dom]  # the columns' ids
    if missing:
        return f"metrics not shown as columns: {', '.join(missing)}"
    count = re.search(r"(\d+) matching runs?\b", text)
    if count and int(count.group(1)) != 1:
        return f"the runs table counts {count.group(1)} runs for one invocation (nested partition runs counted)"
    return None


def check(chromium: str, tmp: Path, timeout_s: float) -> str:
    """Every check in order; returns the success line, raises CheckFailed with the failure's."""
    from kareus.tracking import ui

    uri = record_run(tmp, timeout_s)
    with mlflow_server(uri, tmp, timeout_s) as base:
        exp_id, tags = experiment_tags(base)
        problem = tag_problem(tags)
        if problem:
            raise CheckFailed(problem)
        url = ui.runs_url(base, exp_id)
        for budget in BUDGETS_MS:  # a slow machine may need longer to render
            problem = dom_problem(render(chromium, url, tmp, budget, timeout_s), RUN_NAME, ui.HEADLINE_METRICS)
            if problem is None:
                return f"ok: {url.split('/#', 1)[1]} lists {RUN_NAME!r} with its metric columns, not the GenAI view"
        raise CheckFailed(problem)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", help=f"the Chromium binary (default {CHROMIUM}, else chromium on PATH)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each step (default 300)")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        where = args.chromium or f"{CHROMIUM} or on PATH"
        print(f"mlflow_ui_check: skipped: no Chromium at {where}")
        return 0
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # before kareus.tracking imports mlflow
    with tempfile.TemporaryDirectory(prefix="kareus-ui-check-") as tmp:
        try:
            line = check(chromium, Path(tmp), args.timeout)
        except (CheckFailed, OSError, subprocess.SubprocessError) as exc:
            print(f"mlflow_ui_check: FAILED: {exc}")
            return 1
    print(f"mlflow_ui_check: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
