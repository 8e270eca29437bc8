"""Iteration composition: the 1F1B DAG, and both composers against exhaustive enumeration."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kareus.compose import (
    CostModel, InstructionOption, KareusComposer, KareusComposerConfig, fixed_option_iteration, pipeline_dag,
)
from kareus.compose.iteration import critical_path
from kareus.compose.schedule import Synchronous1F1B
from kareus.frontier import Frontier
from kareus.registry import COMPOSERS, SCHEDULES
from kareus.types import Direction

F, B = Direction.FWD, Direction.BWD


def test_1f1b_orders_and_dependencies():
    dag = pipeline_dag("1f1b", 3, 4)
    assert len(dag) == 2 * 3 * 4
    s0 = [str(dag.nodes[i]) for i in dag.stage_order[0]]
    assert s0 == ["F0@S0", "F1@S0", "F2@S0", "B0@S0", "F3@S0", "B1@S0", "B2@S0", "B3@S0"]
    s2 = [str(dag.nodes[i]) for i in dag.stage_order[2]]
    assert s2 == ["F0@S2", "B0@S2", "F1@S2", "B1@S2", "F2@S2", "B2@S2", "F3@S2", "B3@S2"]
    for i, ps in enumerate(dag.preds):  # topological numbering
        assert all(p < i for p in ps)
    assert dag.index(0, 1, F) in dag.preds[dag.index(1, 1, F)]
    assert dag.index(2, 1, B) in dag.preds[dag.index(1, 1, B)]
    assert "1f1b" in SCHEDULES


@pytest.mark.parametrize("S,M", [(2, 2), (3, 5), (4, 8)])
def test_uniform_1f1b_makespan_is_the_textbook_bubble(S, M):
    f, b = 1.0, 2.0
    opts = {(s, d): [InstructionOption(f if d is F else b, 1.0, 1000)] for s in range(S) for d in (F, B)}
    a = fixed_option_iteration(pipeline_dag("1f1b", S, M), {k: v[0] for k, v in opts.items()}, 10.0, 2, S)
    assert a.time_s == pytest.approx((M + S - 1) * (f + b))
    assert a.dynamic_energy_j == pytest.approx(2 * 2 * S * M)
    assert a.energy_j == pytest.approx(a.dynamic_energy_j + 10.0 * 2 * S * a.time_s)


def _tiny_options(S, k, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for s in range(S):
        for d, base in ((F, 1.0), (B, 2.0)):
            t = np.sort(base * rng.uniform(1.0, 1.8, size=k))
            e = np.sort(rng.uniform(1.0, 3.0, size=k))[::-1] * base  # faster costs more
            out[(s, d)] = [InstructionOption(float(ti), float(ei), 1000 + 10 * j) for j, (ti, ei) in enumerate(zip(t, e))]
    return out


def _exhaustive(model: CostModel) -> Frontier:
    """Every assignment, priced by an independent vectorised critical path (no shared code path)."""
    dag = model.dag
    choice = np.array(list(itertools.product(*[range(len(model.options[n.key])) for n in dag.nodes])))
    dur = np.stack([np.array([o.time_s for o in model.options[n.key]])[choice[:, i]] for i, n in enumerate(dag.nodes)], 1)
    dyn = np.stack([np.array([o.dynamic_energy_j for o in model.options[n.key]])[choice[:, i]]
                    for i, n in enumerate(dag.nodes)], 1)
    finish = np.zeros_like(dur)
    for i, n in enumerate(dag.nodes):  # predecessors by rule: stage order + pipeline hand-offs
        order = [dag.nodes[j] for j in dag.stage_order[n.stage]]
        k = order.index(n)
        deps = [order[k - 1]] if k else []
        if n.direction is F and n.stage > 0:
            deps.append((n.stage - 1, n.microbatch, F))
        if n.direction is B and n.stage < dag.num_stages - 1:
            deps.append((n.stage + 1, n.microbatch, B))
        start = np.zeros(len(choice))
        for d in deps:
            start = np.maximum(start, finish[:, dag.index(*d)])
        finish[:, i] = start + dur[:, i]
    t = finish.max(axis=1)
    e = dyn.sum(axis=1) * model.gpus_per_stage + model.static_power_w * model.total_gpus * t
    return Frontier.from_arrays(t, e, [tuple(c) for c in choice])


@pytest.mark.parametrize("S,M,k,seed", [(2, 2, 3, 0), (2, 2, 3, 1), (2, 3, 2, 2), (2, 3, 2, 3), (2, 3, 2, 5), (3, 2, 2, 6)])
def test_composers_against_exhaustive_enumeration(S, M, k, seed):
    """Discrete time-cost tradeoffs are NP-hard: neither composer is exact, both must come close.

    With 2-3 options per instruction the rounding gaps are as large as they get; the exhaustive
    frontier here is often a single point, so the hypervolume is small and the ratio strict.
    """
    dag = pipeline_dag("1f1b", S, M)
    opts = _tiny_options(S, k, seed)
    static, gps = 3.0, 2
    model = CostModel(dag, opts, static, gps, S)
    best = _exhaustive(model)
    ref = (best.times.max() * 1.05, best.energies.max() * 1.05)
    ratios = {}
    configs = {"kareus": {"name": "kareus"}, "perseus": {"name": "perseus", "unit_time_s": 0.01}}  # times ~1-5 s
    for name, cfg in configs.items():
        got = COMPOSERS.build(name, config=cfg).compose(dag, opts, static, gps, S)
        for p in got:  # every point is a real assignment, priced exactly, never beyond the true frontier
            again = model.assess(p.payload.choice)
            assert (again.time_s, again.energy_j) == pytest.approx((p.time_s, p.energy_j))
            assert any(q.time_s <= p.time_s + 1e-12 and q.energy_j <= p.energy_j + 1e-9 for q in best)
        ratios[name] = got.hypervolume(ref) / best.hypervolume(ref)
        if name == "kareus":  # the fastest iteration time is exact
            assert got.times[0] == pytest.approx(best.times[0])
    assert ratios["kareus"] >= 0.95
    assert ratios["kareus"] >= ratios["perseus"] - 0.01


def test_kareus_meets_or_beats_perseus_on_a_small_pipeline():
    from kareus.compose.synthetic import synthetic_options

    dag = pipeline_dag("1f1b", 3, 6)
    opts = synthetic_options(3, seed=4)
    ours = COMPOSERS.build("kareus", config={"name": "kareus", "num_deadlines": 24}).compose(dag, opts, 75.0, 4, 3)
    peer = COMPOSERS.build("perseus", config={"name": "perseus"}).compose(dag, opts, 75.0, 4, 3)
    ts = np.concatenate([ours.times, peer.times])
    es = np.concatenate([ours.energies, peer.energies])
    ref = (ts.max() * 1.02, es.max() * 1.02)
    assert ours.hypervolume(ref) >= 0.99 * peer.hypervolume(ref)
    assert ours.times[0] <= peer.times[0] + 1e-9


def test_missing_options_and_registry_errors_are_clear():
    dag = pipeline_dag("1f1b", 2, 2)
    opts = _tiny_options(2, 2, 0)
    del opts[(1, B)]
    with pytest.raises(ValueError, match="stage 1 bwd"):
        KareusComposer(KareusComposerConfig()).compose(dag, opts, 1.0, 1, 2)
    with pytest.raises(KeyError, match="known: 1f1b"):
        pipeline_dag("zero-bubble", 2, 2)
    assert KareusComposerConfig(num_deadlines=1).problems()
    assert isinstance(SCHEDULES.build("1f1b", config={"name": "1f1b"}), Synchronous1F1B)


@pytest.mark.parametrize("label,make", [
    ("two options", lambda: [InstructionOption(0.010, 2.0, 1410), InstructionOption(0.012, 1.5, 1200)]),
    ("negative dynamic energy", lambda: [InstructionOption(0.010 + 0.001 * j, -0.1 * j, 1410 - 60 * j) for j in range(4)]),
])
def test_perseus_exponential_falls_back_to_the_hull_where_the_fit_is_undefined(label, make):
    """Perseus' exponential fit needs three options with positive cost; elsewhere the hull stands in
    (and says so), and the walk gives the same frontier as cost_model=hull."""
    dag = pipeline_dag("1f1b", 2, 2)
    opts = {(s, d): make() for s in range(2) for d in (Direction.FWD, Direction.BWD)}
    exp = COMPOSERS.build("perseus", config={"name": "perseus", "cost_model": "exponential"})
    got = exp.compose(dag, opts, 85.0, 2, 2)
    hull = COMPOSERS.build("perseus", config={"name": "perseus", "cost_model": "hull"}).compose(dag, opts, 85.0, 2, 2)
    assert exp.hull_fallbacks == len(dag.keys)
    assert [(p.time_s, p.energy_j) for p in got.frontier] == [(p.time_s, p.energy_j) for p in hull.frontier]


def test_the_cheapest_plan_is_found_when_it_is_slower_than_the_lp_optimum():
    """Options above the convex hull can make a slower iteration cheaper than the LP's optimum."""
    rng = np.random.default_rng(22)
    options = {}
    for s in range(2):
        for d, scale in ((F, 1), (B, 2)):
            t = np.sort(rng.uniform(1, 3, 3)) * scale
            e = np.sort(rng.uniform(1, 5, 3))[::-1] * scale
            options[(s, d)] = [InstructionOption(float(a), float(b), 1000 + i, {}) for i, (a, b) in enumerate(zip(t, e))]
    dag = pipeline_dag("1f1b", 2, 2)
    model = CostModel(dag, options, 5.0, 1, 2)
    best = min((model.assess(c) for c in itertools.product(*[range(3)] * len(dag))), key=lambda a: a.energy_j)
    frontier = KareusComposer().compose(dag, options, 5.0, 1, 2)
    assert min(frontier.energies) == pytest.approx(best.energy_j, rel=1e-12)


