"""The peer composer: Perseus' time-energy walk with lowtime's Phillips-Dessouky solver (a dependency).

Each (stage, direction) becomes a lowtime OperationSpec whose options are our instruction options
(knob = option index) with cost = dynamic energy x GPUs per stage; the solver starts from every
instruction at its cheapest option and shortens the iteration one time unit per step. Every step's
knob assignment is re-priced exactly on our DAG (measured option times, not quantised ones), so both
composers are judged by the same ruler.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kareus.compose.iteration import Assignment, CostModel, IterationFrontier, Options, critical_path
from kareus.compose.microbatch import pareto_indices
from kareus.compose.schedule import PipelineDAG
from kareus.config.bounds import out_of_bounds
from kareus.registry import COMPOSERS
from kareus.types import Direction


MIN_STEPS = 10  # warn when an instruction's Pareto options span fewer of lowtime's time steps than this


@dataclass
class PerseusComposerConfig:
    name: str = "perseus"
    unit_time_s: float = 0.001  # lowtime's time quantum: one solver step shortens the iteration by this much
    cost_model: str = "hull"  # "hull" (piecewise-linear lower convex hull) | "exponential" (Perseus' fit)
    max_steps: int = 0  # stop the walk after this many steps (0 = run to the fastest iteration)

    def problems(self, ctx: Any = None) -> list[str]:
        out = out_of_bounds(self, "compose.", positive=("unit_time_s",))  # nan or inf: lowtime fails after the search
        if self.cost_model not in ("hull", "exponential"):
            out.append(f"compose.cost_model: invalid value {self.cost_model!r}; allowed: hull, exponential")
        if self.max_steps < 0:
            out.append(f"compose.max_steps: must be >= 0, got {self.max_steps}")
        return out


def _hull_cost_model(cand_options):
    """A convex piecewise-linear cost model through the lower hull of lowtime's candidate options."""
    from lowtime.cost_model import CostModel as LowtimeCostModel

    from kareus.compose.lp import lower_hull

    class HullCostModel(LowtimeCostModel):
        def __init__(self, options) -> None:
            pts = sorted((o.quant_time, o.cost) for o in options.options)
            q = np.array([p[0] for p in pts], float)
            c = np.array([p[1] for p in pts], float)
            h = lower_hull(q, c)
            self.q, self.c = q[h], c[h]

        def __call__(self, quant_time: int) -> float:
            return float(np.interp(quant_time, self.q, self.c))

    return HullCostModel(cand_options)


log = logging.getLogger(__name__)


def _exponential_or_hull(cand_options) -> tuple[Any, bool]:
    """Perseus' exponential fit where it is defined (at least three options, all costs positive;
    dynamic energy can fall below zero at low clocks on host-bound work), else the hull.
    Returns the model and whether it is the exponential one."""
    from lowtime.cost_model import ExponentialModel

    opts = cand_options.options
    if len(opts) >= 3 and all(o.cost > 0 for o in opts):
        try:
            with warnings.catch_warnings():  # scipy's overflow and covariance notes on a poor fit: judged below
                warnings.simplefilter("ignore")
                fit = ExponentialModel(cand_options)
        except (RuntimeError, TypeError, ValueError) as err:  # scipy's fit gave up
            log.debug("exponential fit failed (%s); using the hull", err)
        else:
            if _falls(fit, sorted({o.quant_time for o in opts})):
                return fit, True
            log.debug("exponential fit does not fall with time; using the hull")
    return _hull_cost_model(cand_options), False


def _falls(fit: Any, quant_times: Sequence[int]) -> bool:
    """Whether the fitted cost falls strictly from each option's time to the next: a fit flat at the
    slow end ends lowtime's walk at once (its cost change drops below its float tolerance)."""
    c = np.array([fit(q) for q in quant_times], float)
    return bool(np.all(np.isfinite(c)) and np.all(np.diff(c) < -1e-9 * np.maximum(np.abs(c[:-1]), 1.0)))


