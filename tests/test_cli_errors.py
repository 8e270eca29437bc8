"""``python -m kareus`` from a fresh working directory: bad input exits non-zero, one line per problem,
no traceback, nothing left under runs/; the documented describe call works."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.config.overrides import override_problems

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


def refused(cwd: Path, *args: str, timeout: float = 120) -> list[str]:
    """The stderr lines of a run that must be refused: exit 2, no traceback, nothing under runs/."""
    res = kareus(cwd, *args, timeout=timeout)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert left_behind(cwd) == []
    return error_lines(res.stderr)


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
        "error: parallel.tp: tp*cp=3 does not divide a node's 8 GPUs (hardware.gpus_per_node): a tensor/context-parallel "
        "group would span two nodes",
        "error: parallel.tp: 3 does not divide model.num_attention_heads=16",
        "error: parallel.tp: 3 does not divide model.num_kv_heads=8",
        "error: search.budget: must be > 0, got 0",
    ]
    assert left_behind(tmp_path) == []


def test_composition_typo_fails_on_one_line_listing_the_known_keys(tmp_path):
    res = kareus(tmp_path, *MISSION, "parallel.ttp=2")
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out
    lines = error_lines(res.stderr)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: parallel.ttp: unknown key; known: "), lines
    assert "tp" in lines[0].split("known: ")[1].split(", ")
    assert left_behind(tmp_path) == []


@pytest.mark.parametrize("override, line", [
    ("search=nope", "error: search=nope: no such option; allowed: artifact, exhaustive, mbo, nsga2, qnehvi, random, tpe"),
    ("search.passes=[total,bogus]", "error: search.passes[1]: invalid value 'bogus'; allowed: total, dynamic, static, "
                                    "uncertainty, fastest, spread, local, coverage"),
    # a bare value given to a list key: how to write it, and what an item may be
    ("search.passes=total", "error: search.passes: expects a list, got 'total'; write search.passes=[total]; "
                            "allowed items: total, dynamic, static, uncertainty, fastest, spread, local, coverage"),
    ("search.space.sms=5", "error: search.space.sms: expects a list, got '5'; write search.space.sms=[5]"),
    # a list or a value where a section belongs: 'Error merging override ...', naming nothing
    ("search.space.freq_mhz=[1]", "error: search.space.freq_mhz: expects a section (min, max, step, min_frac), got a "
                                  "list; set its fields as search.space.freq_mhz.FIELD=VALUE"),
    ("search.space.freq_mhz=5", "error: search.space.freq_mhz: expects a section (min, max, step, min_frac), got an "
                                "int; set its fields as search.space.freq_mhz.FIELD=VALUE"),
    ("search.shares=[1]", "error: search.shares: expects a section, got a list; set its fields as search.shares.FIELD=VALUE"),
    ("search.greedy=maybe", "error: search.greedy: 'maybe' is not a bool; allowed: true, false"),
    # OmegaConf reads any number as a bool (2 -> true): a number typed for a switch is refused
    ("search.greedy=2", "error: search.greedy: '2' is not a bool; allowed: true, false"),
    ("search.greedy=0", "error: search.greedy: '0' is not a bool; allowed: true, false"),
    ("parallel.sequence_parallel=0.5", "error: parallel.sequence_parallel: '0.5' is not a bool; allowed: true, false"),
    ("parallel.sequence_parallel='2'", "error: parallel.sequence_parallel: '2' is not a bool; allowed: true, false"),
    ("parallel={sequence_parallel:2}", "error: parallel.sequence_parallel: '2' is not a bool; allowed: true, false"),
    ("search.kappa=abc", "error: search.kappa: 'abc' is not a float"),
    ("search.batch_size=1.5", "error: search.batch_size: '1.5' is not an integer"),
    ("mode=bad", "error: mode: invalid value 'bad'; allowed: run, describe, search, train, reset, check"),
    ("search.kappa=0.1,0.2", "error: search.kappa=0.1,0.2: a sweep runs only with --multirun (-m); add it, or give one value"),
    # a list merges a group's options into one config: the later silently won, key by key
    ("parallel=[pp2_tp8,pp1_tp2]", "error: parallel=[pp2_tp8,pp1_tp2]: parallel takes one option, and a list merges "
                                   "them into one config; choose one of: pp10_tp8, pp1_tp2, pp2_cp2_tp4, pp2_tp2, "
                                   "pp2_tp8; to run each, sweep: -m parallel=pp2_tp8,pp1_tp2"),
    # a deleted setting: a traceback from the run (a folder left behind), or "Error merging override"
    ("~mode", "error: mode: a setting of the run cannot be deleted (~mode); set mode=VALUE instead, or leave it "
              "at its default"),
    ("~parallel.tp", "error: parallel.tp: a setting of the run cannot be deleted (~parallel.tp); set "
                     "parallel.tp=VALUE instead, or leave it at its default"),
])
def test_bad_override_is_one_line_naming_the_key_and_the_allowed_values(override, line):
    assert override_problems([*MISSION, override]) == [line.removeprefix("error: ")]


def test_a_sweep_of_no_value_is_refused():
    """range(0,0) launched no job and exited 0; under mode=run it recorded an empty sweep in MLflow."""
    assert override_problems(["-m", *MISSION, "mode=describe,search", "seed=range(0,0)"]) == [
        "seed=range(0,0): sweeps no value, so no job would run; give at least one"]


def test_a_number_given_to_a_switch_is_refused_in_the_sweep_job_that_has_it():
    assert override_problems(["-m", *MISSION, "search.greedy=true,3"]) == [
        "job 1 (search.greedy=3): search.greedy: '3' is not a bool; allowed: true, false"]


def test_override_grammar_error_names_the_override():
    [line] = override_problems([*MISSION, "search.passes=[total"])
    assert line.startswith("override 'search.passes=[total': ")


def test_good_overrides_and_calls_left_to_hydra_pass_the_check(tmp_path):
    assert override_problems([*MISSION, "search.passes=[total,dynamic]", f"hydra.run.dir={tmp_path}/r"]) == []
    assert override_problems([*MISSION, "+experiment=[no_clock_search,no_kernel_scheduling]"]) == []  # bundles merge
    assert override_problems(["-m", *MISSION, "search.kappa=0.1,0.2"]) == []  # a real sweep: Hydra's call
    assert override_problems([*MISSION, "hydra.mode=MULTIRUN", "search.kappa=0.1,0.2"]) == []
    assert override_problems(["--cfg", "job", "search=nope"]) == []  # Hydra's own flags: Hydra reports


def test_config_dir_options_are_listed_with_the_shipped_ones(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_model.yaml").write_text("name: my_model\n")
    [line] = override_problems(["--config-dir", str(tmp_path), "+model=nope", "parallel=pp2_tp8"])
    assert line.startswith("model=nope: no such option; allowed: ") and "my_model" in line and "qwen1.7b" in line


def test_a_sweep_without_a_model_lists_the_models_of_the_config_dir_too(tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "my_model.yaml").write_text("name: my_model\n")
    res = kareus(tmp_path, "-m", "--config-dir", str(tmp_path / "conf"), "parallel=pp1_tp2,pp2_tp2")
    lines = error_lines(res.stderr)
    assert res.returncode == 2 and len(lines) == 2, res.stderr[-2000:]
    assert all("NAME one of: llama3.2-3b, llama3.3-70b, my_model, qwen1.7b, tiny" in line for line in lines), lines


def test_flags_may_follow_the_overrides():
    from kareus.config.overrides import flags_first

    assert flags_first(["+model=tiny", "-m", "parallel=pp1_tp2,pp2_tp2", "-cd", "mine"]) == [
        "--multirun", "--config-dir", "mine", "+model=tiny", "parallel=pp1_tp2,pp2_tp2"]
    assert flags_first(["--cfg", "job", "-m", "a=1"]) == ["--cfg", "job", "-m", "a=1"]  # Hydra's own flags: as given


def test_a_sweep_with_m_after_an_override_runs(tmp_path):
    """Hydra's parser takes its flags before the overrides: this call printed its usage text."""
    res = kareus(tmp_path, "+model=tiny", "mode=describe", "-m", "parallel=pp1_tp2,pp2_tp2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("total search space") == 2


def test_bad_override_exits_2_with_one_line_and_writes_nothing(tmp_path):
    res = kareus(tmp_path, *MISSION, "search.passes=[total,bogus]")
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out and "HYDRA_FULL_ERROR" not in out
    assert error_lines(res.stderr) == [
        "error: search.passes[1]: invalid value 'bogus'; allowed: total, dynamic, static, uncertainty, fastest, "
        "spread, local, coverage"]
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
    assert left_behind(tmp_path) == []  # it measures nothing, so it leaves no empty run folder either


def test_describe_lists_the_slots_the_search_keeps(tmp_path):
    """``search.space.slots`` narrows each partition's slots; describe shows those, beside their space sizes."""
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "mode=describe", "search.space.slots=[sequential,first]")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("│ fwd_attn ")]
    assert rows and "sequential, norm_0 " in rows[0] and "linear_0" not in res.stdout
    assert "│          160 │" in rows[0]  # 2 slots x the default SM counts and clocks


