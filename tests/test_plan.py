"""Execution plans: construction, YAML round trip and validation, selection rules, event simulation."""
from __future__ import annotations

import csv
import dataclasses
import re

import pytest

from kareus.compose import (
    IterationFrontier, KareusComposer, KareusComposerConfig, fixed_option_iteration, pipeline_dag,
)
from kareus.compose.microbatch import InstructionOption
from kareus.compose.synthetic import synthetic_options
from kareus.plan import (
    PlanConfig, PlanFormatError, PlanSelectionError, SelectRule, frontier_table, load_plan, make_plans,
    plan_energy, save_plan, select_plan, simulate_plan, write_run_outputs,
)
from kareus.plan.model import MadeFor
from kareus.types import Candidate, Direction, InstructionWork, ModelSpec, ParallelSpec, Partitioning

F, B = Direction.FWD, Direction.BWD
S, M = 3, 5
MADE_FOR = MadeFor.of(ModelSpec("tiny", 6, 512, 1536, 8, 4, 64, 32000),
                      ParallelSpec(tp=2, pp=S, micro_batch_size=4, num_microbatches=M, seq_len=2048))


def _with_choices(options):
    """Give every option a partition configuration so plans carry slots and SMs."""
    out = {}
    for key, opts in options.items():
        name = f"{key[1].value}_attn"
        out[key] = [InstructionOption(o.time_s, o.dynamic_energy_j, o.freq_mhz,
                                      {name: Candidate(name, "linear_1" if j % 2 else "sequential", 8 + 4 * (j % 3),
                                                       o.freq_mhz)})
                    for j, o in enumerate(opts)]
    return out


@pytest.fixture(scope="module")
def frontier():
    dag = pipeline_dag("1f1b", S, M)
    opts = _with_choices(synthetic_options(S, seed=3))
    return KareusComposer(KareusComposerConfig(num_deadlines=12)).compose(dag, opts, 75.0, 4, S)


@pytest.fixture(scope="module")
def plans(frontier):
    part = Partitioning(types=(), work=tuple(InstructionWork(s, d, ((f"{d.value}_attn", 7),))
                                             for s in range(S) for d in (F, B)))
    return make_plans(frontier, part, config_hash="abc123", hardware="sim:a100", made_for=MADE_FOR)


def test_one_plan_per_frontier_point_with_predictions(frontier, plans):
    assert len(plans) == len(frontier) > 3
    for p, point in zip(plans, frontier):
        assert (p.predicted_time_s, p.predicted_energy_j) == (point.time_s, point.energy_j)
        assert p.config_hash == "abc123" and p.hardware == "sim:a100" and p.schema_version == 3 and p.made_for == MADE_FOR
        for s in range(S):
            for d in (F, B):
                covered = sorted(m for ins in p.stages[s].instructions if ins.direction == d.value
                                 for m in ins.microbatches)
                assert covered == list(range(M))  # every microbatch exactly once
        ins = p.instruction(1, 2, B)
        assert ins.partitions[0].partition == "bwd_attn" and ins.partitions[0].count == 7
        for outside in ((-1, 0, F), (S, 0, F), (0, M, F)):  # a stage index of -1 is not the last stage
            with pytest.raises(KeyError):
                p.instruction(*outside)
    # Perseus-style savings: some plan runs one (stage, direction) at different clocks per microbatch
    assert any(len({i.freq_mhz for i in st.instructions if i.direction == "fwd"}) > 1
               for p in plans for st in p.stages)


