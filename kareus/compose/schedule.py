"""Pipeline schedules: the DAG of instructions (stage, microbatch, fwd/bwd) that a composer optimises.

Nodes are numbered in a topological order, so a single forward sweep computes start and finish
times. Edges are the stage order (one GPU group runs one instruction at a time) and the cross-stage
activations and gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kareus.registry import SCHEDULES
from kareus.types import Direction


class Instr(NamedTuple):
    stage: int
    microbatch: int
    direction: Direction

    @property
    def key(self) -> tuple[int, Direction]:
        """The (stage, direction) whose options this instruction chooses from."""
        return (self.stage, self.direction)

    def __str__(self) -> str:
        return f"{'F' if self.direction is Direction.FWD else 'B'}{self.microbatch}@S{self.stage}"


@dataclass(frozen=True)
class PipelineDAG:
    """Instructions in topological order; ``preds[i]`` are the nodes that must finish before ``i`` starts."""

    schedule: str
    num_stages: int
    num_microbatches: int
    nodes: tuple[Instr, ...]
    preds: tuple[tuple[int, ...], ...]
    stage_order: tuple[tuple[int, ...], ...]  # per stage, its nodes in execution order

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def edges(self) -> list[tuple[int, int]]:
        return [(p, i) for i, ps in enumerate(self.preds) for p in ps]

    @property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        cached = self.__dict__.get("_succs_cache")
        if cached is None:
            out: list[list[int]] = [[] for _ in self.nodes]
            for i, ps in enumerate(self.preds):
                for p in ps:
                    out[p].append(i)
            cached = tuple(tuple(s) for s in out)
            object.__setattr__(self, "_succs_cache", cached)
        return cached

    @property
    def stage_neighbours(self) -> tuple[np.ndarray, np.ndarray]:
        """Each node's previous and next instruction on its stage, cyclic (iterations repeat: a
        stage's first instruction follows its last); a stage's only instruction is its own."""
        cached = self.__dict__.get("_neighbours_cache")
        if cached is None:
            prev, nxt = np.arange(len(self.nodes)), np.arange(len(self.nodes))
            for order in self.stage_order:
                o = np.asarray(order, dtype=int)
                prev[o], nxt[o] = np.roll(o, 1), np.roll(o, -1)
            cached = (prev, nxt)
            object.__setattr__(self, "_neighbours_cache", cached)
        return cached

    @property
    def keys(self) -> list[tuple[int, Direction]]:
        return sorted({n.key for n in self.nodes}, key=lambda k: (k[0], k[1].value != "fwd"))

    def index(self, stage: int, microbatch: int, direction: Direction) -> int:
        return self._lookup[(stage, microbatch, direction)]

    @property
    def _lookup(self) -> dict[tuple[int, int, Direction], int]:
        cached = self.__dict__.get("_lookup_cache")
        if cached is None:
            cached = {tuple(n): i for i, n in enumerate(self.nodes)}
            object.__setattr__(self, "_lookup_cache", cached)
        return cached


def build_dag(schedule: str, per_stage: list[list[Instr]], extra_edges: list[tuple[Instr, Instr]]) -> PipelineDAG:
    """Number the instructions topologically (Kahn) from per-stage orders plus cross-stage edges."""
    num_stages = len(per_stage)
    all_nodes = [n for stage in per_stage for n in stage]
    preds: dict[Instr, set[Instr]] = {n: set() for n in all_nodes}
    for stage in per_stage:
        for a, b in zip(stage, stage[1:]):
            preds[b].add(a)
    for a, b in extra_edges:
        preds[b].add(a)
    succs: dict[Instr, list[Instr]] = {n: [] for n in all_nodes}
    for b, ps in preds.items():
        for a in ps:
            succs[a].append(b)
    indeg = {n: len(ps) for n, ps in preds.items()}
    ready = sorted((n for n in all_nodes if indeg[n] == 0), key=lambda n: (n.stage, n.microbatch))
    order: list[Instr] = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for s in succs[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) != len(all_nodes):
        raise ValueError(f"schedule {schedule!r} has a dependency cycle")
    pos = {n: i for i, n in enumerate(order)}
    return PipelineDAG(
        schedule=schedule,
        num_stages=num_stages,
        num_microbatches=max(n.microbatch for n in all_nodes) + 1,
        nodes=tuple(order),
        preds=tuple(tuple(sorted(pos[p] for p in preds[n])) for n in order),
        stage_order=tuple(tuple(pos[n] for n in stage) for stage in per_stage),
    )


@dataclass
class OneFOneBConfig:
    name: str = "1f1b"


class Synchronous1F1B:
    """Megatron's non-interleaved 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down."""

    name = "1f1b"

    def __init__(self, config: OneFOneBConfig | None = None) -> None:
        self.config = config or OneFOneBConfig()

    def stage_order(self, stage: int, num_stages: int, num_microbatches: int) -> list[Instr]:
        f, b = Direction.FWD, Direction.BWD
        warmup = min(num_stages - 1 - stage, num_microbatches)
        seq = [Instr(stage, m, f) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            seq += [Instr(stage, warmup + i, f), Instr(stage, i, b)]
        seq += [Instr(stage, m, b) for m in range(num_microbatches - warmup, num_microbatches)]
        return seq

    def build(self, num_stages: int, num_microbatches: int) -> PipelineDAG:
        if num_stages < 1 or num_microbatches < 1:
            raise ValueError("a pipeline needs at least one stage and one microbatch")
        per_stage = [self.stage_order(s, num_stages, num_microbatches) for s in range(num_stages)]
        f, b = Direction.FWD, Direction.BWD
        edges = []
        for m in range(num_microbatches):
            for s in range(num_stages - 1):
                edges.append((Instr(s, m, f), Instr(s + 1, m, f)))
                edges.append((Instr(s + 1, m, b), Instr(s, m, b)))
            for s in range(num_stages):
                edges.append((Instr(s, m, f), Instr(s, m, b)))
        return build_dag(self.name, per_stage, edges)


@SCHEDULES.register("1f1b", OneFOneBConfig, description="synchronous 1F1B (Megatron, non-interleaved)")
def _one_f_one_b(config: OneFOneBConfig) -> Synchronous1F1B:
    return Synchronous1F1B(config)


def pipeline_dag(schedule: str, num_stages: int, num_microbatches: int) -> PipelineDAG:
    """Build the named schedule's DAG (the schedule name is ``ParallelSpec.schedule``)."""
    return SCHEDULES.build(schedule, config={"name": schedule}).build(num_stages, num_microbatches)