def test_an_initial_design_that_fills_a_partitions_budget_is_named_before_the_search(tmp_path):
    """With budget_frac each partition has its own budget, so search.initial above one of them is no
    config error; it was capped silently, and the search there guided no batch."""
    tiny = ("+model=tiny", "parallel=pp1_tp2", "mode=describe", "search.initial=30")
    res = kareus(tmp_path, *tiny)
    [note] = [ln for ln in res.stderr.splitlines() if ln.startswith("note: search.initial")]  # a warning, not a result
    assert res.returncode == 0 and "(24 profiles) of fwd_trail, bwd_trail: mbo guides no batch" in note, note
    assert "note: search.initial" not in res.stdout
    unguided = kareus(tmp_path, *tiny, "search=random")  # random guides nothing anyway
    assert unguided.returncode == 0 and "note: search.initial" not in unguided.stderr


def test_help_names_kareus_not_the_module():
    res = kareus(Path.cwd(), "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("kareus") and "cli is powered by Hydra" not in res.stdout
    assert "+model=NAME" in res.stdout
    groups = res.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "\nsearch: artifact, exhaustive, mbo" in groups and "\nprofiler/cooldown: " in groups
    assert "schema" not in groups and "hydra/" not in groups  # the typed schemas are not choices


def test_help_lists_the_groups_from_one_copy_of_the_config_repository(monkeypatch):
    """Hydra copies its whole config repository for every group it lists: 240 copies, 8 s for --help."""
    from hydra import initialize_config_module
    from hydra._internal import config_repository
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra

    from kareus.cli import _list_groups_from_one_repository, help_groups

    monkeypatch.setattr(ConfigLoaderImpl, "get_group_options", ConfigLoaderImpl.get_group_options)  # put back after
    monkeypatch.setattr(sys, "argv", ["kareus", "--help"])
    copies = []
    copy_repository = config_repository.CachingConfigRepository.__init__
    monkeypatch.setattr(config_repository.CachingConfigRepository, "__init__",
                        lambda self, delegate: copies.append(delegate) or copy_repository(self, delegate))
    GlobalHydra.instance().clear()
    with initialize_config_module(version_base="1.3", config_module="kareus.conf"):
        every_copy = help_groups()
        assert len(copies) > 20
        copies.clear()
        _list_groups_from_one_repository()
        one_copy = help_groups()
    assert one_copy == every_copy and "\nsearch: artifact, exhaustive, mbo" in "\n" + one_copy
    assert len(copies) == 1


@pytest.mark.parametrize("args, line", [
    (["model=qwen1.7b"], "Could not override 'model'. No match in the defaults list. "
                         "To append to your default list use +model=qwen1.7b"),
    (["+model=qwen1.7b", "search=null"], "search=null: a config group needs an option; "
                                         "allowed: artifact, exhaustive, mbo, nsga2, qnehvi, random, tpe"),
])
def test_hydra_refusals_keep_their_hint_on_one_line(args, line):
    assert override_problems(args) == [line]


@pytest.mark.parametrize("body, line", [
    ("num_layrs: 4", "model.num_layrs: unknown key; known: "),
    ("num_layers: 4\nhidden_size: big", "model.hidden_size: 'big' is not an integer (in model/mine)"),
])
def test_an_error_inside_a_users_yaml_names_the_key_and_the_file(tmp_path, body, line):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(f"name: mine\n{body}\n")
    [got] = override_problems(["--config-dir", str(tmp_path), "+model=mine"])
    assert got.startswith(line) and got.endswith("(in model/mine)"), got


def test_a_bare_value_for_a_list_in_a_users_yaml_is_told_in_yaml(tmp_path):
    """The fix named was the command line's ``search.passes=[total]``, which is no YAML."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nsearch:\n  passes: total\n")
    [got] = override_problems(["--config-dir", str(tmp_path), "+model=tiny", "+experiment=mine"])
    assert got.startswith("search.passes: expects a list, got 'total'; write passes: [total]; allowed items: ")
    assert got.endswith("(in experiment/mine)"), got


@pytest.mark.parametrize("group, body, args, lines", [
    ("model", "name: mine\nnum_layers: 4\ntied_embeddings: {a}\n", ["+model=mine"],
     ["model.tied_embeddings: '2' is not a bool; allowed: true, false (in model/mine)"]),
    ("experiment", "# @package _global_\nsearch:\n  greedy: {b}\nparallel:\n  sequence_parallel: {c}\n",
     ["+model=tiny", "+experiment=[full,mine]"],
     ["search.greedy: '0' is not a bool; allowed: true, false (in experiment/mine)",
      "parallel.sequence_parallel: '1' is not a bool; allowed: true, false (in experiment/mine)"]),
    ("search", "defaults:\n  - /schema/search/mbo@_here_\n  - _self_\nname: mbo\ncorners: {d}\n",
     ["+model=tiny", "search=mine"], ["search.corners: '3' is not a bool; allowed: true, false (in search/mine)"]),
])
def test_a_number_at_a_switch_in_a_users_yaml_is_refused_as_on_the_command_line(tmp_path, group, body, args, lines):
    """OmegaConf reads ``tied_embeddings: 2`` as true, as it does ``search.greedy=2`` typed."""
    (tmp_path / group).mkdir()
    (tmp_path / group / "mine.yaml").write_text(body.format(a=2, b=0, c="'1'", d=3))
    assert override_problems(["--config-dir", str(tmp_path), *args]) == lines
    (tmp_path / group / "mine.yaml").write_text(body.format(a="true", b="false", c="true", d="true"))
    assert override_problems(["--config-dir", str(tmp_path), *args]) == []


@pytest.mark.parametrize("args, first", [
    (["--config-dir", "no_such_conf", "+model=qwen1.7b"], "error: --config-dir: "),
    (["+model=qwen1.7b", "search=null"], "error: search=null: a config group needs an option"),
    (["+model=tiny", "parallel=pp1_tp2", "tracking.uri="], "error: tracking.uri: empty"),
    (["+model=tiny", "parallel=pp1_tp2", "tracking.uri=mlruns"], "error: tracking.uri: MLflow's file store is retired"),
    (["+model=tiny", "parallel=pp1_tp2", "tracking.uri=file:///tmp/mlruns"], "error: tracking.uri: MLflow's file store"),
    (["+model=tiny", "parallel=pp1_tp2", "tracking.experiment="], "error: tracking.experiment: must name"),
    (["+model=tiny", "parallel=pp1_tp2", "parallel.schedule=gpipe"], "error: parallel.schedule: must be a known"),
    (["+model=tiny", "parallel=pp1_tp2", "tracking.artifact_location=/proc/kareus_artifacts"],
     "error: tracking.artifact_location: cannot create /proc/kareus_artifacts"),
])
def test_refused_with_one_line_exit_2_nothing_written(tmp_path, args, first):
    res = kareus(tmp_path, *args)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith(first), lines
    assert left_behind(tmp_path) == [] and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("arg, first", [
    ("hydra.run.dir=notes.txt/run", "error: hydra.run.dir: cannot create "),
    ("tracking.uri=sqlite:///notes.txt/mlflow.db", "error: tracking.uri: cannot create "),
])
def test_a_place_no_folder_can_be_made_is_one_line(tmp_path, arg, first):
    """Hydra failed making the run folder, and MLflow its store's, each with a traceback."""
    (tmp_path / "notes.txt").write_text("a file where a folder would go")
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "progress=false", arg)
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith(first) and "notes.txt is not a folder" in lines[0], lines
    assert left_behind(tmp_path) == []