def test_plan_ids_depend_on_the_frontier_alone(frontier, plans):
    """A plan's id names what it runs: the same frontier gives the same ids however its points were
    found, and a plan another run's frontier holds too keeps its id there, though a point more or less
    (a deadline asked for adds solves) shifts every position after it."""
    ids = [p.id for p in plans]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"[0-9a-f]{8}", i) for i in ids)
    found = frontier.assignments()
    again = IterationFrontier.from_assignments(found[::-1] + found[:3], frontier.model, frontier.composer)
    assert [p.id for p in make_plans(again, config_hash="other", hardware="sim:h100")] == ids
    fewer = IterationFrontier.from_assignments(found[1:], frontier.model, frontier.composer)
    assert [p.id for p in make_plans(fewer, config_hash="abc123", hardware="sim:a100")] == ids[1:]
    # neither the predicted numbers nor how a plan groups its microbatches name it
    p = plans[-1]
    one_by_one = tuple(dataclasses.replace(st, instructions=tuple(
        dataclasses.replace(ins, microbatches=(m,), time_s=ins.time_s * 2) for ins in st.instructions
        for m in ins.microbatches)) for st in p.stages)
    assert dataclasses.replace(p, stages=one_by_one, index=99, predicted_time_s=1.0).id == p.id
    # another clock for one instruction is another plan
    st = p.stages[0]
    moved = dataclasses.replace(st, instructions=(dataclasses.replace(st.instructions[0], freq_mhz=1),
                                                  *st.instructions[1:]))
    assert dataclasses.replace(p, stages=(moved, *p.stages[1:])).id != p.id


def test_two_plans_under_one_id_are_refused_not_written_over_each_other(tmp_path, plans):
    from kareus.errors import KareusError

    a, b = (dataclasses.replace(p) for p in plans[:2])
    a.__dict__["id"] = b.__dict__["id"] = "deadbeef"  # a hash collision, forced
    with pytest.raises(KareusError, match="share the id deadbeef"):
        write_run_outputs(tmp_path, [a, b])


def test_plan_time_equals_event_simulation_and_energy_matches(plans):
    """Independent event simulation (stage queues + hand-off rules), not the composer's DAG sweep."""
    for p in plans:
        sim = simulate_plan(p)
        assert sim.time_s == pytest.approx(p.predicted_time_s, rel=1e-12)
        assert plan_energy(p, sim.time_s) == pytest.approx(p.predicted_energy_j, rel=1e-12)
        # 1F1B order on stage 0: forwards of the warm-up precede the first backward
        assert sim.start[(0, S - 1, "fwd")] < sim.start[(0, 0, "bwd")]


def test_clock_switches_are_priced_and_the_event_simulation_agrees():
    """With hardware.clock_switch_s, an instruction whose clock differs from its stage's previous one
    (the stage's last, for its first) starts that much later: the composer's exact pricing and the
    independent event simulation agree on every plan, and switching plans pay for it."""
    dag = pipeline_dag("1f1b", S, M)
    opts = _with_choices(synthetic_options(S, seed=3))
    switch_s = 0.002
    free = KareusComposer(KareusComposerConfig(num_deadlines=12)).compose(dag, opts, 75.0, 4, S)
    priced = KareusComposer(KareusComposerConfig(num_deadlines=12)).compose(dag, opts, 75.0, 4, S,
                                                                           clock_switch_s=switch_s)
    part = Partitioning(types=(), work=())
    plans = make_plans(priced, part, config_hash="h", hardware="sim")
    assert any(p.switches for p in plans) and all(p.clock_switch_s == switch_s for p in plans)
    for p in plans:
        assert simulate_plan(p).time_s == pytest.approx(p.predicted_time_s, rel=1e-12)
        assert plan_energy(p, p.predicted_time_s) == pytest.approx(p.predicted_energy_j, rel=1e-12)
    for a in free.assignments():  # the same assignment: no dearer without switches, dearer with them
        again = priced.model.assess(a.choice)
        n = int(priced.model.switches(a.choice).sum())
        assert a.time_s <= again.time_s <= a.time_s + n * switch_s + 1e-12
        if n == 0:
            assert (again.time_s, again.energy_j) == (a.time_s, a.energy_j)


