"""``python -m kareus`` from a fresh working directory: bad input exits non-zero, one line per problem,
no traceback, nothing left under runs/; the documented describe call works."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MISSION = ["+model=qwen1.7b", "parallel=pp2_tp8", "search=mbo"]
SHIPPED_MODELS = ("qwen1.7b", "llama3.2-3b", "llama3.3-70b", "tiny")


def kareus(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(COLUMNS="200", NO_COLOR="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "kareus", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def left_behind(cwd: Path) -> list[str]:
    """Everything under runs/ (files and folders): a refused run must write nothing."""
    return sorted(str(p.relative_to(cwd)) for p in (cwd / "runs").rglob("*"))


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


def test_no_model_stops_at_once_listing_the_models(tmp_path):
    user = tmp_path / "userconf"
    (user / "model").mkdir(parents=True)
    (user / "model" / "my_model.yaml").write_text(
        "name: my_model\nnum_layers: 4\nhidden_size: 512\nffn_hidden_size: 1536\nnum_attention_heads: 8\n"
        "num_kv_heads: 4\nhead_dim: 64\nvocab_size: 32000\n")
    work = tmp_path / "work"
    work.mkdir()
    res = kareus(work, "--config-dir", str(user), "parallel=pp2_tp8", "search=mbo")
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out
    lines = error_lines(res.stderr)
    assert all(ln.startswith("error: ") for ln in lines), lines
    model_lines = [ln for ln in lines if ln.startswith("error: model: no model selected")]
    assert len(model_lines) == 1, lines
    for name in (*SHIPPED_MODELS, "my_model"):  # the user's --config-dir model is listed too
        assert name in model_lines[0], model_lines[0]
    assert "+model=" in model_lines[0]
    assert left_behind(work) == []


def test_cross_field_problems_one_line_each_nothing_written(tmp_path):
    res = kareus(tmp_path, "+model=qwen1.7b", "parallel=pp2_tp8", "parallel.tp=3", "search.budget=0")
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out
    assert error_lines(res.stderr) == [
        "error: parallel.tp: 3 does not divide model.num_attention_heads=16",
        "error: parallel.tp: 3 does not divide model.num_kv_heads=8",
        "error: search.budget=0 must be > 0",
    ]
    assert left_behind(tmp_path) == []


def test_composition_typo_fails_without_traceback(tmp_path):
    res = kareus(tmp_path, *MISSION, "parallel.ttp=2")
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "Traceback" not in out
    assert "parallel.ttp" in res.stderr
    assert left_behind(tmp_path) == []


def test_describe_prints_the_partition_table(tmp_path):
    res = kareus(tmp_path, *MISSION, "mode=describe")  # the documented call, verbatim
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert "Pipeline stages" in res.stdout
    assert "Partition types" in res.stdout
    for key in ("fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp"):
        assert key in res.stdout
    assert "total search space:" in res.stdout