@pytest.mark.parametrize("args, line", [
    (["hydra.run.dir=${oc.env:KAREUS_TEST_UNSET}"], "hydra.run.dir: ${oc.env:KAREUS_TEST_UNSET} does not resolve "
     "(KeyError raised while resolving interpolation: \"Environment variable 'KAREUS_TEST_UNSET' not found\")"),
    (["hydra.job.name=logs/mine"], "hydra.job.name: 'logs/mine' names the run's log file (<name>.log) in its folder; "
     "give a plain file name, without '/' or '\\'"),
    (["-m", "seed=1,2", "hydra.sweep.dir=sweeps/${hydra:job.name}"], "hydra.sweep.dir: sweeps/${hydra:job.name} does "
     "not resolve (Hydra makes the sweep's folder before any job's ${hydra:...} is known)"),
])
def test_a_run_folder_or_log_name_hydra_cannot_use_is_one_line(tmp_path, monkeypatch, args, line):
    """Each failed inside Hydra with a traceback: resolving the folder, or opening the log file in a
    folder that does not exist."""
    monkeypatch.delenv("KAREUS_TEST_UNSET", raising=False)
    assert override_problems(["+model=tiny", "parallel=pp1_tp2", *args]) == [line]


def test_a_run_folder_named_by_hydras_own_values_is_checked_and_cleaned_as_any_other(tmp_path):
    """``${hydra:job.name}`` in the run folder resolves as Hydra resolves it in the job: it was
    refused as unresolvable, and the folder a describe run made was left behind."""
    args = ("+model=tiny", "parallel=pp1_tp2", "hydra.run.dir=notes/${hydra:job.name}")
    assert override_problems(list(args)) == []
    res = kareus(tmp_path, *args, "mode=describe")
    assert res.returncode == 0 and "Warning" not in res.stderr, res.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    assert refused(tmp_path, "hydra.job.name=a/b", *args) == [
        "error: hydra.job.name: 'a/b' names the run's log file (<name>.log) in its folder; give a plain file name, "
        "without '/' or '\\'"]
    assert list(tmp_path.iterdir()) == []


