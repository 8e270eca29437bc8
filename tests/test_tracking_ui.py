"""The experiment tags that open MLflow's UI on the runs with the headline metrics, and the headless
Chromium check of the rendered page (scripts/mlflow_ui_check.py)."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.tracking import ui
from kareus.tracking.store import client_for, experiment_id
from kareus.tracking.tracker import summary_metrics
from tracking_fakes import empty_store

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mlflow_ui_check.py"
CHROMIUM = "/usr/bin/chromium"


def _script():
    spec = importlib.util.spec_from_file_location("mlflow_ui_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_saved_view_lists_invocations_with_metrics_the_runs_log():
    envelope = json.loads(ui.view_tag_value(now_ms=5))
    assert envelope["name"] == "Kareus invocations" and envelope["createdAt"] == envelope["updatedAt"] == 5
    state = json.loads(envelope["state"])  # the UI parses the state from a string
    assert state["searchFilter"] == "tags.`kareus.kind` = 'invocation'"
    assert state["selectedColumns"] == [f"metrics.`{m}`" for m in ui.HEADLINE_METRICS]
    assert set(ui.HEADLINE_METRICS) <= set(summary_metrics(1.0, 900.0, 1.1, 1000.0))  # no column of a dead name


def test_a_new_experiment_opens_in_the_model_training_view_with_the_saved_view(tmp_path):
    uri = empty_store(tmp_path)
    exp = client_for(uri).get_experiment(experiment_id(uri, "ui-new"))
    assert exp.tags[ui.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert ui.experiment_tags(exp.tags) == {}  # nothing left to write


def test_an_existing_experiment_is_tagged_and_a_kind_the_user_chose_stays(tmp_path):
    uri = empty_store(tmp_path)
    client = client_for(uri)
    plain = client.create_experiment("ui-old")  # made before these tags
    chosen = client.create_experiment("ui-genai", tags={ui.EXPERIMENT_KIND_TAG: "genai_development"})
    stale = client.create_experiment("ui-stale", tags={ui.VIEW_TAG: json.dumps({"name": "Kareus invocations",
                                                                              "createdAt": 1, "state": "{}"})})
    assert experiment_id(uri, "ui-old") == plain and experiment_id(uri, "ui-genai") == chosen
    experiment_id(uri, "ui-stale")
    assert client.get_experiment(plain).tags[ui.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert client.get_experiment(chosen).tags[ui.EXPERIMENT_KIND_TAG] == "genai_development"
    for exp_id in (plain, chosen, stale):
        assert ui.VIEW_TAG not in ui.experiment_tags(client.get_experiment(exp_id).tags)  # this version's view


def test_a_refused_tag_is_a_warning_not_a_failed_run(tmp_path, monkeypatch, caplog):
    uri = empty_store(tmp_path)
    client = client_for(uri)
    exp_id = client.create_experiment("ui-refused")

    def refuse(*args, **kwargs):
        raise PermissionError("PERMISSION_DENIED")

    monkeypatch.setattr(client, "set_experiment_tag", refuse)
    with caplog.at_level(logging.WARNING, logger="kareus.tracking.store"):
        assert experiment_id(uri, "ui-refused") == exp_id
    assert "could not set the tag mlflow.experimentKind" in caplog.text


def test_the_link_opens_the_runs_of_the_model_training_view_with_the_saved_view():
    assert ui.runs_url("http://127.0.0.1:5000/", "3") == (
        "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning&viewStateShareKey=kareus-invocations")


def test_the_page_check_tells_the_genai_view_and_missing_columns_apart():
    check = _script()
    metrics = ("plan.iteration_time_s",)
    runs = ("<html><head><title>Runs - Experiment 1 - MLflow</title></head><body><div>my run</div>"
            "<div col-id=\"metrics.`plan.iteration_time_s`\">plan.iteration_time_s</div><span>1 matching run</span>")
    assert check.dom_problem(runs, "my run", metrics) is None
    genai = "<title>Overview - Experiment 1 - MLflow</title><nav>Observability</nav><h2>Token Usage</h2>"
    assert check.dom_problem(genai, "my run", metrics).startswith("the page is in the GenAI view")
    assert check.dom_problem(runs.replace("metrics.", "attributes."), "my run", metrics) == (
        "metrics not shown as columns: plan.iteration_time_s")
    assert "counts 7 runs" in check.dom_problem(runs.replace("1 matching run", "7 matching runs"), "my run", metrics)


def test_the_check_skips_in_one_line_without_chromium(capsys, monkeypatch):
    check = _script()
    assert check.main(["--chromium", "/nonexistent/chromium"]) == 0
    assert capsys.readouterr().out == "mlflow_ui_check: skipped: no Chromium at /nonexistent/chromium\n"
    monkeypatch.setattr(check, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.setattr(check.shutil, "which", lambda name: None)
    assert check.main([]) == 0
    assert capsys.readouterr().out == "mlflow_ui_check: skipped: no Chromium at /nonexistent/chromium or on PATH\n"


@pytest.mark.slow
@pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"no Chromium at {CHROMIUM}")
def test_the_ui_opens_on_the_runs_with_metric_columns_in_headless_chromium(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    res = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and res.stdout.startswith("mlflow_ui_check: ok:"), res.stdout + res.stderr
    assert list(tmp_path.iterdir()) == []  # everything in the script's own temporary folder
