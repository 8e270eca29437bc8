"""validate(): one test per cross-field rule, each asserting its exact problem line (key + message).

Configs are composed with Hydra exactly as the CLI composes them; plain value overrides are then
applied with Hydra's own override parser and merge rule, so only group choices cost a composition.
"""
from __future__ import annotations

import numpy as np
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from conftest import compose_config
from kareus.config.validate import ConfigError, validate
from kareus.registry import FREQUENCY_CONTROLLERS, SEARCHERS

BASE = ("+model=qwen1.7b", "parallel=pp2_tp8")
# Other group choices, bundled so that each costs one composition.
ALT1 = ("compose=perseus", "launcher=process", "profiler/cooldown=temperature", "search=artifact")
ALT2 = ("launcher=ray", "profiler/cooldown=predictive", "search=random")
TOP_LEVEL_VALUES = ("mode", "seed", "progress", "resume")  # plain values, not config groups
_PARSER = OverridesParser.create()


def _is_group_choice(override: str) -> bool:
    key = override.split("=", 1)[0].lstrip("+")
    return key.startswith(("~", "hydra.")) or ("." not in key and key not in TOP_LEVEL_VALUES)


def configured(*overrides: str):
    """The composed config: group choices through Hydra, values merged as Hydra merges overrides."""
    groups = tuple(o for o in overrides if _is_group_choice(o))
    cfg = compose_config(*groups)
    for ov in _PARSER.parse_overrides([o for o in overrides if not _is_group_choice(o)]):
        OmegaConf.update(cfg, ov.key_or_group, ov.value(), merge=True, force_add=ov.is_add())
    return cfg


def problems(*overrides: str, base: tuple[str, ...] = BASE) -> list[str]:
    """Every problem validate() reports for base + overrides ([] when the config is usable)."""
    try:
        validate(configured(*base, *overrides))
    except ConfigError as err:
        return list(err.problems)
    return []


@pytest.fixture(scope="module")
def hw():
    """The default GPU's datasheet values (the expected lines quote them)."""
    return compose_config(*BASE).hardware


# ---------------------------------------------------------------------------------------- baseline


def test_documented_config_has_no_problems_and_returns_typed_sections():
    cfg = configured(*BASE, "search=mbo")
    typed = validate(cfg)  # raises ConfigError listing every problem otherwise
    from kareus.search.config import MBOConfig

    assert isinstance(typed["search"], MBOConfig)
    assert set(typed) >= {"hardware", "partitioner", "search", "compose", "launcher", "profiler", "plan", "tracking"}


@pytest.mark.parametrize("groups", [ALT1, ALT2], ids=["alt1", "alt2"])
def test_component_rules_run_without_error(groups):
    """validate() calls every section's problems(ctx); none may fail to be checked."""
    assert problems(*groups) == []


# ----------------------------------------------------------------------------- model and parallel


@pytest.mark.parametrize("field", ["tp", "pp", "cp", "dp", "micro_batch_size", "num_microbatches",
                                   "seq_len", "nanobatches"])
def test_parallel_sizes_must_be_positive(field):
    assert f"parallel.{field}: must be >= 1, got 0" in problems(f"parallel.{field}=0")


@pytest.mark.parametrize("field", ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                   "num_kv_heads", "head_dim", "vocab_size"])
@pytest.mark.parametrize("bad", [0, -512])
def test_model_sizes_must_be_positive(field, bad):
    """The shape rules divide by them (num_kv_heads=0 raised ZeroDivisionError), and the workload
    built from a zero or negative size either failed mid-run or reported plans of negative FLOPs."""
    assert problems(f"model.{field}={bad}") == [f"model.{field}: must be >= 1, got {bad}"]


def test_a_layout_whose_weights_and_gradients_overflow_the_gpu_is_refused():
    """llama3.3-70b on tp=2 alone holds 35 B parameters per GPU: no Megatron setup fits 40 GB."""
    assert problems(base=("+model=llama3.3-70b", "parallel=pp1_tp2")) == [
        "parallel: llama3.3-70b on tp=2 pp=1 puts 35.3 B parameters on a GPU, at least 141 GB for bf16 weights "
        "and gradients alone, more than A100-SXM4-40GB's 40 GB; raise parallel.tp or parallel.pp"]
    assert problems("hardware.memory_gb=160", base=("+model=llama3.3-70b", "parallel=pp1_tp2")) == []
    assert problems(base=("+model=llama3.3-70b", "parallel=pp10_tp8", "hardware=h100_sim")) == []  # the held-out layout


def test_a_layout_whose_layer_inputs_overflow_the_gpu_is_refused():
    """Full recompute in chunks of c layers keeps each chunk's input for every microbatch in flight, and
    the chunk being recomputed its other layers' inputs: on llama3.3-70b's first stage of ten (8 layers,
    10 microbatches) one chunk of 8 keeps least, 10 + 7 inputs of 32768 x 8 x 8192 bf16 values, 73 GB."""
    base = ("+model=llama3.3-70b", "parallel=pp10_tp8", "parallel.seq_len=32768")
    assert problems(base=base) == [
        "parallel: llama3.3-70b on tp=8 pp=10 keeps at least 73 GB of layer inputs for 10 microbatches in flight "
        "on stage 0 (full recompute in chunks of 8 layers, the least any chunking keeps), 77 GB with its weights "
        "and gradients, more than A100-SXM4-40GB's 40 GB; lower parallel.micro_batch_size or parallel.seq_len, "
        "raise parallel.cp, shard them over tp with parallel.sequence_parallel=true, or give stage 0 fewer "
        "layers with parallel.layer_split"]
    fits = ("parallel.sequence_parallel=true", "parallel.micro_batch_size=2", "parallel.seq_len=8192", "hardware=h100_sim")
    for change in fits:
        assert problems(change, base=base) == [], change