def test_a_replayed_table_without_the_models_partitions_is_one_line(tmp_path):
    from kareus.hardware.tables import convert_a100_attention

    table = convert_a100_attention(Path(__file__).resolve().parents[2] / "shared" / "data" / "a100_attention_tp2",
                                   tmp_path / "table.csv")
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "hardware=replay", f"hardware.table={table}")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    [line] = error_lines(res.stderr)
    assert line.startswith("error: hardware: replay holds no measurements of partition(s) fwd_attn")
    assert left_behind(tmp_path) == []


def test_a_replayed_tables_range_is_what_the_table_holds(tmp_path):
    """The recorded table holds 1..20 SMs: a range above the default sms_max of 16 searches its top
    settings, and a range past them is one line naming what it holds, where a search of empty spaces
    used to run, write empty frontiers and exit 0."""
    from kareus.hardware.tables import convert_a100_attention

    table = convert_a100_attention(Path(__file__).resolve().parents[2] / "shared" / "data" / "a100_attention_tp2",
                                   tmp_path / "table.csv")
    replay = ("hardware=replay", f"hardware.table={table}", "progress=false")
    res = kareus(tmp_path, *replay, "mode=describe", "search.space.sms_min=18")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "fwd_attn_tp2: 22 candidates" in res.stdout, res.stdout
    res = kareus(tmp_path, *replay, "mode=search", "search.space.sms_min=25", "search.space.sms_max=30")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    [line] = error_lines(res.stderr)
    assert line.startswith("error: search.space: keeps none of the settings hardware=replay recorded for "
                           "partition(s) fwd_attn_tp2, "), line
    assert line.endswith("they hold sms 1..20 and freq_mhz 1200..1410 (slots: attn_0, linear_0, linear_1, norm_0, "
                         "rope_0, sequential)"), line
    assert left_behind(tmp_path) == []