def test_switches_count_clock_changes_in_each_stages_order():
    """Forwards at one clock, backwards at another: on each 1F1B stage a switch precedes the first
    backward and, iterations repeating, the first forward; the steady state alternates F and B."""
    from kareus.compose import CostModel

    dag = pipeline_dag("1f1b", 2, 3)
    opts = {(s, d): [InstructionOption(0.01, 1.0, 1410 if d is F else 1200, {})] for s in range(2) for d in (F, B)}
    model = CostModel(dag, opts, 75.0, 1, 2, clock_switch_s=0.001)
    choice = (0,) * len(dag)
    # stage 0 runs F0 F1 B0 F2 B1 B2 (4 changes, the cyclic one B2 -> F0 included); stage 1 alternates
    # F B F B F B (6 changes)
    assert int(model.switches(choice).sum()) == 10
    plan = make_plans(IterationFrontier.from_assignments([model.assess(choice)], model, "kareus"),
                      config_hash="h", hardware="sim")[0]
    assert plan.switches == 10 and [st.switches(plan) for st in plan.stages] == [4, 6]
    free = CostModel(dag, opts, 75.0, 1, 2).assess(choice)
    assert model.assess(choice).time_s > free.time_s
    assert simulate_plan(plan).time_s == pytest.approx(model.assess(choice).time_s, rel=1e-12)


def test_event_simulation_uses_the_given_durations(plans):
    p = plans[0]
    slow = simulate_plan(p, duration=lambda ins, mb: ins.time_s * 2)
    assert slow.time_s == pytest.approx(2 * p.predicted_time_s)


def _without_made_for(text: str) -> str:
    return re.sub(r"made_for:\n(?: .*\n)+", "", text)


def test_round_trip(tmp_path, plans):
    for p in plans[:3]:
        path = save_plan(p, tmp_path / f"p{p.index}.yaml")
        assert load_plan(path) == p


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.replace("schema_version: 3", "schema_version: 99"), "schema_version 99"),
    (lambda t: t.replace("hardware: sim:a100", "hardware: sim:a100\nextra: 1"), "unknown key"),
    (lambda t: t.replace("num_stages: 3", "num_stages: three"), "num_stages: expected an integer"),
    (lambda t: t.replace("config_hash: abc123\n", ""), "missing key 'config_hash'"),
    (lambda t: t.replace("direction: fwd", "direction: sideways", 1), "is not fwd or bwd"),
    (lambda t: t + "\n: [unclosed", "not valid YAML"),
    (lambda t: "!!python/object/apply:os.system ['echo hacked']\n", "not valid YAML"),
    (lambda t: "- just\n- a list\n", "expected a mapping"),
    (lambda t: t.replace("clock_switch_s: 0.0\n", ""), "missing key 'clock_switch_s'"),  # a version 2 plan prices them
    (lambda t: t.replace("clock_switch_s: 0.0", "clock_switch_s: -0.001"), r"clock_switch_s: must be >= 0"),
    (lambda t: t.replace("schedule: 1f1b", "schedule: bogus"), "'bogus' is not a schedule; allowed: 1f1b"),
    (lambda t: t.replace("schema_version: 3", "schema_version: true"), "schema_version True is not supported"),
    (_without_made_for, "missing key 'made_for'"),  # a version 3 plan names its layout
    (lambda t: t.replace("{tp: 2,", "{tp: two,"), r"made_for.parallel.tp: expected an integer"),
    (lambda t: t.replace("sequence_parallel: false", "sequence_parallel: 0"), r"sequence_parallel: expected true or false"),
    (lambda t: t.replace("gpus_per_stage: 4", "gpus_per_stage: 0"), r"gpus_per_stage: must be >= 1"),
    (lambda t: t.replace("index: 0", "index: -5"), r"index: must be >= 0"),
    (lambda t: re.sub(r"predicted_time_s: .*", "predicted_time_s: 0.0", t), "predicted_time_s: must be positive"),
    (lambda t: re.sub(r"(    partitions:\n)(    - .*\n)", r"\1\2\2", t, count=1), "is listed twice"),
    (lambda t: re.sub(r"    partitions:\n    - .*\n", "", t, count=1), "missing key 'partitions'"),
])
def test_bad_plan_files_fail_clearly(tmp_path, plans, mutate, match):
    path = save_plan(plans[0], tmp_path / "p.yaml")
    path.write_text(mutate(path.read_text()))
    with pytest.raises(PlanFormatError, match=match):
        load_plan(path)