class PerseusComposer:
    """lowtime's Phillips-Dessouky solver over the same DAG and options as ours."""

    name = "perseus"

    def __init__(self, config: PerseusComposerConfig | None = None) -> None:
        self.config = config or PerseusComposerConfig()
        self.steps = 0
        self.stopped_early = False
        self.hull_fallbacks = 0  # instructions whose exponential fit was undefined (cost_model=exponential)

    def compose(self, dag: PipelineDAG, options: Options, static_power_w: float, gpus_per_stage: int,
                num_stages: int, deadlines: Sequence[float] = (),
                energy_budgets: Sequence[float] = (), clock_switch_s: float = 0.0) -> IterationFrontier:
        """lowtime's frontier, traced step by step from the fastest plan; ``deadlines`` (times a plan
        is asked for) and ``energy_budgets`` add nothing: every step it takes is a point already.
        ``clock_switch_s`` is priced into every point, not into lowtime's walk."""
        import networkx as nx
        from lowtime.graph_utils import add_sink_node, add_source_node
        from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
        from lowtime.perseus.instruction import Backward, Forward
        from lowtime.solver import PhillipsDessouky

        logging.getLogger("lowtime").setLevel(logging.WARNING)
        start = time.perf_counter()
        model = CostModel(dag, options, static_power_w, gpus_per_stage, num_stages, clock_switch_s)
        specs = {}
        self.hull_fallbacks = 0
        coarse: list[float] = []  # time spans of instructions whose options share few of lowtime's steps
        for key in dag.keys:
            opts = options[key]
            # lowtime keeps options tied on time at a higher cost, which derails its walk: give it the
            # Pareto options only (knob = index into the full list, as the cost model re-prices)
            keep = pareto_indices([o.time_s for o in opts], [o.dynamic_energy_j for o in opts])
            span = opts[keep[-1]].time_s - opts[keep[0]].time_s
            if len(keep) > 1 and span < MIN_STEPS * self.config.unit_time_s:
                coarse.append(span)
            cand = CandidateExecutionOptions[int](options=[
                ExecutionOption[int](real_time=opts[j].time_s, unit_time=self.config.unit_time_s,
                                     cost=opts[j].dynamic_energy_j * gpus_per_stage, knob=int(j))
                for j in keep])
            if self.config.cost_model == "exponential":
                cost_model, fitted = _exponential_or_hull(cand)
                self.hull_fallbacks += not fitted
            else:
                cost_model = _hull_cost_model(cand)
            specs[key] = OperationSpec[int](options=cand, cost_model=cost_model)
        if self.hull_fallbacks:
            log.warning("perseus: %d of %d instructions use the hull cost model (the exponential fit needs "
                        "3+ options with positive cost and must fall with time)", self.hull_fallbacks, len(dag.keys))
        if coarse:  # lowtime floors times to steps and keeps the costliest option of each: no walk there
            log.warning("perseus: the options of %d of %d instructions span %.3g s or less, under %d steps of "
                        "compose.unit_time_s=%g s: lowtime keeps only the costliest option of each step, so its "
                        "walk misses their cheaper plans; set a smaller unit (more solver steps)",
                        len(coarse), len(dag.keys), max(coarse), MIN_STEPS, self.config.unit_time_s)

        graph = nx.DiGraph()
        ops = []
        for i, node in enumerate(dag.nodes):
            cls = Forward if node.direction is Direction.FWD else Backward
            op = cls(spec=specs[node.key], stage_id=node.stage, micro_batch_id=node.microbatch)
            ops.append(op)
            graph.add_node(i + 2, op=op)
        for p, i in dag.edges:
            graph.add_edge(p + 2, i + 2)
        add_source_node(graph, 0)
        add_sink_node(graph, 1)
        graph.graph["source_node"] = 0
        graph.graph["sink_node"] = 1

        results: list[Assignment] = [model.assess(tuple(op.assigned_knob for op in ops))]
        self.steps = 0
        self.stopped_early = False
        for _ in PhillipsDessouky(graph).run():
            results.append(model.assess(tuple(op.assigned_knob for op in ops)))
            self.steps += 1
            if self.config.max_steps and self.steps >= self.config.max_steps:
                self.stopped_early = True
                break
        # every instruction at its fastest option: the frontier's fast end whatever the walk reached
        fastest = model.assess(model.uniform("fastest"))  # ties on time go to the least energy

        def unswitched(a: Assignment) -> float:  # lowtime walks option times; priced switches aside
            return float(critical_path(dag, model.arrays(a.choice)[0])[1].max())

        walked, fast_end = min(unswitched(a) for a in results), unswitched(fastest)
        results.append(fastest)
        # its quantised times may leave the walk's end a few quanta short: only a stop by max_steps,
        # or one 1% short, says the walk did not reach the fast end
        if walked > fast_end * (1 + 1e-6) and (self.stopped_early or walked > 1.01 * fast_end):
            why = (f"compose.max_steps={self.config.max_steps}" if self.stopped_early
                   else "lowtime's walk ended early")
            log.warning("perseus: the walk stopped after %d steps at %.6g s, short of the fastest iteration "
                        "(%.6g s, added as one more point) (%s): its frontier between them is missing",
                        self.steps, walked, fast_end, why)
        return IterationFrontier.from_assignments(results, model, self.name, time.perf_counter() - start)


@COMPOSERS.register("perseus", PerseusComposerConfig, description="Perseus: lowtime's Phillips-Dessouky solver")
def _perseus(config: PerseusComposerConfig) -> PerseusComposer:
    return PerseusComposer(config)