def test_a_replayed_table_with_clocks_the_gpu_cannot_lock_is_one_line(tmp_path):
    """Each candidate at such a clock failed to lock and was charged to the budget: a search of an H100
    table under the A100 description ended with every profile failed, an empty frontier and exit 0."""
    from kareus.hardware.tables import convert_a100_attention

    table = convert_a100_attention(Path(__file__).resolve().parents[2] / "shared" / "data" / "a100_attention_tp2",
                                   tmp_path / "table.csv")
    assert refused(tmp_path, "hardware=replay", f"hardware.table={table}", "hardware.max_mhz=1395", "mode=search") == [
        "error: hardware: replay recorded clocks 1410 MHz, which A100-SXM4-40GB cannot lock (210..1395 in 15 MHz "
        "steps); describe the GPU the table was recorded on with hardware.gpu, hardware.min_mhz, hardware.max_mhz "
        "and hardware.step_mhz"]


def test_a_replayed_table_with_more_comm_sms_than_the_gpu_has_is_one_line(tmp_path):
    """A row at 200 comm SMs on the 108-SM A100 was searched as any other setting."""
    table = tmp_path / "table.csv"
    table.write_text("partition,slot,sms,freq_mhz,time_s,energy_j\np,sequential,4,1410,0.001,1.0\n"
                     "p,sequential,200,1410,0.001,1.0\n")
    assert refused(tmp_path, "hardware=replay", f"hardware.table={table}", "mode=search") == [
        "error: hardware: replay recorded comm SM counts 200, which A100-SXM4-40GB with 108 SMs cannot give a comm "
        "kernel (1..107); describe the GPU the table was recorded on with hardware.gpu and hardware.sms"]


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_a_ray_cluster_refusal_records_nothing(tmp_path):
    """The Ray launcher checked its cluster inside the run, after MLflow had recorded it: the refusal
    left runs/mlflow.db with a FAILED run and its config artifact."""
    pytest.importorskip("ray")
    lines = refused(tmp_path, "+model=tiny", "parallel=pp2_tp2", "progress=false", "launcher=ray",
                    "launcher.gpus_per_task=1", timeout=300)
    assert [ln for ln in lines if "error" in ln.lower()] == [  # beside Ray's own start-up log
        "error: launcher: a partition search needs 1 GPU(s) but the Ray cluster has 0; set launcher.gpus_per_task "
        "or add GPU nodes"]


def test_a_forked_worker_leaves_sigterm_to_its_default():
    """Forked workers inherited the CLI's SIGTERM handler: each stopped worker printed the resume line."""
    code = ("import os, signal; signal.signal(signal.SIGTERM, lambda *a: None); "
            "from kareus.launch.launchers import _worker_start; _worker_start(os.getppid()); "
            "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_a_real_gpu_backend_without_a_gpu_is_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "hardware=a100_cuda", "profiler/frequency=nvml")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert error_lines(res.stderr) == ["error: hardware.device: cuda needs a CUDA GPU and a CUDA build of torch, and "
                                       "torch sees none; use hardware.device=cpu to check the logic without one"]


def test_a_dead_tracking_server_is_refused_at_once(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", f"tracking.uri=http://127.0.0.1:{port}", timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert error_lines(res.stderr) == [l for l in error_lines(res.stderr)
                                       if l.startswith(f"error: tracking.uri: cannot reach http://127.0.0.1:{port}")]
    assert len(error_lines(res.stderr)) == 1 and left_behind(tmp_path) == []