def test_joined_frontier_keeps_what_a_composition_of_fewer_options_found():
    """The Megatron + Perseus points join Kareus' frontier: re-priced in its options, never lost."""
    from kareus.compose.synthetic import synthetic_options

    S, M = 3, 4
    dag = pipeline_dag("1f1b", S, M)
    full = synthetic_options(S, seed=5)
    sub = {k: v[::2] for k, v in full.items()}  # every other option: a subset of the same objects
    composer = KareusComposer(KareusComposerConfig(num_deadlines=6))
    ours, peer = composer.compose(dag, full, 75.0, 4, S), composer.compose(dag, sub, 75.0, 4, S)
    joined = ours.joined(peer)
    for p in peer.frontier:  # each peer point re-priced exactly, or beaten
        assert any(q.time_s <= p.time_s * (1 + 1e-12) and q.energy_j <= p.energy_j * (1 + 1e-12)
                   for q in joined.frontier)
    for q in joined.frontier:  # every point prices its own assignment in the full options
        a = ours.model.assess(q.payload.choice)
        assert (a.time_s, a.energy_j) == pytest.approx((q.time_s, q.energy_j))
    assert joined.hypervolume((1e9, 1e12)) >= ours.hypervolume((1e9, 1e12))
    assert all(o in full[k] for k in full for o in sub[k])
    with pytest.raises(ValueError, match=r"option .* of stage \d+ (fwd|bwd) is not among the model's"):
        peer.joined(ours)  # options outside this frontier's cannot be re-priced: the line names one