def test_a_version_1_plan_file_loads_with_its_switches_unpriced(tmp_path, plans):
    """Plans written before clock_switch_s (schema_version 1) still load, as plans whose predicted
    time prices no switch and that name no layout; a version 1 file with a newer key is refused."""
    path = save_plan(plans[0], tmp_path / "p.yaml")
    text = path.read_text()
    assert "schema_version: 3" in text and "clock_switch_s: 0.0" in text
    old = _without_made_for(text.replace("schema_version: 3", "schema_version: 1").replace("clock_switch_s: 0.0\n", ""))
    path.write_text(old)
    loaded = load_plan(path)
    assert loaded == dataclasses.replace(plans[0], made_for=None) and loaded.schema_version == 3
    assert loaded.clock_switch_s == 0.0
    assert load_plan(save_plan(loaded, tmp_path / "again.yaml")) == loaded  # saved again, it reads back
    path.write_text(text.replace("schema_version: 3", "schema_version: 1"))
    with pytest.raises(PlanFormatError, match="schema_version 1 has none"):
        load_plan(path)


def test_a_version_2_plan_loads_without_a_layout(tmp_path, plans):
    """Plans written before made_for (schema_version 2) load with none: executors refuse them."""
    path = save_plan(plans[0], tmp_path / "p.yaml")
    text = path.read_text().replace("schema_version: 3", "schema_version: 2")
    path.write_text(_without_made_for(text))
    assert load_plan(path).made_for is None
    path.write_text(text)
    with pytest.raises(PlanFormatError, match="schema_version 2 has none"):
        load_plan(path)


def test_missing_file_is_a_plan_error(tmp_path):
    with pytest.raises(PlanFormatError, match="cannot read"):
        load_plan(tmp_path / "absent.yaml")


def test_a_binary_file_is_a_plan_error(tmp_path):
    (tmp_path / "bad.yaml").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(PlanFormatError, match=r"bad.yaml: not UTF-8 text \(byte 0xff at 0\)"):
        load_plan(tmp_path / "bad.yaml")