def test_a_sweep_with_a_bad_job_is_refused_before_any_job_runs(tmp_path):
    res = kareus(tmp_path, "-m", *MISSION, "search.budget_frac=1.5,0.05")
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: job 0 (search.budget_frac=1.5): search.budget_frac"), lines
    assert left_behind(tmp_path) == []  # no sweep folder, no MLflow store


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
@pytest.mark.parametrize("batches", [[], ["hydra.sweeper.max_batch_size=1"]], ids=["one_batch", "batch_per_job"])
def test_a_sweep_job_refused_at_run_time_fails_alone_and_the_sweep_goes_on(tmp_path, batches):
    import sqlite3
    from contextlib import closing

    res = kareus(tmp_path, "-m", "+model=tiny", "parallel=pp1_tp2", "search=random", "search.budget=8",
                 "plan.deadline_s=0.000001,1000", *batches, timeout=240)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [ln for ln in error_lines(res.stderr) if ln.startswith("error: ")]
    assert lines[0].startswith("error: job 0 (plan.deadline_s=1e-06): plan: no plan meets plan.deadline_s=1e-06 s")
    assert lines[-1] == "error: 1 of 2 sweep jobs were refused: job 0 (plan.deadline_s=1e-06)"
    # the job's line and the summary, nothing else: no error output from Hydra (progress and Hydra's own
    # log lines, such as "Launching 2 jobs", go to stderr too)
    assert len([ln for ln in error_lines(res.stderr) if "[kareus.progress]" not in ln and "][HYDRA] " not in ln]) == 2
    jobs = sorted((tmp_path / "runs" / "multirun").glob("*/*/[0-9]"))
    assert [j.name for j in jobs] == ["0", "1"]
    assert (jobs[1] / "plan_selected.yaml").is_file() and not (jobs[0] / "plan_selected.yaml").exists()
    assert (jobs[0] / "journal.sqlite").is_file()  # the refused job's measurements are kept
    refused = json.loads((jobs[0] / "summary.json").read_text())  # and its summary: reference, costs, why
    assert refused["selection_error"].startswith("no plan meets plan.deadline_s=1e-06 s") and refused["reference"]
    with closing(sqlite3.connect(tmp_path / "runs" / "mlflow.db")) as con:
        rows = con.execute("SELECT m.key, m.value, r.status FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
                           "WHERE m.key IN ('jobs', 'jobs_failed')").fetchall()
    assert sorted(rows) == [("jobs", 2.0, "FAILED"), ("jobs_failed", 1.0, "FAILED")]


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_a_sweep_whose_every_job_is_refused_leaves_no_sweep_folder(tmp_path):
    """The MLflow sweep callback's run-id file beside multirun.yaml kept the empty folder."""
    tiny = ("+model=tiny", "parallel=pp1_tp2", "mode=search", "search=random", "search.budget=4", "progress=false")
    assert kareus(tmp_path, *tiny, "hydra.run.dir=runs/base", timeout=240).returncode == 0
    res = kareus(tmp_path, "-m", *tiny, "resume=runs/base", "seed=1,2", timeout=240)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert error_lines(res.stderr)[-1].startswith("error: 2 of 2 sweep jobs were refused")
    assert not list((tmp_path / "runs" / "multirun").glob("*/*")), list((tmp_path / "runs").rglob("*"))


def test_a_describe_sweep_records_nothing(tmp_path):
    res = kareus(tmp_path, "-m", "mode=describe", "+model=tiny", "parallel=pp1_tp2,pp2_tp2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (tmp_path / "runs" / "mlflow.db").exists() and "MlflowSweepCallback" not in res.stderr
    assert not list((tmp_path / "runs").rglob("kareus.log"))  # no job folder left
    assert left_behind(tmp_path) == []  # nor the sweep's, which held Hydra's multirun.yaml alone
    assert "[HYDRA]" not in res.stdout and "Launching 2 jobs" in res.stderr  # stdout: the results alone
    # each job's results are headed by the job, as its error lines are: stdout alone tells them apart
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("== job")] == [
        "== job 0 (parallel=pp1_tp2) ==", "== job 1 (parallel=pp2_tp2) =="]


def test_a_sweep_over_where_it_is_recorded_is_refused():
    lines = override_problems(["-m", *MISSION, "tracking.experiment=ea,eb"])
    assert lines == ["tracking.experiment: one sweep records into one MLflow store and experiment; "
                     "run one sweep per value"]