def test_a_deadline_asked_for_gets_its_own_solve():
    """A deadline between the sweep's points is answered by a solve at it, not by the next faster point."""
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 3, 6), synthetic_options(3, seed=4)
    composer = KareusComposer(KareusComposerConfig(num_deadlines=3))
    plain = composer.compose(dag, opts, 75.0, 4, 3)
    gaps = np.diff(plain.times)
    i = int(np.argmax(gaps))
    deadline = float(plain.times[i] + 0.5 * gaps[i])  # the middle of the widest gap between its points
    asked = composer.compose(dag, opts, 75.0, 4, 3, deadlines=[deadline])

    def least_within(f) -> float:
        return min(e for t, e in zip(f.times, f.energies) if t <= deadline)

    assert least_within(asked) < least_within(plain) - 1e-9
    assert composer.compose(dag, opts, 75.0, 4, 3, deadlines=[0.0, 1e9]).times.tolist() == plain.times.tolist()


def test_an_energy_budget_asked_for_gets_a_bisection():
    """A budget between the sweep's points is answered by bisecting the deadline: a faster plan
    within the budget than the sweep's, never one over it; a budget outside the frontier adds nothing."""
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 3, 6), synthetic_options(3, seed=4)
    composer = KareusComposer(KareusComposerConfig(num_deadlines=3))
    plain = composer.compose(dag, opts, 75.0, 4, 3)
    gaps = -np.diff(plain.energies)
    i = int(np.argmax(gaps))
    budget = float(plain.energies[i + 1] + 0.5 * gaps[i])  # the middle of the widest energy step

    def fastest_within(f) -> float:
        return min(t for t, e in zip(f.times, f.energies) if e <= budget)

    asked = composer.compose(dag, opts, 75.0, 4, 3, energy_budgets=[budget])
    assert fastest_within(asked) < fastest_within(plain) - 1e-9
    off = KareusComposer(KareusComposerConfig(num_deadlines=3, budget_bisections=0))
    assert off.compose(dag, opts, 75.0, 4, 3, energy_budgets=[budget]).times.tolist() == plain.times.tolist()
    for outside in (0.0, 1e12):  # refused, or met by the fastest plan: no solve
        assert composer.compose(dag, opts, 75.0, 4, 3, energy_budgets=[outside]).times.tolist() == plain.times.tolist()