def test_selection_rules(plans):
    fastest = min(plans, key=lambda p: p.predicted_time_s)
    cheapest = min(plans, key=lambda p: p.predicted_energy_j)
    assert select_plan(plans) is fastest
    assert select_plan(plans, PlanConfig(select=SelectRule.max_throughput)) is fastest
    assert select_plan(plans, PlanConfig(select=SelectRule.min_energy)) is cheapest
    mid = plans[len(plans) // 2]
    got = select_plan(plans, PlanConfig(deadline_s=mid.predicted_time_s))
    assert got.predicted_time_s <= mid.predicted_time_s
    assert got.predicted_energy_j == min(p.predicted_energy_j for p in plans
                                         if p.predicted_time_s <= mid.predicted_time_s)
    got = select_plan(plans, PlanConfig(energy_budget_j=mid.predicted_energy_j))
    assert got.predicted_energy_j <= mid.predicted_energy_j
    assert got.predicted_time_s == min(p.predicted_time_s for p in plans
                                       if p.predicted_energy_j <= mid.predicted_energy_j)
    # a generous deadline buys the cheapest plan, a generous budget the fastest
    assert select_plan(plans, PlanConfig(deadline_s=1e9)) is cheapest
    assert select_plan(plans, PlanConfig(energy_budget_j=1e12)) is fastest


def test_infeasible_requests_say_how_far_off(plans):
    fastest = min(p.predicted_time_s for p in plans)
    with pytest.raises(PlanSelectionError) as e:
        select_plan(plans, PlanConfig(deadline_s=fastest * 0.9))
    msg = str(e.value)
    assert "\n" not in msg and "fastest plan takes" in msg and f"{fastest - fastest * 0.9:.4g} s" in msg
    least = min(p.predicted_energy_j for p in plans)
    with pytest.raises(PlanSelectionError) as e:
        select_plan(plans, PlanConfig(energy_budget_j=least * 0.5))
    assert "least-energy plan uses" in str(e.value) and "(100.00%) over" in str(e.value)
    # a deadline copied from the table's 4 decimals: the plan's exact time shows what it misses by
    deadline = fastest - 4e-5 * fastest
    with pytest.raises(PlanSelectionError) as e:
        select_plan(plans, PlanConfig(deadline_s=deadline))
    assert f"{fastest!r} s per iteration" in str(e.value) and "(0.004%) over" in str(e.value)
    assert f"plan.deadline_s={deadline!r} s" in str(e.value)  # never rounded past the plan that misses it
    least_by_a_hair = least * (1 - 1e-8)
    with pytest.raises(PlanSelectionError) as e:
        select_plan(plans, PlanConfig(energy_budget_j=least_by_a_hair))
    assert f"plan.energy_budget_j={least_by_a_hair!r} J: the least-energy plan uses {least!r} J" in str(e.value)
    with pytest.raises(PlanSelectionError, match="no execution plans"):
        select_plan([], PlanConfig())
    with pytest.raises(PlanSelectionError, match="exclusive"):
        select_plan(plans, PlanConfig(deadline_s=1.0, energy_budget_j=1.0))


def test_run_outputs_replace_an_earlier_runs_plans(tmp_path, plans):
    """A rerun into the same folder with fewer plans, or none selected, leaves no old plan to be taken
    for its own."""
    write_run_outputs(tmp_path, plans, plans[0])
    (tmp_path / "plans" / "notes.txt").write_text("the user's")
    write_run_outputs(tmp_path, plans[:2], None)
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == sorted(
        ["notes.txt", f"plan_{plans[0].id}.yaml", f"plan_{plans[1].id}.yaml"])
    assert not (tmp_path / "plan_selected.yaml").exists()


def test_plan_config_problems():
    assert PlanConfig().problems() == []
    assert any("positive" in p for p in PlanConfig(deadline_s=0.0).problems())
    assert any("positive" in p for p in PlanConfig(energy_budget_j=-1.0).problems())
    assert len(PlanConfig(deadline_s=-1.0, energy_budget_j=-2.0).problems()) == 3


def test_run_outputs_and_table(tmp_path, frontier, plans):
    dag = frontier.dag
    top = {k: max(v, key=lambda o: o.freq_mhz) for k, v in frontier.options.items()}
    ref = fixed_option_iteration(dag, top, 75.0, 4, S)
    chosen = select_plan(plans, PlanConfig(select=SelectRule.min_energy))
    out = write_run_outputs(tmp_path, plans, chosen, ref)
    rows = out["frontier_iteration"].read_text().strip().splitlines()
    assert rows[0].startswith("plan,time_s,energy_j") and rows[1].startswith("megatron_reference")
    assert len(rows) == len(plans) + 2
    assert len(list((tmp_path / "plans").glob("plan_*.yaml"))) == len(plans)
    assert load_plan(tmp_path / "plan_selected.yaml") == chosen
    # a row's time or energy copied into plan.deadline_s / plan.energy_budget_j selects that row's plan
    for row, plan in zip(csv.DictReader(rows[:1] + rows[2:]), plans):
        assert float(row["time_s"]) == plan.predicted_time_s and float(row["energy_j"]) == plan.predicted_energy_j
        assert select_plan(plans, PlanConfig(deadline_s=float(row["time_s"]))).predicted_energy_j <= \
            plan.predicted_energy_j
        assert select_plan(plans, PlanConfig(energy_budget_j=float(row["energy_j"]))).predicted_time_s <= \
            plan.predicted_time_s
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(frontier_table(plans, ref, chosen, max_rows=6))
    text = console.export_text()
    assert "Megatron" in text and "selected" in text and "%" in text
    shown = frontier_table(plans, ref, chosen, max_rows=6)
    assert shown.caption == f"showing {shown.row_count - 1} of {len(plans)} plans (all in frontier_iteration.csv)"
    assert f"energy per iteration, all {S * plans[0].gpus_per_stage} GPUs" in str(shown.title)


def test_plan_schema_is_registered_for_hydra():
    from kareus.config.store import _EXTRA

    assert _EXTRA[("plan", "default")] is PlanConfig


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["stages"][0]["instructions"][0]["microbatches"].append(0), r"repeated \[0\]"),
    (lambda d: d["stages"][0]["instructions"][0]["microbatches"].clear(), "missing"),
    (lambda d: d.update(num_microbatches=10**12), rf"must be 0\.\.999999999999 once each; {10**12 - M} missing"),
    (lambda d: d["stages"][0]["instructions"][0]["microbatches"].append(-1), r"unknown \[-1\]"),
    (lambda d: d["stages"][0]["instructions"][0].update(stage=1), "inside stage 0"),
    (lambda d: d["stages"][0]["instructions"][0].update(time_s=-0.5), "must be positive"),
    (lambda d: d["stages"][0]["instructions"][0]["partitions"][0].update(sms=0), "sms must be >= 1"),
])
def test_plans_must_cover_each_instruction_once(plans, mutate, match):
    """An executor needs exactly one setting per instruction it runs: never two, never none."""
    from kareus.plan import plan_from_dict, plan_to_dict

    data = plan_to_dict(plans[0])  # fresh lists and dicts
    mutate(data)
    with pytest.raises(PlanFormatError, match=match):
        plan_from_dict(data)