def test_a_sweep_whose_jobs_a_group_moves_to_another_experiment_is_refused(tmp_path):
    """``tracking=default,other`` swept the group, not a ``tracking.*`` key: job 1's runs went to
    another experiment, under a parent run the UI could not show them beside."""
    (tmp_path / "tracking").mkdir()
    (tmp_path / "tracking" / "other.yaml").write_text("defaults:\n  - default\n  - _self_\nexperiment: other\n")
    lines = override_problems(["--config-dir", str(tmp_path), "-m", "+model=tiny", "parallel=pp1_tp2",
                               "tracking=default,other"])
    assert lines == ["tracking: one sweep records into one MLflow store and experiment, but its jobs record into 2 "
                     "(tracking=default: sqlite:///runs/mlflow.db experiment kareus; tracking=other: "
                     "sqlite:///runs/mlflow.db experiment other); run one sweep per store and experiment"]


def test_every_sweep_job_is_composed_and_named():
    lines = override_problems(["-m", *MISSION, "search=mbo,nope", "search.kappa=0.1,0.2"])
    assert lines == [f"job {n} (search=nope search.kappa={k}): search=nope: no such option; allowed: artifact, "
                     "exhaustive, mbo, nsga2, qnehvi, random, tpe" for n, k in ((2, "0.1"), (3, "0.2"))]


def test_a_refused_run_in_the_working_folder_leaves_the_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    res = kareus(work, *MISSION, "parallel.tp=3", "hydra.run.dir=.")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert work.is_dir() and tmp_path.is_dir()


def test_a_refused_run_removes_only_the_folders_it_made(tmp_path):
    res = kareus(tmp_path, *MISSION, "parallel.tp=3", "hydra.job.chdir=true")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert tmp_path.is_dir() and not (tmp_path / "runs").exists()  # no empty runs/<date>/ either
    (tmp_path / "mine").mkdir()
    (tmp_path / "runs").mkdir()
    res = kareus(tmp_path, *MISSION, "parallel.tp=3", "hydra.run.dir=mine")
    assert res.returncode == 2
    assert (tmp_path / "mine").is_dir() and (tmp_path / "runs").is_dir()  # they were there before


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_a_refused_run_in_the_folder_of_an_earlier_run_leaves_that_runs_record(tmp_path):
    """Hydra rewrites .hydra/ and appends to the log before the config is checked: the folder's config
    then described the refused run, not the results beside it."""
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "mode=search", "progress=false",
                 "tracking.enabled=false", "hydra.run.dir=myrun", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    before = {p: p.read_bytes() for p in sorted((tmp_path / "myrun").rglob("*")) if p.is_file()}
    assert (tmp_path / "myrun" / ".hydra" / "config.yaml") in before
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "mode=search", "progress=false",
                 "tracking.enabled=false", "hydra.run.dir=myrun", "parallel.tp=3")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    after = {p: p.read_bytes() for p in sorted((tmp_path / "myrun").rglob("*")) if p.is_file()}
    assert after == before


