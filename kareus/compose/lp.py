"""The default composer: a deadline sweep of convexified minimum-energy LPs, rounded to measured options.

For a deadline D, the relaxation "choose every instruction's duration d_i on the lower convex hull of
its options' (time, dynamic energy), finish by D, minimise total energy" is a linear program:

    min  g * sum_i e_i + P * G * T
    s.t. e_i >= a_ik + s_ik * d_i          (each hull segment k of node i)
         f_p + d_i <= f_i                   (every edge p -> i; d_i <= f_i at sources)
         f_i <= T <= D                      (sinks)
         d_i in [fastest_i, cheapest_i]

HiGHS solves the first deadline from scratch and every further one of the sweep from the previous
optimal basis (only the bound on T moves), so a sweep costs a few simplex pivots per deadline; Perseus'
Phillips-Dessouky walk instead solves a max-flow for every time quantum. The sweep covers the
fastest iteration up to the LP's unconstrained energy optimum: on the hull, slower is never better.
Measured options above the hull can still make a slower iteration cheaper, so the cheapest point
found then descends: each instruction in turn takes the slower option that lowers the exact total
energy most (its longer path may lengthen the iteration), until no move helps. Times asked for (a
deadline, a time to compare at) are solved last, each from the sweep's final basis: the LP is
degenerate, so one more asked time only adds plans and changes none found for the others.

Each LP solution is rounded to measured options (the cheapest option no slower than d_i, which keeps
the deadline, and the nearest option); then slack is reclaimed greedily, in reverse and in forward
topological order, either keeping the rounded iteration end or using slack up to the deadline:
every instruction is slowed to the cheapest option that fits its window. Instructions of one
(stage, direction) may thus pick different options per microbatch. Every point is re-priced exactly
on the DAG before Pareto pruning.
"""
from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kareus.compose.iteration import Assignment, CostModel, IterationFrontier, Options, critical_path
from kareus.compose.microbatch import pareto_indices
from kareus.compose.schedule import PipelineDAG
from kareus.frontier import within_limit
from kareus.registry import COMPOSERS


@dataclass
class KareusComposerConfig:
    name: str = "kareus"
    num_deadlines: int = 48  # LPs solved between the fastest iteration and the energy optimum
    repair_passes: int = 2  # slack-reclamation sweeps after rounding (0 = plain rounding)
    nearest_rounding: bool = True  # also try rounding to the nearest option (may move the deadline)
    budget_bisections: int = 24  # deadline solves per energy budget asked for (plan.energy_budget_j)

    def problems(self, ctx: Any = None) -> list[str]:
        out = []
        if self.num_deadlines < 2:
            out.append(f"compose.num_deadlines: must be >= 2, got {self.num_deadlines}")
        if self.repair_passes < 0:
            out.append(f"compose.repair_passes: must be >= 0, got {self.repair_passes}")
        if self.budget_bisections < 0:
            out.append(f"compose.budget_bisections: must be >= 0, got {self.budget_bisections}")
        return out


@dataclass(frozen=True)
class _KeyTable:
    """Per (stage, direction): Pareto option indices sorted by time, and hull segments."""

    idx: np.ndarray  # indices into the caller's option list, time ascending
    t: np.ndarray
    e: np.ndarray
    seg_slope: np.ndarray
    seg_rhs: np.ndarray  # s * t_a - e_a  (row: s*d - e <= rhs)
    f: np.ndarray  # each option's clock


@dataclass(frozen=True)
class _Switching:
    """A clock change between consecutive instructions of a stage delays the later one by ``seconds``
    (see CostModel); ``prev`` and ``nxt`` are each node's neighbours in its stage's order (cyclic)."""

    seconds: float
    prev: np.ndarray
    nxt: np.ndarray

    @classmethod
    def of(cls, dag: PipelineDAG, seconds: float) -> "_Switching | None":
        if not seconds:
            return None
        return cls(float(seconds), *dag.stage_neighbours)

    def delay(self, clock: float, before: float) -> float:
        return self.seconds if clock != before else 0.0