def test_the_recompute_chunk_that_keeps_least_sets_the_bound():
    """One input per layer (chunks of one) is the most full recompute keeps, not the least: 8 layers and
    10 microbatches in flight keep 80 inputs that way, 17 with one chunk of 8 (10 chunk inputs, 7 inside)."""
    from kareus.workload.memory import least_layer_inputs

    assert least_layer_inputs(8, 10) == (17, 8)
    assert least_layer_inputs(8, 1) == (5, 2)  # one microbatch: 4 chunk inputs and 1 inside, not 8 inputs
    assert least_layer_inputs(28, 1)[0] == min(-(-28 // c) + c - 1 for c in range(1, 29)) == 10
    assert least_layer_inputs(0, 4) == (0, 0)


def test_micro_batch_must_split_into_nanobatches():
    assert problems("parallel.micro_batch_size=7") == [
        "parallel.micro_batch_size: 7 does not split into parallel.nanobatches=2 equal nanobatches"]


def test_sequence_parallel_tokens_must_split_over_tp():
    """The workload builder raised a traceback, after Hydra had written the run folder. Megatron scatters
    each sequence over tp: a batch of 4 could make 2052 tokens a sequence split in sum (2 x 2052 is a
    multiple of 8), which megatron's scatter refuses."""
    got = problems("parallel.micro_batch_size=2", "parallel.seq_len=2050", "parallel.sequence_parallel=true")
    assert got == ["parallel.sequence_parallel: a sequence's 2050 tokens per GPU (seq_len/cp) do not split over tp=8"], got
    assert problems("parallel.micro_batch_size=4", "parallel.seq_len=2052", "parallel.sequence_parallel=true") == [
        "parallel.sequence_parallel: a sequence's 2052 tokens per GPU (seq_len/cp) do not split over tp=8"]
    assert problems("parallel.micro_batch_size=2", "parallel.seq_len=2050", "parallel.sequence_parallel=false") == []


def test_an_odd_sequence_is_valid_without_context_parallelism():
    assert problems("parallel.seq_len=4095") == []


def test_cp_must_divide_sequence_twice():
    assert problems("parallel.tp=4", "parallel.cp=2", "parallel.seq_len=8190") == [
        "parallel.cp: seq_len 8190 must be divisible by 2*cp=4 (causal load balancing)"]


def test_tp_times_cp_must_fit_one_node():
    assert problems("parallel.tp=4", "parallel.cp=4") == [
        "parallel.tp: tp*cp=16 GPUs do not fit one node of 8 GPUs"]


def test_node_size_comes_from_the_hardware():
    assert problems("hardware.gpus_per_node=4") == ["parallel.tp: tp*cp=8 GPUs do not fit one node of 4 GPUs"]


def test_a_group_that_would_span_two_nodes_is_refused():
    """Three GPUs per node put stage 1's TP group on ranks 2 and 3, across two nodes, modelled on NVLink."""
    assert problems("hardware.gpus_per_node=3", "parallel.tp=2", "parallel.cp=1") == [
        "parallel.tp: tp*cp=2 does not divide a node's 3 GPUs (hardware.gpus_per_node): a tensor/context-parallel "
        "group would span two nodes"]
    assert problems("hardware.gpus_per_node=4", "parallel.tp=2", "parallel.cp=1") == []


def test_an_empty_resume_is_refused_not_taken_for_a_new_run():
    """``resume=$LAST`` with LAST unset measured every candidate again in a new folder."""
    assert problems("resume=") == ["resume: empty; give the run directory to continue (resume=runs/<date>/<time>), "
                                   "or leave resume unset for a new run"]


def test_an_energy_counter_slower_than_the_profilers_windows_is_refused():
    """Every window failed as shorter than the counter's period; the run ended with empty frontiers."""
    assert problems("hardware.counter_period_s=100") == [
        "hardware.counter_period_s: 100 s is longer than the profiler's longest window (profiler.target_window_s=5 s, "
        "doubled on each of 2 retries: 20 s), so no window would see the energy counter update"]
    assert problems("hardware.counter_period_s=20") == []  # a window doubled twice reads it


def test_fewer_microbatches_than_stages_is_allowed_as_megatron_allows_it():
    """Megatron's non-interleaved 1F1B warms up min(pp - rank - 1, microbatches) steps: the pipeline
    never fills, but it runs, and so does its plan."""
    from kareus.compose import pipeline_dag
    from kareus.compose.iteration import critical_path

    assert problems("parallel.num_microbatches=1") == []
    dag = pipeline_dag("1f1b", 2, 1)
    finish = critical_path(dag, np.ones(len(dag)))[1]
    assert len(dag) == 4 and finish.max() == 4  # F0 -> F1 -> B1 -> B0: a chain


def test_an_unknown_pipeline_schedule_is_refused_before_anything_runs():
    assert problems("parallel.schedule=gpipe") == [
        "parallel.schedule: must be a known pipeline schedule (1f1b), got 'gpipe'"]


def test_tp_must_divide_attention_heads():
    # tp | kv heads and kv heads | heads imply tp | heads, so this rule always fires beside another.
    assert problems("model.num_attention_heads=20", "model.num_kv_heads=4") == [
        "parallel.tp: 8 does not divide model.num_attention_heads=20",
        "parallel.tp: 8 does not divide model.num_kv_heads=4"]


def test_tp_must_divide_kv_heads():
    assert problems("parallel.tp=4", "model.num_attention_heads=24", "model.num_kv_heads=6") == [
        "parallel.tp: 4 does not divide model.num_kv_heads=6"]


def test_tp_above_kv_heads_is_refused():
    """Megatron requires num_query_groups % tp == 0: KV heads are sharded, never replicated."""
    assert problems("parallel.tp=8", "model.num_kv_heads=4") == ["parallel.tp: 8 does not divide model.num_kv_heads=4"]


def test_kv_heads_must_divide_attention_heads():
    assert problems("parallel.tp=1", "model.num_kv_heads=3") == [
        "model.num_kv_heads: 3 does not divide model.num_attention_heads=16"]


def test_tp_must_divide_ffn():
    assert problems("model.ffn_hidden_size=6004") == ["parallel.tp: 8 does not divide model.ffn_hidden_size=6004"]


def test_pp_must_divide_layers():
    assert problems("parallel.pp=3") == [
        "parallel.pp: 3 does not divide model.num_layers=28; set parallel.layer_split to split unevenly"]


def test_explicit_layer_split_allows_uneven_stages():
    assert problems("parallel.pp=3", "parallel.layer_split=[9,9,10]") == []


PASS_NAMES = "total, dynamic, static, uncertainty, fastest, spread, local, coverage"


@pytest.mark.parametrize("override,lines", [
    ("search.passes=[[total]]", [f"search.passes[0]: expects one of {PASS_NAMES}, got a list"]),
    ("search.expected=[{a:1}]", [f"search.expected[0]: expects one of {PASS_NAMES}, got a mapping"]),
    ("search.space.slots=[sequential,[attn_0]]", ["search.space.slots[1]: expects a str, got a list"]),
    ("parallel.layer_split=[[14],[14]]", ["parallel.layer_split[0]: expects an int, got a list",
                                          "parallel.layer_split[1]: expects an int, got a list"]),
])
def test_a_list_or_mapping_inside_a_list_of_values_is_named(override, lines):
    """OmegaConf checks a typed list's plain items only: these reached the rules, which raised (a
    traceback, a run folder left behind) or said 'cannot be checked'."""
    assert problems(override) == lines


def test_layer_split_needs_one_entry_per_stage():
    assert problems("parallel.layer_split=[28]") == ["parallel.layer_split: has 1 entries for pp=2 stages"]


@pytest.mark.parametrize("split", ["[10,10]", "[0,28]"])
def test_layer_split_must_be_positive_and_sum_to_layers(split):
    shown = split.replace(",", ", ")
    assert problems(f"parallel.layer_split={split}") == [
        f"parallel.layer_split: {shown} must be positive and sum to model.num_layers=28"]


def test_a_run_needs_a_model():
    try:
        validate(configured("parallel=pp2_tp8"))
    except ConfigError as err:
        assert err.problems == ["model: no model selected"]
    else:
        pytest.fail("a config without a model validated")


@pytest.mark.parametrize("mode", ["search", "describe"])
def test_replay_search_needs_no_model(mode):
    """Searching (or describing) a recorded table needs no workload: hardware=replay with mode=search."""
    cfg = configured("parallel=pp2_tp8", "hardware=replay", f"mode={mode}")
    try:
        validate(cfg)
    except ConfigError as err:
        assert not [p for p in err.problems if p.startswith("model")]


def test_replay_outside_search_mode_still_needs_a_model():
    assert "model: no model selected" in problems("hardware=replay", "mode=run", base=("parallel=pp2_tp8",))


def test_nanobatch_partitioner_needs_two_nanobatches():
    """The nanobatch partitioner refuses other counts at run time; validate() must say so first."""
    assert compose_config(*BASE).partitioner.name == "nanobatch"
    got = problems("parallel.nanobatches=4")
    # named by the key it is about, not prefixed with the section whose rule it is
    assert "parallel.nanobatches: the nanobatch partitioner needs 2, got 4" in got, got


def test_sequential_partitioner_needs_one_or_two_nanobatches():
    """It raised a ValueError traceback when the workload was partitioned."""
    assert problems("partitioner=sequential", "parallel.nanobatches=4") == [
        "parallel.nanobatches: the sequential partitioner needs 1 or 2, got 4"]
    assert problems("partitioner=sequential", "parallel.nanobatches=1") == []


# ------------------------------------------------------------------------- registry-chosen sections


def test_a_component_switched_through_its_name_key_is_told_to_choose_the_option():
    got = problems("search.name=random")
    assert got == ["search: Key 'passes' not in 'RandomConfig'; search.name=random keeps the chosen search's other "
                   "settings: choose it with search=random instead"], got
    # a name no option file is called by: those whose name: it is (hardware=cuda does not exist)
    assert problems("hardware.name=cuda") == [
        "hardware: Key 'eff_gemm' not in 'CudaConfig'; hardware.name=cuda keeps the chosen hardware's other settings: "
        "choose it with one of hardware=a100_cuda, hardware=h100_cuda, hardware=h200_cuda instead"]


@pytest.mark.parametrize("value,says", [("${nope}", "Interpolation key 'nope' not found"),
                                        ("${oc.env:KAREUS_NO_SUCH_VARIABLE}", "")])
def test_an_interpolation_that_does_not_resolve_names_its_key(value, says):
    got = problems(f"parallel.tp={value}")
    assert len(got) == 1 and got[0].startswith("parallel.tp: ") and says in got[0], got


def test_unknown_component_name_lists_the_known_ones():
    assert problems("search.name=bogus") == [
        f"search.name: unknown searcher 'bogus'; known: {', '.join(SEARCHERS.names())}"]


def _hardware_lines(got: list[str], message: str) -> list[str]:
    """Lines of the hardware section ending in ``message`` (the section prefix may be "hardware: ")."""
    return [p for p in got if p.startswith("hardware") and p.endswith(message)]


def test_hardware_comm_sms_within_the_gpu(hw):
    got = problems("hardware.max_comm_sms=200")
    assert len(got) == 1 and _hardware_lines(got, f"hardware.max_comm_sms: must be in 1..{hw.sms - 1}, got 200"), got


def test_hardware_clock_range(hw):
    got = problems("hardware.min_mhz=1500")
    assert _hardware_lines(got, f"hardware.min_mhz: must satisfy 0 < min_mhz <= max_mhz, got 1500..{hw.max_mhz}"), got


def test_hardware_problems_are_reported_together():
    got = problems("hardware.sms=0", "hardware.step_mhz=0")
    assert _hardware_lines(got, "hardware.sms: must be > 0, got 0"), got
    assert _hardware_lines(got, "hardware.step_mhz: must be > 0, got 0"), got


# ---------------------------------------------------------------------------------------- search

SEARCH_RULES = [
    ("search.budget=0", "search.budget: must be > 0, got 0"),
    ("search.budget_frac=1.5", "search.budget_frac: must be in (0, 1], got 1.5"),
    ("search.budget_frac=0", "search.budget_frac: must be in (0, 1], got 0.0"),
    ("search.batch_size=0", "search.batch_size: must be > 0, got 0"),
    ("search.initial=0", "search.initial: must be > 0, got 0"),
    ("search.passes=[]", "search.passes: must name at least one pass; allowed: total, dynamic, static, uncertainty, fastest, spread, local, coverage"),
    ("search.passes=[total,total]", "search.passes: has duplicates, got ['total', 'total']"),
    ("search.shares.total=-0.1", "search.shares.total: must be >= 0, got -0.1"),
    # a negative share is the problem, not the sum of the chosen passes' shares it drags below 0
    ("search.shares.total=-1", "search.shares.total: must be >= 0, got -1.0"),
    ("search.surrogate.members=1", "search.surrogate.members: must be >= 2 (the spread is the uncertainty), got 1"),
    ("search.surrogate.max_depth=13", "search.surrogate.max_depth: must be in 1..12, got 13"),
    ("search.surrogate.threads=0", "search.surrogate.threads: must be > 0, got 0"),
    ("search.kappa=-1", "search.kappa: must be >= 0, got -1.0"),
    ("search.expected=[uncertainty]",
     "search.expected: ['uncertainty'] score no hypervolume; allowed: total, dynamic, static, local"),
    ("search.coverage_share=-1", "search.coverage_share: must be in [0, 1], got -1.0"),
    ("search.min_per_slot=-3", "search.min_per_slot: must be >= 0, got -3"),
    ("search.surrogate.clip_margin=-0.5", "search.surrogate.clip_margin: must be >= 0, got -0.5"),
    ("search.surrogate.learning_rate=-1", "search.surrogate.learning_rate: must be > 0, got -1.0"),
    ("search.surrogate.subsample=0", "search.surrogate.subsample: must be in (0, 1], got 0.0"),
    ("search.surrogate.min_child_weight=-1", "search.surrogate.min_child_weight: must be >= 0, got -1.0"),
    ("search.surrogate.name=foo", "search.surrogate.name: unknown surrogate 'foo'; known: xgboost"),
    # NaN passed every "< 0" check and searched worse, quietly
    ("search.kappa=nan", "search.kappa: must be a finite number >= 0, got nan"),
    ("search.ref_margin=inf", "search.ref_margin: must be a finite number >= 0, got inf"),
    ("search.shares.total=nan", "search.shares.total: must be a finite number >= 0, got nan"),
    ("search.surrogate.clip_margin=nan", "search.surrogate.clip_margin: must be a finite number >= 0, got nan"),
    # xgboost took a seed past 64 bits for a crash mid-search, numpy's and Optuna's past 32
    ("search.seed=4294967296", "search.seed: must be in 0..4294967295 (numpy's and Optuna's seeds are 32-bit), got "
                               "4294967296"),
]

PEER_RULES = [
    (("search=artifact", "search.members=0"), "search.members: must be >= 2 (the spread is the uncertainty), got 0"),
    (("search=nsga2", "search.population=1"), "search.population: must be >= 2 (parents to cross), got 1"),
    (("search=tpe", "search.max_asks_factor=0"), "search.max_asks_factor: must be >= 1, got 0"),
]


@pytest.mark.parametrize("overrides,line", PEER_RULES, ids=[o[0] for o, _ in PEER_RULES])
def test_peer_searcher_rule(overrides, line):
    assert problems(*overrides) == [line]


@pytest.mark.parametrize("field,bad,bound", [("static_power_w", -5, ">= 0"), ("tdp_w", 0, "> 0"),
                                             ("hbm_gbps", 0, "> 0"), ("nvlink_gbps", -1, "> 0"),
                                             ("peak_tflops", 0, "> 0")])
def test_impossible_datasheet_values_are_refused(field, bad, bound):
    got = problems(f"hardware.{field}={bad}")
    assert _hardware_lines(got, f"hardware.{field}: must be {bound}, got {float(bad)}"), got


SIM_RULES = [  # each passed validation and then turned the model around or divided by zero mid-search
    ("hardware.comm_clock_exp=-0.8", "hardware.comm_clock_exp: must be >= 0, got -0.8"),  # comm faster when slower
    ("hardware.comm_sharpness=0", "hardware.comm_sharpness: must be in [1, 16.0], got 0.0"),  # ZeroDivisionError
    ("hardware.vector_tflops=0", "hardware.vector_tflops: must be > 0, got 0.0"),
    ("hardware.act_gemm=-1", "hardware.act_gemm: must be >= 0, got -1.0"),  # negative dynamic power
    ("hardware.thermal_r_c_per_w=-0.09", "hardware.thermal_r_c_per_w: must be >= 0, got -0.09"),  # below ambient
    ("hardware.time_noise=5.0", "hardware.time_noise: must be in [0, 0.1], got 5.0"),  # negative times
    ("hardware.ambient_c=nan", "hardware.ambient_c: must be a finite temperature in C, got nan"),  # nan readings
    ("hardware.static_power_w=500", "hardware.static_power_w: must be below tdp_w (400.0), got 500.0"),
    ("hardware.min_mhz=200", "hardware.min_mhz/max_mhz: 200..1410 MHz is no whole number of step_mhz=15 steps; "
                             "a GPU locks max_mhz less whole steps"),
    ("hardware.max_mhz=1400", "hardware.min_mhz/max_mhz: 210..1400 MHz is no whole number of step_mhz=15 steps; "
                              "a GPU locks max_mhz less whole steps"),
]


@pytest.mark.parametrize("override", ["hardware.comm_clock_exp=0", "hardware.thermal_r_c_per_w=0"])
def test_a_simulator_without_a_response_is_no_problem(override):
    """0 is no clock dependence of the comm, no self-heating: neutral settings, not reversed ones."""
    assert problems(override) == []


@pytest.mark.parametrize("override,line", SIM_RULES, ids=[o for o, _ in SIM_RULES])
def test_simulator_parameters_that_turn_its_physics_around_are_refused(override, line):
    got = problems(override)
    assert len(got) == 1 and _hardware_lines(got, line), got


@pytest.mark.parametrize("override,line", SEARCH_RULES, ids=[o for o, _ in SEARCH_RULES])
def test_search_rule(override, line):
    assert problems(override) == [line]


def test_the_run_seed_is_a_32_bit_unsigned_number():
    # search.seed follows ${seed}: one bad value, one line (it was said for both keys)
    assert problems("seed=99999999999999999999") == [
        "seed: must be in 0..4294967295 (numpy's and Optuna's seeds are 32-bit), got 99999999999999999999"]
    assert problems("seed=4294967295") == []
    for peer in ("search=random", "search=tpe", "search=nsga2", "search=artifact"):  # every searcher's own seed
        assert problems(peer, "search.seed=-1") == [
            "search.seed: must be in 0..4294967295 (numpy's and Optuna's seeds are 32-bit), got -1"], peer


def test_search_shares_name_known_passes():
    assert problems("+search.shares.bogus=0.5") == [
        "search.shares: unknown pass(es) ['bogus']; allowed: "
        "total, dynamic, static, uncertainty, fastest, spread, local, coverage"]


def test_search_shares_of_chosen_passes_must_not_be_all_zero():
    assert problems("search.passes=[fastest]", "search.shares.fastest=0") == [
        "search.shares: the chosen passes' shares sum to 0"]


def test_initial_design_must_fit_a_counted_budget():
    """It was capped silently: every partition's budget went to the initial design, none was guided."""
    assert problems("search.budget=10", "search.initial=20") == [
        "search.initial: must be <= search.budget (10), as the initial design counts against it; got 20"]
    assert problems("search.budget=10", "search.initial=10") == []


@pytest.mark.parametrize("groups", [ALT1, ALT2], ids=["artifact", "random"])
def test_every_searcher_checks_its_budget(groups):
    assert problems(*groups, "search.budget=-3") == ["search.budget: must be > 0, got -3"]


def test_artifact_policy_shares():
    got = problems(*ALT1, "search.shares_total=1.0")
    assert [p for p in got if p.startswith("search") and p.endswith("sum to <= 1, got 1.4")], got
    assert not [p for p in got if p.startswith("search.search")], f"section named twice: {got}"


def test_artifact_policy_shares_must_be_numbers():
    """NaN passed the sum check and crashed the run after its initial design was profiled."""
    got = problems(*ALT1, "search.shares_total=nan")
    assert "search.shares_total: must be a finite number >= 0, got nan" in got, got


def test_qnehvi_checks_its_samples_and_its_optional_extra(monkeypatch):
    """Both stopped the run with a traceback, after its initial design was profiled or its folder made."""
    from kareus.search import qnehvi

    monkeypatch.setattr(qnehvi, "available", lambda: True)
    assert problems("search=qnehvi", "search.mc_samples=0") == ["search.mc_samples: must be >= 1, got 0"]
    monkeypatch.setattr(qnehvi, "available", lambda: False)
    assert problems("search=qnehvi") == [f"search: {qnehvi.MISSING}"]


# ------------------------------------------------------------------- search space against the GPU


def test_an_sms_list_beside_an_sms_range_is_refused():
    """The list won and the range was ignored (on a recorded table both filtered: the paths disagreed)."""
    assert problems("search.space.sms=[4,8]", "search.space.sms_min=10") == [
        "search.space.sms: an explicit list replaces the range, but sms_min is set too; give the list or the range"]
    assert problems("search.space.sms=[4,8]") == []


def test_space_sms_within_the_gpu(hw):
    assert problems("search.space.sms=[0,200]") == [
        f"search.space.sms: [0, 200] outside 1..{hw.max_comm_sms} for {hw.gpu} (hardware.max_comm_sms)"]


def test_space_sms_are_checked_against_the_chosen_gpu(hw):
    assert problems("hardware.max_comm_sms=40", "search.space.sms=[8,40,48]") == [
        f"search.space.sms: [48] outside 1..40 for {hw.gpu} (hardware.max_comm_sms)"]


def test_comm_sms_above_what_the_comm_library_runs_are_refused(hw):
    """NCCL caps a communicator's CTAs at 32 channels: 48 or 64 SMs ran the 32-CTA kernel, recorded and
    planned as 48 or 64. The search space stays within hardware.max_comm_sms."""
    assert hw.max_comm_sms == 32 < hw.sms - 1
    assert problems("search.space.sms=[16,48,64]") == [
        f"search.space.sms: [48, 64] outside 1..32 for {hw.gpu} (hardware.max_comm_sms)"]
    assert problems("search.space.sms_min=8", "search.space.sms_max=64", "search.space.sms_step=8") == [
        f"search.space.sms_max: must be within 1..32 for {hw.gpu} (hardware.max_comm_sms), got 64"]


def test_an_sm_range_outside_the_gpu_names_the_end_that_is_out(hw):
    """It named search.space.sms and printed every count of the range."""
    assert problems("search.space.sms_max=200") == [f"search.space.sms_max: must be within 1..{hw.max_comm_sms} "
                                                    f"for {hw.gpu} (hardware.max_comm_sms), got 200"]
    assert problems("search.space.sms_min=0", "search.space.sms_max=4") == [
        f"search.space.sms_min: must be within 1..{hw.max_comm_sms} for {hw.gpu} (hardware.max_comm_sms), got 0"]


def test_a_bad_sm_count_is_one_line_not_two():
    assert problems("hardware.sms=0") == ["hardware.sms: must be > 0, got 0"]


def test_space_needs_sm_counts():
    # a reversed range says so, with the defaults filled in, as a reversed clock range does
    assert problems("search.space.sms_min=10", "search.space.sms_max=4") == ["search.space: sms_min 10 > sms_max 4"]
    assert problems("search.space.sms_min=20") == ["search.space: sms_min 20 > sms_max 16"]
    assert problems("search.space.sms=[]") == [
        "search.space: no SM counts (check sms / sms_min / sms_max / sms_step)"]


def test_a_recorded_space_is_filtered_by_its_explicit_bounds_alone(tmp_path):
    """A replayed table holds 1..20 SMs; sms_min=18 was refused against the default sms_max of 16,
    which never thins a recorded table."""
    table = tmp_path / "table.csv"
    table.write_text("partition,slot,sms,freq_mhz,time_s,energy_j\n"
                     + "".join(f"p,sequential,{s},1410,0.003,1.0\n" for s in (16, 18, 20)))
    replay = ("parallel=pp2_tp8", "hardware=replay", f"hardware.table={table}", "mode=search")
    assert problems("search.space.sms_min=18", base=replay) == []
    assert problems("search.space.sms_min=18", "search.space.sms_max=16", base=replay) == [
        "search.space: sms_min 18 > sms_max 16"]


@pytest.mark.parametrize("step", [0, -2])
def test_space_sm_step_must_be_positive(step):
    assert f"search.space.sms_step: must be > 0, got {step}" in problems(f"search.space.sms_step={step}")


def test_space_clock_step_on_the_gpu_grid(hw):
    assert problems("search.space.freq_mhz.step=20") == [
        f"search.space.freq_mhz.step: must be a positive multiple of {hw.gpu}'s {hw.step_mhz} MHz step, got 20"]


def test_space_clocks_within_gpu_range(hw):
    assert problems("search.space.freq_mhz.min=100") == [
        f"search.space.freq_mhz.min: must be within {hw.gpu}'s {hw.min_mhz}..{hw.max_mhz} MHz, got 100"]
    assert problems("search.space.freq_mhz.max=1500") == [
        f"search.space.freq_mhz.max: {hw.gpu} has no locked clock 1500 MHz "
        f"({hw.min_mhz}..{hw.max_mhz} in {hw.step_mhz} MHz steps)"]


def test_space_clock_min_not_above_max():
    assert problems("search.space.freq_mhz.min=1200", "search.space.freq_mhz.max=900") == [
        "search.space.freq_mhz: min 1200 > max 900"]


def test_space_min_frac_in_unit_interval():
    assert problems("search.space.freq_mhz.min_frac=0") == ["search.space.freq_mhz.min_frac: must be in (0, 1], got 0.0"]


def test_space_needs_a_clock():
    assert problems("search.space.freq_mhz.max=300") == [
        "search.space.freq_mhz: no clock from 846 MHz (min_frac 0.6 x 1410) up to 300 MHz (max) in 60 MHz steps; "
        "lower search.space.freq_mhz.min (>= 210) or raise its max"]


def test_space_top_clock_must_be_a_supported_clock(hw):
    """Clocks are counted down from freq_mhz.max, so an off-grid max makes every searched clock unsupported."""
    off_grid = hw.max_mhz - hw.step_mhz // 2 - 1 if hw.step_mhz > 2 else None
    if off_grid is None:
        pytest.skip("the GPU's clock step has no off-grid values")
    assert problems(f"search.space.freq_mhz.max={hw.max_mhz - hw.step_mhz}") == []
    assert problems(f"search.space.freq_mhz.max={off_grid}") == [
        f"search.space.freq_mhz.max: {hw.gpu} has no locked clock {off_grid} MHz "
        f"({hw.min_mhz}..{hw.max_mhz} in {hw.step_mhz} MHz steps)"]


# -------------------------------------------------------------------------------------- profiler

PROFILER_RULES = [
    ("profiler.target_window_s=0 profiler.min_window_s=0", "profiler.target_window_s: must be > 0, got 0.0"),
    ("profiler.min_window_s=-1", "profiler.min_window_s: must be >= 0, got -1.0"),
    ("profiler.min_window_s=6", "profiler.min_window_s=6.0 exceeds target_window_s=5.0"),
    ("profiler.settle_s=-1", "profiler.settle_s: must be >= 0, got -1.0"),
    ("profiler.warmup_runs=-1", "profiler.warmup_runs: must be >= 0, got -1"),
    ("profiler.calibration_runs=0", "profiler.calibration_runs: must be >= 1, got 0"),
    ("profiler.max_executions=0", "profiler.max_executions: must be >= 1, got 0"),
    ("profiler.repeats=0", "profiler.repeats: must be >= 1, got 0"),
    ("profiler.retries=-1", "profiler.retries: must be >= 0, got -1"),
    ("profiler.mad_threshold=0", "profiler.mad_threshold: must be > 0, got 0.0"),
    # infinity passed every bound: a window of inf overflowed the search, a settle of inf never ended
    ("profiler.target_window_s=inf", "profiler.target_window_s: must be a finite number > 0, got inf"),
    ("profiler.settle_s=inf", "profiler.settle_s: must be a finite number >= 0, got inf"),
]


@pytest.mark.parametrize("override,line", PROFILER_RULES, ids=[o for o, _ in PROFILER_RULES])
def test_profiler_rule(override, line):
    assert problems(*override.split()) == [line]


@pytest.mark.parametrize("groups,override,line", [
    ((), "profiler.cooldown.seconds=-1", "profiler.cooldown.seconds: must be >= 0, got -1.0"),  # fixed
    ((), "profiler.cooldown.seconds=inf", "profiler.cooldown.seconds: must be a finite number >= 0, got inf"),
    (ALT1, "profiler.cooldown.poll_s=0", "profiler.cooldown.poll_s: must be > 0, got 0.0"),  # temperature
    (ALT2, "profiler.cooldown.delta_c=0", "profiler.cooldown.delta_c: must be > 0, got 0.0"),  # predictive
    # a clock the GPU cannot lock: every anchor failed, and the policy dropped its correction silently
    (("profiler/cooldown=thermal",), "profiler.cooldown.reference_mhz=1407",
     "profiler.cooldown.reference_mhz: A100-SXM4-40GB has no locked clock 1407 MHz (210..1410 in 15 MHz steps)"),
    (("profiler/cooldown=compensated",), "profiler.cooldown.probe_clocks=[1410,1001]",
     "profiler.cooldown.probe_clocks: A100-SXM4-40GB has no locked clock 1001 MHz (210..1410 in 15 MHz steps)"),
    # policies that would silently neither cool nor correct: spent before the first anchor, or windows
    # the energy counter cannot resolve
    (("profiler/cooldown=thermal",), "profiler.cooldown.max_failed_anchors=0",
     "profiler.cooldown.max_failed_anchors: must be >= 1, got 0"),
    # nan passed every comparison: the probe ran in full and corrected nothing, anchoring stopped
    (("profiler/cooldown=compensated",), "profiler.cooldown.min_span_c=nan",
     "profiler.cooldown.min_span_c: must be a finite number >= 0, got nan"),
    (("profiler/cooldown=thermal",), "profiler.cooldown.growth=nan",
     "profiler.cooldown.growth: must be a finite number >= 1, got nan"),
    (("profiler/cooldown=thermal",), "profiler.cooldown.noise_floor=inf",
     "profiler.cooldown.noise_floor: must be a finite number > 0, got inf"),
    (("profiler/cooldown=thermal",), "profiler.cooldown.anchor_window_s=0.05",
     "profiler.cooldown.anchor_window_s=0.05 is shorter than profiler.min_window_s=0.5; allowed: at least 0.5 s"),
    (("profiler/cooldown=compensated",), "profiler.cooldown.probe_window_s=0.3",
     "profiler.cooldown.probe_window_s=0.3 is shorter than profiler.min_window_s=0.5; allowed: at least 0.5 s"),
], ids=["fixed", "fixed-inf", "temperature", "predictive", "thermal-off-grid", "compensated-off-grid",
        "thermal-spent", "compensated-nan-span", "thermal-nan-growth", "thermal-inf-floor", "thermal-short-anchor",
        "compensated-short-probe"])
def test_cooldown_rule(groups, override, line):
    assert problems(*groups, override) == [line]


def test_frequency_controller_must_be_known():
    assert problems("profiler.frequency.name=bogus") == [
        f"profiler.frequency.name='bogus' is unknown; known: {', '.join(FREQUENCY_CONTROLLERS.names())}"]


# --------------------------------------------------------------------------------- plan and compose


@pytest.mark.parametrize("overrides,line", [
    (("plan.deadline_s=-1",), "plan.deadline_s: must be positive seconds, got -1.0"),
    (("plan.energy_budget_j=0",), "plan.energy_budget_j: must be positive joules, got 0.0"),
    (("plan.deadline_s=inf",), "plan.deadline_s: must be positive seconds, got inf"),  # no deadline: leave it unset
    (("plan.deadline_s=2", "plan.energy_budget_j=5000"),
     "plan.deadline_s and plan.energy_budget_j are exclusive: set at most one"),
])
def test_plan_rule(overrides, line):
    assert problems(*overrides) == [line]


@pytest.mark.parametrize("overrides,line", [
    (("compose.num_deadlines=1",), "compose.num_deadlines: must be >= 2, got 1"),  # kareus
    (("compose.repair_passes=-1",), "compose.repair_passes: must be >= 0, got -1"),
    ((*ALT1, "compose.unit_time_s=0"), "compose.unit_time_s: must be > 0, got 0.0"),  # perseus
    ((*ALT1, "compose.unit_time_s=nan"), "compose.unit_time_s: must be a finite number > 0, got nan"),  # after the search
    ((*ALT1, "compose.cost_model=bogus"), "compose.cost_model: invalid value 'bogus'; allowed: hull, exponential"),
    ((*ALT1, "compose.max_steps=-1"), "compose.max_steps: must be >= 0, got -1"),
])
def test_compose_rule(overrides, line):
    assert problems(*overrides) == [line]


@pytest.mark.parametrize("overrides,line", [
    ((*ALT1, "launcher.workers=-1"), "launcher.workers: must be >= 0, got -1"),  # process
    ((*ALT1, "launcher.start_method=bogus"), "launcher.start_method: invalid value 'bogus'; allowed: spawn, forkserver, fork"),
    ((*ALT2, "launcher.gpus_per_task=-1"), "launcher.gpus_per_task: must be >= 0, got -1.0"),  # ray
    ((*ALT2, "launcher.cpus_per_task=-1"), "launcher.cpus_per_task: must be >= 0, got -1.0"),
])
def test_launcher_rule(overrides, line):
    assert problems(*overrides) == [line]


# ------------------------------------------------------------------------------------ all at once


def test_every_problem_is_reported_together(hw):
    got = problems("parallel.tp=3", "parallel.nanobatches=3", "search.budget=0",
                   "search.space.sms=[500]", "profiler.repeats=0", "plan.deadline_s=-1",
                   "compose.num_deadlines=1")
    expected = [
        "parallel.micro_batch_size: 8 does not split into parallel.nanobatches=3 equal nanobatches",
        "parallel.nanobatches: the nanobatch partitioner needs 2, got 3",
        "parallel.tp: 3 does not divide model.num_attention_heads=16",
        "parallel.tp: 3 does not divide model.num_kv_heads=8",
        "parallel.tp: tp*cp=3 does not divide a node's 8 GPUs (hardware.gpus_per_node): a tensor/context-parallel "
        "group would span two nodes",
        "search.budget: must be > 0, got 0",
        f"search.space.sms: [500] outside 1..{hw.max_comm_sms} for {hw.gpu} (hardware.max_comm_sms)",
        "profiler.repeats: must be >= 1, got 0",
        "plan.deadline_s: must be positive seconds, got -1.0",
        "compose.num_deadlines: must be >= 2, got 1",
    ]
    assert sorted(got) == sorted(expected)
    assert str(ConfigError(got)).splitlines() == got


# -------------------------------------------------------------------- what composition lets through


@pytest.mark.parametrize("override,key", [("+search.pases=[total]", "search.pases"),
                                          ("+parallel.ttp=2", "parallel.ttp")])
def test_appended_unknown_key_is_a_problem(override, key):
    """``+key=value`` bypasses the schema's struct flag at composition; validate() must still refuse it."""
    got = problems(override)
    assert [p for p in got if p.startswith(key)], got


def test_user_model_with_missing_keys_is_reported_not_raised(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "half.yaml").write_text("name: half\nnum_layers: 4\nhidden_size: 512\n")
    cfg = compose_config(f"hydra.searchpath=[file://{tmp_path}]", "+model=half", "parallel=pp2_tp2")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    got = info.value.problems
    for key in ("ffn_hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size"):
        assert [p for p in got if p.startswith(f"model.{key}")], got



def test_exhaustive_refuses_a_budget_it_would_ignore():
    """search=exhaustive profiles every candidate: a budget beside it would be reported (progress bar,
    MLflow) but not kept, so it is refused; its own default (the whole space) passes."""
    assert problems("search=exhaustive") == []
    assert problems("search=exhaustive", "search.budget=10") == [
        "search.budget: search=exhaustive profiles every candidate, so it takes no budget (got 10); drop it, "
        "or pick a searcher that uses one"]
    assert problems("search=exhaustive", "search.budget_frac=0.5") == [
        "search.budget_frac: search=exhaustive profiles the whole space (1.0), got 0.5"]


def test_a_rule_that_cannot_run_is_one_line_under_its_section(monkeypatch):
    """It read 'hardware.cannot be checked: ...', the section glued to the words as if they were a key."""
    from kareus.profiler.config import ProfilerConfig

    def broken(self, ctx=None):
        raise RuntimeError("the rule tripped\nover something")

    monkeypatch.setattr(ProfilerConfig, "problems", broken)
    assert problems() == ["profiler: cannot be checked: the rule tripped"]