def test_describe_into_a_reader_that_leaves_stops_quietly_and_leaves_nothing(tmp_path):
    """``mode=describe | head -0``: rich exited with status 1 on the broken pipe, before the empty run
    folder was removed; now it stops as a shell tool does (128 + SIGPIPE), silent, nothing left."""
    import signal

    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(NO_COLOR="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, "-m", "kareus", *MISSION, "mode=describe"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the first line: the first write breaks the pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE, err.decode()[-2000:]
    assert err.strip() == b""
    assert left_behind(tmp_path) == []


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_a_refused_job_in_a_reused_sweep_folder_leaves_the_earlier_jobs_as_they_were(tmp_path):
    """Hydra rewrites a job folder's config before the job runs: a refused job put nothing back (the
    folder's config no longer described its results) and left a folder of its own behind."""
    tiny = ("+model=tiny", "parallel=pp1_tp2", "mode=search", "search=random", "search.budget=4", "progress=false",
            "tracking.enabled=false", "hydra.sweep.dir=runs/sweep")
    assert kareus(tmp_path, "-m", *tiny, "seed=0", timeout=240).returncode == 0
    job = tmp_path / "runs" / "sweep" / "0"
    before = {p: p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()}
    tables = {p: p.read_bytes() for p in (tmp_path / "runs" / "sweep").glob("sweep_summary.*")}
    res = kareus(tmp_path, "-m", *tiny, "seed=0,1", "resume=runs/nowhere", timeout=240)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert error_lines(res.stderr)[-1].startswith("error: 2 of 2 sweep jobs were refused")
    assert {p: p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()} == before
    assert sorted(p.name for p in (tmp_path / "runs" / "sweep").iterdir()) == [
        "0", "multirun.yaml", "sweep_summary.csv", "sweep_summary.json"]
    # the first sweep's table stays: the refused sweep's jobs left no results of their own
    assert {p: p.read_bytes() for p in tables} == tables and len(tables) == 2
    # a job refused for its folder's journal names what differs from the config that wrote it
    res = kareus(tmp_path, "-m", *tiny, "seed=1", timeout=240)
    lines = [ln for ln in error_lines(res.stderr) if ln.startswith("error: job 0")]
    assert res.returncode == 2 and lines and lines[0].endswith("; it differs in search.seed (0 -> 1), seed (0 -> 1)"), \
        res.stderr[-3000:]
    assert {p: p.read_bytes() for p in sorted(job.rglob("*")) if p.is_file()} == before


@pytest.mark.slow  # an end-to-end run: left out of the quick tier
def test_a_first_run_on_a_fresh_machine_prints_no_library_log_lines(tmp_path, monkeypatch):
    """matplotlib's INFO line about building its font cache reached stderr through Hydra's logging."""
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))  # no font cache yet
    res = kareus(tmp_path, "+model=tiny", "parallel=pp1_tp2", "search=random", "search.budget=8", "progress=false",
                 timeout=240)  # MLflow's plots import matplotlib
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "mpl").is_dir() and "matplotlib" not in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("name,text,says", [
    ("broken", "name: [1,2\n", "{path}:2: not valid YAML (expected ',' or ']', but got '<stream end>')"),
    # a ValueError to Hydra: it was printed as the codec's words alone, naming no file
    ("binary", b"name: x\n\xff\xfe", "{path}: not UTF-8 text (byte 0xff at 8)"),
    # Hydra picks the shipped file: the user's edited ``tiny`` was ignored without a word
    ("tiny", "name: tiny\nnum_layers: 6\n",
     "--config-dir: {path} has the name of a shipped model option, which is the one chosen by model=tiny; "
     "rename the file"),
], ids=["unparsable", "not-text", "shadowed"])
def test_a_user_model_file_that_cannot_be_used_is_one_line_naming_it(tmp_path, name, text, says):
    user = tmp_path / "userconf" / "model"
    user.mkdir(parents=True)
    (user / f"{name}.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    res = kareus(tmp_path, "--config-dir", str(tmp_path / "userconf"), f"+model={name}", "mode=describe")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert error_lines(res.stderr) == ["error: " + says.format(path=user / f"{name}.yaml")]
    assert left_behind(tmp_path) == []


def test_a_primary_config_in_a_users_config_dir_is_refused_not_ignored(tmp_path):
    """Hydra reads Kareus' own ``config.yaml`` first: the user's, with its ``seed: 7``, was ignored."""
    (tmp_path / "userconf").mkdir()
    (tmp_path / "userconf" / "config.yaml").write_text("seed: 7\n")
    assert override_problems(["--config-dir", str(tmp_path / "userconf"), "+model=tiny"]) == [
        f"--config-dir: {tmp_path / 'userconf' / 'config.yaml'} would be ignored: the run's primary config is "
        "Kareus' own; put its settings in experiment/NAME.yaml (first line '# @package _global_') and choose it "
        "with +experiment=NAME"]


@pytest.mark.parametrize("args, line", [
    (["+model=tiny", "+model=qwen1.7b"], "model: chosen more than once (+model=tiny, +model=qwen1.7b); give one option"),
    (["+model=tiny", "+search=tpe"], "+search=tpe: search already has an option (its default); choose another "
                                     "with search=tpe"),
])
def test_a_group_chosen_twice_is_told_what_to_type(args, line):
    """Hydra's "Multiple values for model. To override a value use 'override model: ...'" names a
    defaults-list form that has no place on the command line."""
    assert override_problems(args) == [line]


def test_a_config_group_given_a_value_is_told_to_choose_an_option(tmp_path):
    res = kareus(tmp_path, "+model={name:x}", "mode=describe")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert error_lines(res.stderr) == ["error: +model={name:x}: model is a config group: choose an option by name "
                                       "(+model=NAME) and set its fields as model.FIELD=VALUE"]
    assert left_behind(tmp_path) == []
    # a nested group: Hydra named the top level's keys as the ones known
    assert override_problems(["+model=tiny", "profiler/cooldown={seconds:1}"]) == [
        "profiler/cooldown={seconds:1}: profiler/cooldown is a config group: choose an option by name "
        "(profiler/cooldown=NAME) and set its fields as profiler.cooldown.FIELD=VALUE"]


def test_a_sweep_job_whose_slots_leave_a_partition_empty_is_refused_before_any_job_runs(tmp_path):
    """The slots were checked once the job's partitions were built: job 0 had profiled and written its
    folder by the time job 1 was refused."""
    res = kareus(tmp_path, "-m", "+model=tiny", "parallel=pp1_tp2", "mode=search", "search=random", "search.budget=4",
                 "search.space.slots=null,[attn_0]", timeout=240)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: job 1 (search.space.slots=[attn_0]): search.space.slots: "
                                                   "4 partition(s) have none of attn_0"), lines
    assert left_behind(tmp_path) == []