def test_perseus_exponential_fit_flat_at_the_slow_end_falls_back_to_the_hull():
    """A fit a*exp(b*t)+c that flattens over the options' times would end lowtime's walk at its first
    step (cost change below its tolerance), leaving only the slowest plan: the hull stands in."""
    # cost falls steeply then not at all: the least-squares exponential is flat past the knee
    make = lambda: [InstructionOption(0.010 + 0.002 * j, e, 1410 - 60 * j)  # noqa: E731
                    for j, e in enumerate([50.0, 10.0, 9.9, 9.8, 9.7, 9.6, 9.5])]
    dag = pipeline_dag("1f1b", 2, 2)
    opts = {(s, d): make() for s in range(2) for d in (Direction.FWD, Direction.BWD)}
    exp = COMPOSERS.build("perseus", config={"name": "perseus", "cost_model": "exponential"})
    got = exp.compose(dag, opts, 85.0, 2, 2)
    assert exp.hull_fallbacks == len(dag.keys) and exp.steps > 1 and len(got) > 2  # the walk, not its two ends
    assert min(got.times) == pytest.approx(float(critical_path(dag, np.full(len(dag), 0.010))[1].max()), rel=1e-9)


def test_perseus_walk_cut_short_still_offers_the_fastest_plan(caplog):
    """compose.max_steps ends lowtime's walk early: the all-fastest plan is still a point (so
    max_throughput is not the walk's slow end) and the shortfall is a warning."""
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 4, 8), synthetic_options(4, seed=4)
    with caplog.at_level("WARNING", logger="kareus.compose.perseus"):  # a whole walk, a few quanta short
        full = COMPOSERS.build("perseus", config={"name": "perseus"}).compose(dag, opts, 75.0, 4, 4)
    assert "short of the fastest" not in caplog.text
    cut = COMPOSERS.build("perseus", config={"name": "perseus", "max_steps": 2})
    with caplog.at_level("WARNING", logger="kareus.compose.perseus"):
        got = cut.compose(dag, opts, 75.0, 4, 4)
    assert cut.stopped_early and min(got.times) == pytest.approx(min(full.times), rel=1e-9)
    assert "short of the fastest iteration" in caplog.text and "compose.max_steps=2" in caplog.text