def test_a_one_row_frontier_table_shows_one_plan(plans):
    from kareus.plan.report import frontier_table

    assert len(plans) > 1
    assert frontier_table(plans, max_rows=1).row_count == 1


def test_equal_time_pairs_each_baseline_point_with_the_least_energy_plan_within_its_time(tmp_path, plans):
    from kareus.plan.baseline import equal_time, equal_time_table, savings_summary, write_equal_time_csv

    fastest, cheapest = plans[0], min(plans, key=lambda p: p.predicted_energy_j)
    mid = plans[len(plans) // 2]
    baseline = [(cheapest.predicted_time_s * 2, cheapest.predicted_energy_j * 1.5),
                (mid.predicted_time_s, mid.predicted_energy_j * 1.25),
                (fastest.predicted_time_s * 0.9, 1e9)]  # faster than any plan: no counterpart
    rows = equal_time(plans, baseline)
    assert [r.baseline_time_s for r in rows] == sorted(t for t, _ in baseline)  # fastest first
    assert rows[0].plan is None and rows[0].energy_saving_pct is None
    within = [p for p in plans if p.predicted_time_s <= mid.predicted_time_s]
    assert rows[1].plan == min(within, key=lambda p: p.predicted_energy_j)
    assert rows[2].plan == cheapest and rows[2].energy_saving_pct == pytest.approx(100 * (1 - 1 / 1.5))
    s = savings_summary(plans, rows, reference_time_s=mid.predicted_time_s)
    assert s["baseline_points"] == 3 and s["baseline_min_time_s"] == rows[0].baseline_time_s
    assert s["energy_saving_max_pct"] == pytest.approx(100 * (1 - 1 / 1.5))
    assert s["energy_saving_min_pct"] == pytest.approx(rows[1].energy_saving_pct)
    # at the reference's time: the baseline's least energy within it (not its fastest point's 1e9 J)
    # against the least-energy plan within it
    assert s["energy_saving_at_reference_pct"] == pytest.approx(100 * (1 - 1 / 1.25))
    assert "energy_saving_at_reference_pct" not in savings_summary(plans, rows, fastest.predicted_time_s * 0.5)
    assert savings_summary(plans, [], 1.0) == {}
    import csv

    got = list(csv.DictReader(write_equal_time_csv(tmp_path / "b.csv", rows).open()))
    assert [g["plan"] for g in got] == ["", rows[1].plan.id, cheapest.id]
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(equal_time_table(rows, "vs baseline", max_rows=2))
    text = console.export_text()
    assert "none this fast" in text and f"plan {cheapest.id}" in text and "vs baseline" in text


def test_a_plan_summary_says_its_clocks_and_partition_settings(plans):
    from kareus.plan.report import compared_to, plan_summary

    lines = plan_summary(plans[0])
    assert [ln.split(":")[0] for ln in lines[:S]] == [f"stage {s}" for s in range(S)]
    assert all("fwd " in ln and "; bwd " in ln and "MHz (mb " in ln for ln in lines[:S])
    assert lines[S] == f"Megatron's layout in 0 of {2 * S * M} instructions"
    covered = sum(int(ln.split("(")[1].split(" ")[0]) for ln in lines[S + 1:])
    assert covered == 2 * S * M  # every instruction runs one attention partition here
    assert compared_to(6.1, "faster", "slower") == "6.1% faster" and compared_to(-2.3, "faster", "slower") == "2.3% slower"
