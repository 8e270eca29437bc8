"""Iteration time and energy of an option assignment on a pipeline DAG, and the iteration frontier type.

Iteration time is the critical path (every instruction starts when its predecessors finish);
energy = gpus_per_stage x sum of the instructions' dynamic energy
         + static_power_w x (gpus_per_stage x num_stages) x iteration time.
An instruction whose clock differs from the one before it on its stage (the stage's last one, for
its first: iterations repeat) starts ``clock_switch_s`` later: the executor drains the device and
locks the new clock first, while the GPU idles (static power only).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Mapping, Sequence

import numpy as np

from kareus.compose.microbatch import InstructionOption
from kareus.compose.schedule import PipelineDAG
from kareus.frontier import Frontier
from kareus.types import Direction, FrontierPoint

OptionKey = tuple[int, Direction]
Options = Mapping[OptionKey, Sequence[InstructionOption]]


@dataclass(frozen=True)
class Assignment:
    """Which option (index into ``options[node.key]``) each DAG node uses, with its outcome."""

    choice: tuple[int, ...]
    time_s: float
    energy_j: float
    dynamic_energy_j: float  # summed over all GPUs
    static_energy_j: float


@dataclass(frozen=True)
class CostModel:
    """Everything needed to price an assignment: the DAG, the options and the energy accounting."""

    dag: PipelineDAG
    options: Options
    static_power_w: float
    gpus_per_stage: int
    num_stages: int
    clock_switch_s: float = 0.0  # GPU idle time of one clock change (hardware.clock_switch_s)

    def __post_init__(self) -> None:
        missing = [k for k in self.dag.keys if not self.options.get(k)]
        if missing:
            raise ValueError("no options for instruction(s) " + ", ".join(f"stage {s} {d.value}" for s, d in missing))

    @cached_property
    def _clock_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every option's clock in one flat array, each node's offset into it, and each node's
        predecessor on its stage (cyclic: a stage's first instruction follows its last)."""
        keys = list(dict.fromkeys(n.key for n in self.dag.nodes))
        start, flat = {}, []
        for k in keys:
            start[k] = len(flat)
            flat += [o.freq_mhz for o in self.options[k]]
        offset = np.array([start[n.key] for n in self.dag.nodes])
        return np.asarray(flat), offset, self.dag.stage_neighbours[0]

    def switches(self, choice: Sequence[int]) -> np.ndarray:
        """Per node, whether a clock change precedes it (its stage's previous instruction runs another clock)."""
        flat, offset, prev = self._clock_index
        clock = flat[offset + np.asarray(choice, dtype=int)]
        return clock != clock[prev]

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_stage * self.num_stages

    def arrays(self, choice: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per-node durations and dynamic energies (per GPU) of an assignment."""
        t = np.empty(len(self.dag))
        e = np.empty(len(self.dag))
        for i, (node, c) in enumerate(zip(self.dag.nodes, choice)):
            o = self.options[node.key][c]
            t[i], e[i] = o.time_s, o.dynamic_energy_j
        return t, e

    def assess(self, choice: Sequence[int]) -> Assignment:
        t, e = self.arrays(choice)
        return self.assess_arrays(tuple(int(c) for c in choice), t, e)

    def assess_arrays(self, choice: tuple[int, ...], durations: np.ndarray, energies: np.ndarray) -> Assignment:
        if self.clock_switch_s:
            durations = durations + self.clock_switch_s * self.switches(choice)
        makespan = float(critical_path(self.dag, durations)[1].max())
        dyn = float(np.sum(energies)) * self.gpus_per_stage
        static = self.static_power_w * self.total_gpus * makespan
        return Assignment(choice, makespan, dyn + static, dyn, static)

    def uniform(self, pick: str) -> tuple[int, ...]:
        """Every node at its fastest ("fastest") or least-dynamic-energy ("cheapest") option."""
        out = []
        for node in self.dag.nodes:
            opts = self.options[node.key]
            if pick == "fastest":
                out.append(min(range(len(opts)), key=lambda j: (opts[j].time_s, opts[j].dynamic_energy_j)))
            else:
                out.append(min(range(len(opts)), key=lambda j: (opts[j].dynamic_energy_j, opts[j].time_s)))
        return tuple(out)


def critical_path(dag: PipelineDAG, durations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Earliest start and finish of every node (nodes are topologically numbered)."""
    n = len(dag)
    start = np.zeros(n)
    finish = np.zeros(n)
    for i, ps in enumerate(dag.preds):
        s = max((finish[p] for p in ps), default=0.0)
        start[i] = s
        finish[i] = s + durations[i]
    return start, finish


def fixed_option_iteration(dag: PipelineDAG, options: Mapping[OptionKey, InstructionOption], static_power_w: float,
                           gpus_per_stage: int, num_stages: int, clock_switch_s: float = 0.0) -> Assignment:
    """Time and energy when every instruction of a (stage, direction) runs one fixed option.

    Used for the Megatron reference point (sequential, top clock, default comm SMs) and plan checks.
    """
    return fixed_option_frontier(dag, options, static_power_w, gpus_per_stage, num_stages,
                                 clock_switch_s).assignments()[0]


def fixed_option_frontier(dag: PipelineDAG, options: Mapping[OptionKey, InstructionOption], static_power_w: float,
                          gpus_per_stage: int, num_stages: int, clock_switch_s: float = 0.0,
                          composer: str = "fixed") -> "IterationFrontier":
    """The one plan of :func:`fixed_option_iteration` as a frontier of one point, to be joined into a
    composed frontier (:meth:`IterationFrontier.joined`) that must hold it."""
    model = CostModel(dag, {k: [o] for k, o in options.items()}, static_power_w, gpus_per_stage, num_stages,
                      clock_switch_s)
    return IterationFrontier.from_assignments([model.assess((0,) * len(dag))], model, composer)


@dataclass(frozen=True)
class IterationFrontier:
    """Pareto frontier of (iteration time, total energy); each point's payload is an :class:`Assignment`."""

    frontier: Frontier
    model: CostModel
    composer: str
    seconds: float = 0.0  # wall time the composer took

    @classmethod
    def from_assignments(cls, assignments: Sequence[Assignment], model: CostModel, composer: str,
                         seconds: float = 0.0) -> "IterationFrontier":
        pts = [FrontierPoint(a.time_s, a.energy_j, a) for a in assignments]
        return cls(Frontier.from_points(pts, objective="total"), model, composer, seconds)

    @property
    def dag(self) -> PipelineDAG:
        return self.model.dag

    @property
    def options(self) -> Options:
        return self.model.options

    def __len__(self) -> int:
        return len(self.frontier)

    def __iter__(self) -> Iterator[FrontierPoint]:
        return iter(self.frontier)

    @property
    def times(self) -> np.ndarray:
        return self.frontier.times

    @property
    def energies(self) -> np.ndarray:
        return self.frontier.energies

    def hypervolume(self, ref: tuple[float, float]) -> float:
        return self.frontier.hypervolume(ref)

    def assignments(self) -> list[Assignment]:
        return [p.payload for p in self.frontier]

    def in_options_of(self, model: CostModel) -> "IterationFrontier":
        """The same points with their choices indexing ``model``'s options, which must hold every
        option they use (e.g. this frontier composed a subset of them). An option equal to several
        of ``model``'s maps to the first. A dict per key finds each in one step: a scan would compare
        up to a thousand options for every node of every point."""
        index: dict[OptionKey, dict[InstructionOption, int]] = {}
        for k, opts in model.options.items():
            index[k] = {}
            for i, o in enumerate(opts):
                index[k].setdefault(o, i)

        def position(key: OptionKey, option: InstructionOption) -> int:
            try:
                return index[key][option]
            except KeyError:
                raise ValueError(f"option {option} of stage {key[0]} {key[1].value} is not among the model's") from None

        moved = [model.assess([position(n.key, self.options[n.key][c]) for n, c in zip(self.dag.nodes, a.choice)])
                 for a in self.assignments()]
        return IterationFrontier.from_assignments(moved, model, self.composer, self.seconds)

    def joined(self, other: "IterationFrontier") -> "IterationFrontier":
        """This frontier with ``other``'s points added (see :meth:`in_options_of`), pruned to the
        Pareto set: a composer is a heuristic, and run on more options it may miss a point that a run
        on fewer found."""
        extra = other.in_options_of(self.model).assignments()
        return IterationFrontier.from_assignments(self.assignments() + extra, self.model, self.composer,
                                                  self.seconds + other.seconds)