def test_perseus_fastest_plan_takes_the_cheaper_of_options_tied_on_time():
    """Options tied on time (host-bound work at several clocks): the fast end took the first listed, a
    dominated point, and the plan at that time with less energy was never offered."""
    dag = pipeline_dag("1f1b", 2, 2)
    opts = {k: [InstructionOption(t, 5.0, 1410), InstructionOption(t, 4.0, 1300), InstructionOption(1.5 * t, 2.0, 1000)]
            for k in dag.keys for t in [1.0 if k[1] is Direction.FWD else 2.0]}
    got = COMPOSERS.build("perseus", config={"name": "perseus", "unit_time_s": 0.01, "max_steps": 1}).compose(
        dag, opts, 1.0, 1, 2)
    fast = min(got, key=lambda p: (p.time_s, p.energy_j))
    assert fast.time_s == pytest.approx(9.0) and fast.energy_j == pytest.approx(50.0)  # 8 instructions at 4 J, 18 J static


def test_slack_reclamation_leaves_room_for_the_clock_switches_it_adds():
    """With hardware.clock_switch_s, slowing instructions off the critical path to other clocks adds
    switches: the reverse sweep makes room for them, so the fastest iteration stays the fastest and
    still gets cheaper, and the composer's fastest plan is cheaper than every instruction at its
    fastest option."""
    from kareus.compose.lp import _reclaim, _Switching, _tables
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 3, 6), synthetic_options(3, seed=4)
    tables = _tables(opts)
    node_tab = [tables[n.key] for n in dag.nodes]
    fastest = np.zeros(len(dag), dtype=int)
    for switch_s in (0.001, 0.005):
        model = CostModel(dag, opts, 75.0, 4, 3, switch_s)

        def priced(pos):
            return model.assess(tuple(int(tb.idx[p]) for tb, p in zip(node_tab, pos)))

        base = priced(fastest)
        slowed = _reclaim(dag, node_tab, fastest, None, _Switching.of(dag, switch_s))
        assert model.switches(priced(slowed).choice).any()  # it did change clocks
        assert priced(slowed).time_s == pytest.approx(base.time_s, rel=1e-12)
        assert priced(slowed).energy_j < base.energy_j
        frontier = KareusComposer(KareusComposerConfig(num_deadlines=6)).compose(dag, opts, 75.0, 4, 3,
                                                                                 clock_switch_s=switch_s)
        assert min(frontier.times) == pytest.approx(base.time_s, rel=1e-12)
        assert frontier.energies[0] <= priced(slowed).energy_j * (1 + 1e-12)


def test_an_asked_deadline_is_met_with_clock_switches_priced():
    """The LP does not see clock switches, so its plan for an asked time comes out slower once they are
    priced: it is asked again for less until a plan meets the time."""
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 3, 6), synthetic_options(3, seed=4)
    composer = KareusComposer(KareusComposerConfig(num_deadlines=3))
    plain = composer.compose(dag, opts, 75.0, 4, 3, clock_switch_s=0.002)
    gaps = np.diff(plain.times)
    i = int(np.argmax(gaps))
    deadline = float(plain.times[i] + 0.5 * gaps[i])
    asked = composer.compose(dag, opts, 75.0, 4, 3, deadlines=[deadline], clock_switch_s=0.002)

    def least_within(f) -> float:
        return min(e for t, e in zip(f.times, f.energies) if t <= deadline)

    assert least_within(asked) < least_within(plain) - 1e-9


def test_an_asked_deadline_keeps_being_solved_while_the_lp_rounds_to_known_late_plans():
    """The LP's second try, asked for less, rounded to plans an earlier solve had found, none in time;
    counting new plans only, that read as nothing left to try, and the asked time got no plan of its own."""
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 2, 4), synthetic_options(2, seed=3, clocks=(1200, 1410, 30))
    deadline = 0.5896284988747418  # between two of the plain sweep's points

    def least_within(asked: list[float]) -> float:
        f = KareusComposer().compose(dag, opts, 80.0, 2, 2, deadlines=asked, clock_switch_s=0.003)
        return min(e for t, e in zip(f.times, f.energies) if t <= deadline)

    assert least_within([deadline]) < least_within([]) - 1e-9