def _durations(node_tab: Sequence[_KeyTable], pos: np.ndarray,
               sw: _Switching | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Per node, its duration (a clock change before it included) and, with switches priced, its clock."""
    dur = np.array([tb.t[p] for tb, p in zip(node_tab, pos)])
    if sw is None:
        return dur, None
    clk = np.array([tb.f[p] for tb, p in zip(node_tab, pos)])
    return dur + sw.seconds * (clk != clk[sw.prev]), clk


def lower_hull(t: np.ndarray, e: np.ndarray) -> list[int]:
    """Indices of the lower convex hull of a Pareto set sorted by time (energy falling)."""
    hull: list[int] = []
    for i in range(len(t)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b if it lies on or above the segment a -> i
            if (e[b] - e[a]) * (t[i] - t[a]) >= (e[i] - e[a]) * (t[b] - t[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _tables(options: Options, clock: float | None = None) -> dict:
    """Per (stage, direction), its Pareto options (of those at ``clock`` alone, if given)."""
    out = {}
    for key, opts in options.items():
        keep = np.array([j for j, o in enumerate(opts) if clock is None or o.freq_mhz == clock], dtype=int)
        t_all = np.array([opts[j].time_s for j in keep], float)
        e_all = np.array([opts[j].dynamic_energy_j for j in keep], float)
        front = np.asarray(pareto_indices(t_all, e_all), dtype=int)
        idx, t, e = keep[front], t_all[front], e_all[front]
        h = lower_hull(t, e)
        ht, he = t[h], e[h]
        slope = np.diff(he) / np.diff(ht) if len(h) > 1 else np.zeros(0)
        rhs = slope * ht[:-1] - he[:-1]
        out[key] = _KeyTable(idx, t, e, slope, rhs, np.array([opts[j].freq_mhz for j in idx], float))
    return out


class KareusComposer:
    """Deadline-sweep LP composer (scipy HiGHS) with rounding and slack reclamation."""

    name = "kareus"

    def __init__(self, config: KareusComposerConfig | None = None) -> None:
        self.config = config or KareusComposerConfig()

    def compose(self, dag: PipelineDAG, options: Options, static_power_w: float, gpus_per_stage: int,
                num_stages: int, deadlines: Sequence[float] = (),
                energy_budgets: Sequence[float] = (), clock_switch_s: float = 0.0) -> IterationFrontier:
        """The iteration frontier; ``deadlines`` are times a plan is asked for (a user's deadline, a
        time to compare at): each gets a solve of its own, so the frontier has its best point right
        at it, not only at the sweep's evenly spaced times. ``energy_budgets`` (joules per iteration)
        get a bisection on the deadline between the fastest plan and the fastest one found within
        the budget, so the frontier has the fastest plan the rounding finds at that energy.
        ``clock_switch_s`` (see :class:`CostModel`) is left out of the LP, the rounding and the
        energy descent; the reverse slack reclamation leaves room for the switches it adds (also from
        every instruction at its fastest option), and every point found is priced with them. Since
        the sweep does not see switches, each clock every instruction can run at then gets a sweep of
        its own over that clock's options alone: such plans switch nothing, so the LP is exact for
        them, and Megatron's layout at the top clock is one of them."""
        start = time.perf_counter()
        model = CostModel(dag, options, static_power_w, gpus_per_stage, num_stages, clock_switch_s)
        results: list[Assignment] = []
        seen: set[tuple[int, ...]] = set()
        sweep = _Sweep(self.config, dag, _tables(options), model, _Switching.of(dag, clock_switch_s), results, seen)
        sweep.run(deadlines, self.config.num_deadlines)
        if clock_switch_s:
            for clock in _shared_clocks(options):
                one = _Sweep(self.config, dag, _tables(options, clock), model, None, results, seen)
                one.run(deadlines, SINGLE_CLOCK_DEADLINES)
        for budget in sorted({float(b) for b in energy_budgets}):
            sweep.bisect_budget(budget, self.config.budget_bisections)
        return IterationFrontier.from_assignments(results, model, self.name, time.perf_counter() - start)


def _shared_clocks(options: Options) -> list[float]:
    """The clocks every instruction has an option at, highest first."""
    common = set.intersection(*({o.freq_mhz for o in opts} for opts in options.values())) if options else set()
    return sorted(common, reverse=True)


class _Sweep:
    """One deadline sweep over the options in ``tables``: every point it finds is priced by ``model``
    and joins ``results`` (``seen``: the choices already there, shared by every sweep of a compose)."""

    def __init__(self, config: KareusComposerConfig, dag: PipelineDAG, tables: dict, model: CostModel,
                 sw: _Switching | None, results: list[Assignment], seen: set[tuple[int, ...]]) -> None:
        self.config, self.dag, self.model, self.sw = config, dag, model, sw
        self.results, self.seen = results, seen
        self.node_tab = [tables[n.key] for n in dag.nodes]
        self.t_fast = float(critical_path(dag, np.array([tb.t[0] for tb in self.node_tab]))[1].max())
        self.t_slow = float(critical_path(dag, np.array([tb.t[-1] for tb in self.node_tab]))[1].max())
        self.lp = _LP(dag, self.node_tab, model.static_power_w, model.gpus_per_stage, model.num_stages)
        self.found: list[tuple[int, ...]] = []  # choices this sweep added

    def add(self, pos: np.ndarray) -> tuple[int, ...]:
        """Price ``pos`` into ``results`` unless an earlier solve found it; its choice either way."""
        choice = tuple(int(tb.idx[p]) for tb, p in zip(self.node_tab, pos))
        if choice in self.seen:
            return choice
        self.seen.add(choice)
        self.found.append(choice)
        d = np.array([tb.t[p] for tb, p in zip(self.node_tab, pos)])
        e = np.array([tb.e[p] for tb, p in zip(self.node_tab, pos)])
        self.results.append(self.model.assess_arrays(choice, d, e))
        return choice

    def reclaimed(self, pos: np.ndarray, deadline: float | None) -> list[tuple[int, ...]]:
        """``pos``, and ``pos`` with its slack reclaimed: keeping its iteration end, or (with a
        deadline) using the slack up to it. The choices of every plan reached, found before or not."""
        reached = [self.add(pos)]
        for target, reclaim in itertools.product((None,) if deadline is None else (None, deadline),
                                                 (_reclaim, _reclaim_forward)):
            cur = pos
            for _ in range(self.config.repair_passes):
                new = reclaim(self.dag, self.node_tab, cur, target, self.sw)
                if np.array_equal(new, cur):
                    break
                cur = new
                reached.append(self.add(cur))
        return reached

    def solve_at(self, deadline: float, lp_deadline: float | None = None,
                 from_kept: bool = False) -> list[tuple[int, ...]]:
        """The relaxed optimum at ``lp_deadline`` (default: ``deadline``), rounded to options and its
        slack reclaimed up to ``deadline``; the choices of the plans it reached ([] if infeasible).
        ``from_kept``: an asked time's solve, started from the sweep's basis (``_LP.solve``)."""
        sol = self.lp.solve(deadline if lp_deadline is None else lp_deadline, from_kept)
        if sol is None:
            return []
        roundings = [_round(self.node_tab, sol[0], nearest=False)]
        if self.config.nearest_rounding:
            roundings.append(_round(self.node_tab, sol[0], nearest=True))
        return [c for pos in roundings for c in self.reclaimed(pos, deadline)]

    def meet(self, deadline: float) -> None:
        """A solve for an asked time; with switches priced, the LP (which does not see them) is asked
        again for less, by what the priced plans overshot, until one meets the time. Plans an earlier
        solve found count too: a lower LP deadline that rounds to known plans, none in time, goes lower."""
        lp_deadline = deadline
        for _ in range(1 if self.sw is None else MEET_TRIES):
            reached = set(self.solve_at(deadline, lp_deadline, from_kept=True))
            times = [a.time_s for a in self.results if a.choice in reached]
            if not times or any(within_limit(t, deadline) for t in times):
                return
            lp_deadline -= min(times) - deadline
            if lp_deadline <= self.t_fast:
                return

    def run(self, deadlines: Sequence[float], num_deadlines: int) -> None:
        """Both ends, ``num_deadlines`` evenly spaced solves up to the LP's energy optimum (on the hull,
        slower is never better), the energy descent, then a solve per asked time in that range."""
        zeros = np.zeros(len(self.dag), dtype=int)
        self.add(zeros)
        self.add(np.array([len(tb.t) - 1 for tb in self.node_tab]))
        free = self.lp.solve(self.t_slow)
        t_best = self.t_slow if free is None else min(self.t_slow, max(self.t_fast, free[1]))
        evenly = np.linspace(t_best, self.t_fast, max(2, num_deadlines)) if t_best > self.t_fast else [self.t_fast]
        asked = [float(d) for d in deadlines if self.t_fast < float(d) < t_best]  # outside: the ends answer
        if self.sw is not None:  # the roundings switch clocks on the critical path, where the fastest plan need not
            self.reclaimed(zeros, None)
        for deadline in evenly:
            self.solve_at(float(deadline))
        self.lp.keep_basis()  # each asked time starts here, whichever others are asked
        self.descend()
        for deadline in sorted(set(asked)):
            self.meet(deadline)

    def descend(self) -> None:
        """The energy descent from the cheapest points the sweep found. Asked times are met after it, so
        a further asked time only adds plans: it cannot displace a start and lose what that start found."""
        energy = {a.choice: a.energy_j for a in self.results}
        for choice in sorted(self.found, key=energy.__getitem__)[:DESCENT_STARTS]:
            pos = np.array([int(np.flatnonzero(tb.idx == c)[0]) for tb, c in zip(self.node_tab, choice)])
            for _ in range(DESCENT_PASSES):
                new = _slow_down(self.dag, self.node_tab, pos, self.model.static_power_w * self.model.num_stages,
                                 self.sw)
                if np.array_equal(new, pos):
                    break
                pos = new
                self.add(pos)

    def bisect_budget(self, budget: float, bisections: int) -> None:
        """Bisect the deadline for the fastest plan within ``budget`` J: a deadline whose solve finds a
        plan within the budget moves the upper end down to that plan's time, one that finds none moves
        the lower end up. Nothing to do when no plan found so far fits (the budget is refused) or the
        fastest plan already fits."""
        within = [a.time_s for a in self.results if within_limit(a.energy_j, budget)]
        if not within or min(within) <= self.t_fast * (1 + 1e-12):
            return
        lo, hi = self.t_fast, min(within)
        for _ in range(bisections):
            if hi - lo <= 1e-6 * hi:
                break
            mid = 0.5 * (lo + hi)
            first = len(self.results)
            self.solve_at(mid, from_kept=True)
            fits = [a.time_s for a in self.results[first:] if within_limit(a.energy_j, budget) and a.time_s < hi]
            if fits:
                hi = min(fits)
            else:
                lo = mid


MEET_TRIES = 4  # LP solves per asked time when switches are priced (see meet)
SINGLE_CLOCK_DEADLINES = 12  # evenly spaced solves of each one-clock sweep (switches priced)
DESCENT_STARTS = 2  # the cheapest points found that each descend
DESCENT_PASSES = 8  # at most this many passes per descent (each stops early once no move helps)


def _slow_down(dag: PipelineDAG, node_tab: Sequence[_KeyTable], pos: np.ndarray, static_per_s: float,
               sw: _Switching | None = None) -> np.ndarray:
    """One pass of exact energy descent: each node in turn takes the slower option that lowers
    dynamic energy + ``static_per_s`` x iteration time most (both per GPU of a stage).

    Slowing node i alone leaves its earliest start and the longest path after it unchanged, so the
    new iteration time is max(T, start_i + d_i' + tail_i), exact for every option at once. With clock
    switches priced (``sw``), d_i' includes the switch before node i at that option's clock; the
    switch it adds or drops before the stage's next instruction moves that one too, so the best move
    is priced again on the whole DAG and taken only if it still lowers the energy.
    """
    pos = pos.copy()
    dur, clk = _durations(node_tab, pos, sw)
    start, finish = critical_path(dag, dur)
    makespan = float(finish.max())
    tail = _tails(dag, dur)
    for i, tb in enumerate(node_tab):
        p = pos[i]
        if p + 1 >= len(tb.t):
            continue
        own = tb.t[p + 1:]
        if sw is not None:
            own = own + sw.seconds * (tb.f[p + 1:] != clk[sw.prev[i]])
        ends = np.maximum(makespan, start[i] + own + tail[i])
        gain = (tb.e[p] - tb.e[p + 1:]) - static_per_s * (ends - makespan)
        j = int(np.argmax(gain))
        least = 1e-12 * max(1.0, abs(tb.e[p]))
        if gain[j] <= least:
            continue
        trial = pos.copy()
        trial[i] = p + 1 + j
        trial_dur, trial_clk = _durations(node_tab, trial, sw)
        trial_start, trial_finish = critical_path(dag, trial_dur)
        trial_end = float(trial_finish.max())
        if sw is not None and (tb.e[p] - tb.e[p + 1 + j]) - static_per_s * (trial_end - makespan) <= least:
            continue
        pos, dur, clk, start, makespan = trial, trial_dur, trial_clk, trial_start, trial_end
        tail = _tails(dag, dur)
    return pos


def _tails(dag: PipelineDAG, durations: np.ndarray) -> np.ndarray:
    """Per node, the longest path from its end to the iteration's end."""
    succs = dag.succs
    tail = np.zeros(len(dag))
    for i in range(len(dag) - 1, -1, -1):
        tail[i] = max((durations[s] + tail[s] for s in succs[i]), default=0.0)
    return tail


def _round(node_tab: Sequence[_KeyTable], d: np.ndarray, nearest: bool) -> np.ndarray:
    """Per node, the slowest Pareto option no slower than d_i (or the nearest in time)."""
    pos = np.empty(len(node_tab), dtype=int)
    for i, (tb, di) in enumerate(zip(node_tab, d)):
        j = max(0, bisect.bisect_right(tb.t, di * (1 + 1e-9)) - 1)
        if nearest and j + 1 < len(tb.t) and abs(tb.t[j + 1] - di) < abs(di - tb.t[j]):
            j += 1
        pos[i] = j
    return pos


def _reclaim(dag: PipelineDAG, node_tab: Sequence[_KeyTable], pos: np.ndarray,
             makespan: float | None = None, sw: _Switching | None = None) -> np.ndarray:
    """Slow every node to the cheapest option that fits its window without ending after ``makespan``.

    ``makespan`` defaults to the assignment's own iteration time (a pure energy saving).
    Reverse topological sweep: each node ends as late as its successors allow (as-late-as-possible
    schedule) and may start as early as its predecessors' current earliest finish. With clock
    switches priced (``sw``), an option's duration includes the switch before it, and the stage's
    next instruction, already placed, moves by the switch the option adds or removes before it; an
    option may add one only where the next instruction's other placed predecessors still end in time,
    and never before a stage's first instruction (the wrap from its last).
    """
    pos = pos.copy()
    dur, clk = _durations(node_tab, pos, sw)
    est, eft = critical_path(dag, dur)
    makespan = max(float(eft.max()), makespan or 0.0)
    succs = dag.succs
    late_start = np.empty(len(dag))
    late_end = np.empty(len(dag))
    for i in range(len(dag) - 1, -1, -1):
        tb = node_tab[i]
        if sw is None:
            end = min((late_start[s] for s in succs[i]), default=makespan)
            j = bisect.bisect_right(tb.t, (end - est[i]) * (1 + 1e-12)) - 1
            if j > pos[i]:
                pos[i] = j
            late_start[i] = end - tb.t[pos[i]]
            continue
        nx, before = int(sw.nxt[i]), clk[sw.prev[i]]
        placed = nx != i and nx in succs[i]  # the stage's next instruction, not the wrap to its first
        other = min((late_start[s] for s in succs[i] if not (placed and s == nx)), default=makespan)
        t_nx = node_tab[nx].t[pos[nx]]
        # when the stage's next instruction's other predecessors end: placed (later) ones as placed,
        # the rest (earlier) no sooner than their earliest finish
        others_end = (max((late_end[p] if p > i else eft[p] for p in dag.preds[nx] if p != i), default=-np.inf)
                      if placed else 0.0)

        def end_at(clock: float) -> float | None:
            """Latest end of node i at ``clock``; None where that clock adds a switch it cannot."""
            if not placed:
                return None if nx != i and clock != clk[nx] == clk[i] else other
            nx_start = late_end[nx] - t_nx - sw.delay(clk[nx], clock)
            if clock != clk[nx] == clk[i] and others_end > nx_start * (1 + 1e-12):
                return None
            return min(other, nx_start)

        cap = min(other, late_end[nx] - t_nx) if placed else other  # no option ends later than this
        j = bisect.bisect_right(tb.t, (cap - est[i]) * (1 + 1e-12)) - 1
        while j > pos[i]:
            end = end_at(tb.f[j])
            if end is not None and tb.t[j] + sw.delay(tb.f[j], before) <= (end - est[i]) * (1 + 1e-12):
                break
            j -= 1
        pos[i] = max(pos[i], j)
        clk[i] = tb.f[pos[i]]
        if placed:
            late_start[nx] = late_end[nx] - t_nx - sw.delay(clk[nx], clk[i])
        late_end[i] = min(other, late_start[nx]) if placed else other
        late_start[i] = late_end[i] - tb.t[pos[i]] - sw.delay(clk[i], before)
    return pos


def _reclaim_forward(dag: PipelineDAG, node_tab: Sequence[_KeyTable], pos: np.ndarray,
                     makespan: float | None = None, sw: _Switching | None = None) -> np.ndarray:
    """Like :func:`_reclaim`, but earlier instructions take the slack first (topological sweep).
    With clock switches priced, a node keeps its stage neighbours' clocks where it shares them (a
    switch added here would land on instructions whose windows are already set)."""
    pos = pos.copy()
    dur, clk = _durations(node_tab, pos, sw)
    finish = critical_path(dag, dur)[1]
    end_all = max(float(finish.max()), makespan or 0.0)
    succs = dag.succs
    latest_finish = np.empty(len(dag))
    for i in range(len(dag) - 1, -1, -1):  # latest finish with the current durations
        latest_finish[i] = min((latest_finish[s] - dur[s] for s in succs[i]), default=end_all)
    new_finish = np.empty(len(dag))
    for i, ps in enumerate(dag.preds):
        start = max((new_finish[p] for p in ps), default=0.0)
        tb = node_tab[i]
        own = 0.0 if sw is None else dur[i] - tb.t[pos[i]]  # the switch before it, if any
        j = bisect.bisect_right(tb.t, (latest_finish[i] - start - own) * (1 + 1e-12)) - 1
        if sw is not None:
            keep = {clk[n] for n in (sw.prev[i], sw.nxt[i]) if n != i and clk[n] == clk[i]}
            while j > pos[i] and keep and tb.f[j] not in keep:
                j -= 1
        if j > pos[i]:
            pos[i] = j
        new_finish[i] = start + tb.t[pos[i]] + own
    return pos


def _silent_highs(h: Any) -> Any:
    """A HiGHS instance without its banner: the first one in a process prints it on the C-level
    stdout, which is the user's terminal, so that descriptor is pointed at /dev/null meanwhile."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            solver = h.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    solver.setOptionValue("output_flag", False)
    return solver


class _LP:
    """The deadline LP in sparse form; only the upper bound on T changes between deadlines.

    The model is loaded into HiGHS once and every deadline re-solves from the previous optimal basis
    (a bound change costs a few dual simplex pivots), or from a kept one (``keep_basis``).
    """

    def __init__(self, dag: PipelineDAG, node_tab: Sequence[_KeyTable], static_power_w: float,
                 gpus_per_stage: int, num_stages: int) -> None:
        from scipy.sparse import csr_matrix

        n = len(dag)
        self.n = n
        rows, cols, vals, rhs = [], [], [], []
        r = 0
        for i, tb in enumerate(node_tab):  # hull segments: s*d_i - e_i <= s*t_a - e_a
            for s, b in zip(tb.seg_slope, tb.seg_rhs):
                rows += [r, r]
                cols += [i, n + i]
                vals += [float(s), -1.0]
                rhs.append(float(b))
                r += 1
        for i, ps in enumerate(dag.preds):  # f_p + d_i - f_i <= 0
            for p in ps or (None,):
                if p is None:
                    rows += [r, r]
                    cols += [i, 2 * n + i]
                    vals += [1.0, -1.0]
                else:
                    rows += [r, r, r]
                    cols += [2 * n + p, i, 2 * n + i]
                    vals += [1.0, 1.0, -1.0]
                rhs.append(0.0)
                r += 1
        for i, ss in enumerate(dag.succs):  # f_i - T <= 0 at sinks
            if not ss:
                rows += [r, r]
                cols += [2 * n + i, 3 * n]
                vals += [1.0, -1.0]
                rhs.append(0.0)
                r += 1
        self.A = csr_matrix((vals, (rows, cols)), shape=(r, 3 * n + 1))
        self.b = np.array(rhs)
        self.c = np.concatenate([np.zeros(n), np.full(n, float(gpus_per_stage)), np.zeros(n),
                                 [static_power_w * gpus_per_stage * num_stages]])
        self.lb = np.concatenate([[tb.t[0] for tb in node_tab], [tb.e[-1] for tb in node_tab], np.zeros(n + 1)])
        self.ub = np.concatenate([[tb.t[-1] for tb in node_tab], np.full(2 * n + 1, np.inf)])
        self._highs = self._load()

    def _load(self):
        """Load the model into HiGHS once; each deadline then only moves T's upper bound."""
        import highspy as h

        A = self.A.tocsc()
        lp = h.HighsLp()
        lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = A.shape[1], A.shape[0]
        lp.a_matrix_.format_ = h.MatrixFormat.kColwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = self.c, self.lb, self.ub
        lp.row_lower_, lp.row_upper_ = np.full(A.shape[0], -np.inf), self.b
        solver = _silent_highs(h)
        if solver.passModel(lp) == h.HighsStatus.kError:
            raise RuntimeError("HiGHS rejected the deadline LP")
        self._optimal = h.HighsModelStatus.kOptimal
        return solver

    def keep_basis(self) -> None:
        """Keep the current optimal basis: solves ``from_kept`` start from it."""
        self._kept = self._highs.getBasis()

    def solve(self, deadline: float, from_kept: bool = False) -> tuple[np.ndarray, float] | None:
        """Durations and iteration time of the relaxed optimum under the deadline (None if none found).
        ``from_kept``: start from the kept basis, not the last solve's; the LP is degenerate, so which
        optimum a solve returns depends on where it starts, and a solve for one asked time must not
        depend on which others were asked before it."""
        if from_kept:  # HiGHS' other state (edge weights, factorisation) would carry the last solve over
            self._highs.clearSolver()
            self._highs.setBasis(self._kept)
        self._highs.changeColBounds(3 * self.n, 0.0, deadline * (1 + 1e-9))
        self._highs.run()
        if self._highs.getModelStatus() != self._optimal:
            return None
        x = self._highs.getSolution().col_value
        return np.asarray(x[: self.n], dtype=float), float(x[3 * self.n])


@COMPOSERS.register("kareus", KareusComposerConfig, description="deadline-sweep LP on convexified options + rounding")
def _kareus(config: KareusComposerConfig) -> KareusComposer:
    return KareusComposer(config)
