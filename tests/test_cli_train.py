"""``mode=train`` end to end on CPU (gloo): a tiny planning run's plan trains with the same losses as
Megatron's layout while its comms overlap; a comparison reports measured and predicted savings; a plan
for another layout, or a missing one, is refused with one line before anything trains."""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli_errors import error_lines, kareus, left_behind

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

# seq 64 and micro-batches of 2 keep a CPU iteration under a second; without Megatron's layout among the
# options every instruction of every plan runs Kareus' partitions (the tiny model's kernels are so small
# that the simulated GPU would otherwise keep Megatron's layout everywhere)
LAYOUT = ("+model=tiny", "parallel.seq_len=64", "parallel.micro_batch_size=2")
PLANNING = (*LAYOUT, "search.budget_frac=0.05", "plan.megatron_layout=false", "tracking.enabled=false", "progress=false")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(cwd: Path, ranks: int, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(COLUMNS="200", NO_COLOR="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={_port()}",
           "--master-addr=127.0.0.1", "-m", "kareus", "mode=train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _summary(cwd: Path, name: str) -> dict:
    (path,) = (cwd / "runs" / name).glob("train_summary.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("train")
    for parallel in ("pp1_tp2", "pp2_tp2"):
        res = kareus(cwd, *PLANNING, f"parallel={parallel}", f"hydra.run.dir=runs/plan_{parallel}", timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    return cwd


@pytest.mark.parametrize("parallel,ranks", [("pp1_tp2", 2), ("pp2_tp2", 4)])
def test_a_plan_trains_with_megatron_s_losses_while_its_comms_overlap(planned, parallel, ranks):
    cwd = planned
    for plan in (f"runs/plan_{parallel}", "megatron"):
        res = torchrun(cwd, ranks, *LAYOUT, f"parallel={parallel}", f"train.plan={plan}", "train.iterations=5",
                       "train.warmup=0", "tracking.enabled=false", f"hydra.run.dir=runs/train_{parallel}_{plan[:4]}")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ours, theirs = _summary(cwd, f"train_{parallel}_runs"), _summary(cwd, f"train_{parallel}_mega")
    assert ours["plan"].endswith(f"plan_{parallel}/plan_selected.yaml") and theirs["plan"] == "megatron"
    assert [set(i) >= {"iteration", "loss", "time_s", "energy_j"} for i in ours["iterations"]] == [True] * 5
    for a, b in zip(ours["iterations"], theirs["iterations"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["energy_j"] is None and a["time_s"] > 0  # no GPU: energy is unavailable, never invented
    assert ours["iterations"][-1]["loss"] < ours["iterations"][0]["loss"]
    assert ours["partitions_overlapped"] > 0 and theirs["partitions_overlapped"] == 0
    assert ours["clock_switches"] > 0  # counted (the CPU has no clock to apply them to)


def test_compare_alternates_blocks_and_reports_savings(planned):
    cwd = planned
    res = torchrun(cwd, 2, *LAYOUT, "parallel=pp1_tp2", "train.plan=runs/plan_pp1_tp2", "train.compare=true",
                   "train.iterations=4", "train.blocks=2", "train.warmup=1", "hydra.run.dir=runs/compare")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = _summary(cwd, "compare")
    layouts = [(i["layout"], i["block"]) for i in s["iterations"]]
    assert layouts == [("plan", 0)] * 2 + [("megatron", 0)] * 2 + [("plan", 1)] * 2 + [("megatron", 1)] * 2
    c = s["comparison"]
    low, high = c["measured_time_saving_ci"]
    assert low <= c["measured_time_saving"] <= high
    assert c["measured_energy_saving"] is None and c["measured_energy_saving_ci"] == [None, None]
    assert isinstance(c["predicted_time_saving"], float) and isinstance(c["predicted_energy_saving"], float)
    assert "measured saving over Megatron's layout" in res.stdout
    with sqlite3.connect(cwd / "runs" / "mlflow.db") as con:  # one MLflow run of kind train, steps per iteration
        (run_id,) = con.execute("select run_uuid from tags where key='kareus.kind' and value='train'").fetchone()
        steps = {r[0] for r in con.execute("select step from metrics where run_uuid=? and key='plan.time_s'",
                                           (run_id,))}
    assert steps == {0, 1, 4, 5}


def test_a_plan_for_another_layout_is_refused_before_training(planned):
    cwd = planned
    res = kareus(cwd, *LAYOUT, "parallel=pp1_tp2", "parallel.seq_len=128", "mode=train",
                 "train.plan=runs/plan_pp1_tp2", "hydra.run.dir=runs/refused")
    assert res.returncode == 2
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "made for another model or layout: parallel.seq_len: plan 64 != 128" in lines[0], res.stderr
    assert not (cwd / "runs" / "refused").exists()


def test_a_missing_plan_is_one_line(tmp_path):
    res = kareus(tmp_path, *LAYOUT, "parallel=pp1_tp2", "mode=train", "train.plan=nowhere/plan.yaml")
    assert res.returncode == 2
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "train.plan: no such file or directory:" in lines[0], res.stderr
    assert left_behind(tmp_path) == []


def test_bad_train_values_are_named_one_line_each(tmp_path):
    res = kareus(tmp_path, *LAYOUT, "parallel=pp1_tp2", "mode=train", "train.plan=megatron", "train.iterations=0",
                 "train.compare=true", "train.blocks=1", "train.lr=-1", "train.device=tpu")
    assert res.returncode == 2
    assert error_lines(res.stderr) == [
        "error: train.iterations: must be >= 1, got 0",
        "error: train.blocks: a comparison needs 2..train.iterations (0) blocks of at least one iteration each, got 1",
        "error: train.compare: compares a plan with Megatron's layout; train.plan=megatron names no plan",
        "error: train.lr: must be a positive number, got -1.0",
        "error: train.device: must be one of auto, cpu, cuda, got 'tpu'"]
    assert left_behind(tmp_path) == []