def test_reverse_reclaim_never_lengthens_the_iteration_with_switches_priced():
    """Adding a switch before the stage's next instruction must leave room for all its other
    predecessors, placed or not: F1 of stage 0 (not yet placed when B0 of stage 1 is) would
    otherwise end after the next instruction's new start, and the iteration grew from 14 s to 15 s."""
    from kareus.compose.lp import _reclaim, _Switching, _tables

    opts = {(0, F): [InstructionOption(4.0, 5.0, 2, {}), InstructionOption(5.0, 1.0, 1, {})],
            (0, B): [InstructionOption(1.0, 5.0, 2, {}), InstructionOption(5.0, 1.0, 1, {})],
            (1, F): [InstructionOption(1.0, 5.0, 2, {})],
            (1, B): [InstructionOption(1.0, 5.0, 2, {}), InstructionOption(2.0, 1.0, 1, {})]}
    dag = pipeline_dag("1f1b", 2, 2)
    model = CostModel(dag, opts, 0.0, 1, 2, 1.0)
    tables = _tables(opts)
    node_tab = [tables[n.key] for n in dag.nodes]

    def time_of(pos) -> float:
        return model.assess(tuple(int(tb.idx[p]) for tb, p in zip(node_tab, pos))).time_s

    pos = np.array([1, 1, 0, 0, 0, 0, 0, 0])
    assert time_of(_reclaim(dag, node_tab, pos, None, _Switching.of(dag, 1.0))) <= time_of(pos) == 14.0


def _dominated_or_matched(frontier, point) -> bool:
    return any(t <= point.time_s * (1 + 1e-12) and e <= point.energy_j * (1 + 1e-12)
               for t, e in zip(frontier.times, frontier.energies))


def test_with_switches_priced_a_plan_matches_megatron_at_the_top_clock():
    """The reference (every instruction at its top-clock option, no switch) is a plan too. A forward
    that runs faster and cheaper at a lower clock (host-bound) dropped the top-clock forward from the
    options the sweep sees, and every plan it found then switched clocks: the fastest trailed the
    reference by 3%."""
    S, M = 2, 4
    dag = pipeline_dag("1f1b", S, M)
    top_f, low_f = InstructionOption(0.030, 1.10, 1410, {}), InstructionOption(0.029, 1.00, 1200, {})
    top_b, low_b = InstructionOption(0.060, 2.00, 1410, {}), InstructionOption(0.080, 1.50, 1200, {})
    opts = {(s, d): ([low_f, top_f] if d is F else [top_b, low_b]) for s in range(S) for d in (F, B)}
    ref = fixed_option_iteration(dag, {(s, d): (top_f if d is F else top_b) for s in range(S) for d in (F, B)},
                                 80.0, 1, S, 0.002)
    frontier = KareusComposer().compose(dag, opts, 80.0, 1, S, deadlines=[ref.time_s], clock_switch_s=0.002)
    assert _dominated_or_matched(frontier, ref)


@pytest.mark.parametrize("seed", range(4))
def test_with_switches_priced_no_one_clock_plan_beats_the_frontier(seed):
    """A plan that runs every instruction at one clock switches nothing, so pricing switches cannot
    hurt it; the sweep, blind to switches, used to miss such plans by up to 13% energy."""
    from kareus.compose.synthetic import synthetic_options

    S = 3
    dag, opts = pipeline_dag("1f1b", S, 6), synthetic_options(S, seed=seed, clocks=(900, 1410, 60))
    switch_s = 0.004
    frontier = KareusComposer(KareusComposerConfig(num_deadlines=8)).compose(dag, opts, 75.0, 4, S,
                                                                             clock_switch_s=switch_s)
    clocks = set.intersection(*({o.freq_mhz for o in v} for v in opts.values()))
    assert len(clocks) >= 3
    for clock in clocks:
        at = {k: [o for o in v if o.freq_mhz == clock] for k, v in opts.items()}
        for pick in (lambda o: o.time_s, lambda o: o.dynamic_energy_j):  # fastest, cheapest at that clock
            plan = fixed_option_iteration(dag, {k: min(v, key=pick) for k, v in at.items()}, 75.0, 4, S, switch_s)
            assert _dominated_or_matched(frontier, plan), (clock, plan.time_s, plan.energy_j)


def test_the_energy_descent_takes_no_move_whose_clock_switches_cost_more_than_it_saves():
    """The descent priced a slower, cheaper option without the switches it adds: moving one stage's
    forward to another clock saved 0.1 J of dynamic energy and cost 0.15 J of static energy."""
    from kareus.compose.lp import _slow_down, _Switching, _tables

    dag = pipeline_dag("1f1b", 1, 1)  # one stage: F0 then B0, each the other's neighbour
    opts = {(0, F): [InstructionOption(1.0, 2.0, 1410, {}), InstructionOption(1.1, 1.9, 1200, {})],
            (0, B): [InstructionOption(2.0, 4.0, 1410, {})]}
    tables = [_tables(opts)[n.key] for n in dag.nodes]
    top = np.zeros(len(dag), dtype=int)
    assert list(_slow_down(dag, tables, top, 0.5)) == [1, 0]  # switches free: the cheaper clock wins
    sw = _Switching.of(dag, 0.1)
    assert list(_slow_down(dag, tables, top, 0.5, sw)) == [0, 0]
    model = CostModel(dag, opts, 0.5, 1, 1, 0.1)
    assert model.assess((1, 0)).energy_j > model.assess((0, 0)).energy_j  # what the refused move would cost


def test_perseus_says_when_its_time_quantum_merges_an_instructions_options(caplog):
    """Options spanning a few of compose.unit_time_s's steps share them, and lowtime keeps only the
    costliest option of each step: the walk cannot reach the cheaper plans, and a warning says so."""
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 2, 4), synthetic_options(2, seed=0, clocks=(900, 1410, 30), fwd_time_s=0.0004)
    with caplog.at_level("WARNING", logger="kareus.compose.perseus"):
        coarse = COMPOSERS.build("perseus", config={"name": "perseus"}).compose(dag, opts, 80.0, 1, 2)
    assert "the options of 4 of 4 instructions span" in caplog.text and "compose.unit_time_s=0.001 s" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kareus.compose.perseus"):
        fine = COMPOSERS.build("perseus", config={"name": "perseus", "unit_time_s": 1e-6}).compose(dag, opts, 80.0, 1, 2)
    assert "compose.unit_time_s" not in caplog.text
    assert min(fine.energies) < 0.95 * min(coarse.energies)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_asking_for_one_more_time_only_adds_plans(seed):
    """A user's deadline joins the times asked for (Megatron's, Perseus' points). The LP is degenerate:
    a solve chained from the one before, or a descent start displaced by a plan the new solve found,
    returned other optima, and a run with ``plan.deadline_s`` lost plans far from it (and moved the
    saving quoted against Megatron + Perseus)."""
    from kareus.compose.synthetic import synthetic_options

    dag, opts = pipeline_dag("1f1b", 3, 6), synthetic_options(3, seed=seed)
    composer = KareusComposer(KareusComposerConfig(num_deadlines=6))
    plain = composer.compose(dag, opts, 75.0, 4, 3)
    times = plain.times
    asked = [float(a + 0.5 * (b - a)) for a, b in zip(times[:-1], times[1:])][::3]
    base = composer.compose(dag, opts, 75.0, 4, 3, deadlines=asked)
    for extra in asked[1::2]:
        more = composer.compose(dag, opts, 75.0, 4, 3, deadlines=[*asked, extra * 0.999])
        lost = [(t, e) for t, e in zip(base.times, base.energies)
                if not any(t2 <= t * (1 + 1e-12) and e2 <= e * (1 + 1e-12) for t2, e2 in zip(more.times, more.energies))]
        assert lost == [], (extra, lost[:3])
