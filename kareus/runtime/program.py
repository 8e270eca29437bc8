"""The launch program of one layer block: which op of which nanobatch runs when, and where each comm
op is launched and joined, for one pipeline instruction's partition settings.

The block's op list is the workload graph's (``StageWorkload.block_ops``), so op positions, op names
and partition keys are the plan's own. With two nanobatches the segments interleave as the
partitioner pairs them (:func:`kareus.partition.segments.pieces`): nanobatch 0 runs segment 0 alone,
then for each segment k nanobatch 1's segment k runs beside nanobatch 0's comm k, and nanobatch 0's
segment k+1 beside nanobatch 1's comm k. Each comm is launched before the op of its partition's
planned slot (``sequential``: before the chain, and joined at once) and joined after the partition's
join op, before its own nanobatch's next segment consumes it. With one nanobatch every comm runs after
its own segment. No torch here: the program is plain data, built and checked on any install.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from kareus.partition.segments import Segment, segments_of
from kareus.types import SEQUENTIAL, Op, PartitionType


@dataclass(frozen=True)
class Compute:
    nanobatch: int
    op: int  # position in the block's op list


@dataclass(frozen=True)
class Launch:
    """Issue nanobatch ``nanobatch``'s comm op at position ``op`` on ``sms`` SMs (None: the library's
    default, for comm that no partition pairs)."""

    nanobatch: int
    op: int
    sms: int | None
    partition: str | None  # the partition key whose setting placed it (None: run alone)
    overlapped: bool  # launched inside another nanobatch's chain (not sequential)


@dataclass(frozen=True)
class Join:
    nanobatch: int
    op: int


Step = Compute | Launch | Join
Setting = Callable[[str], tuple[str, int]]  # partition key -> (slot, comm SMs) of the current instruction


@dataclass(frozen=True)
class Program:
    steps: tuple[Step, ...]

    @property
    def overlapped(self) -> int:
        """Comm launches placed inside another nanobatch's compute (a non-sequential slot)."""
        return sum(1 for s in self.steps if isinstance(s, Launch) and s.overlapped)

    @property
    def sequential(self) -> int:
        """Comm launches of a partition whose slot is ``sequential``, or that no partition pairs."""
        return sum(1 for s in self.steps if isinstance(s, Launch) and not s.overlapped)


def _placement(ptype: PartitionType, seg: Segment, slot: str) -> tuple[int | None, int]:
    """(chain index the comm launches before, or None for sequential; chain index it joins after), in
    this segment's chain, which may lack the leading memory-bound ops of its type's canonical chain (a
    stage's first segment)."""
    from kareus.runtime.backend import launch_points

    start, join = launch_points(ptype, slot)
    offset = len(ptype.compute) - len(seg.ops)
    last = len(seg.ops) - 1
    if start is None:
        return None, min(max(join - offset, 0), last)
    return max(start - offset, 0), min(max(join - offset, 0), last)


def build_program(ops: Sequence[Op], nanobatches: int, keys: Mapping[tuple[int, int], str],
                  types: Mapping[str, PartitionType], setting: Setting) -> Program:
    """The program of one block (``ops``: one nanobatch's block ops) for ``nanobatches`` 1 or 2.

    ``keys`` maps (nanobatch, segment index) to the partition key of each paired piece, ``types`` the
    keys to their partition types, ``setting`` a key to the instruction's (slot, SMs).
    """
    segs, stray = segments_of(tuple(ops))
    if stray:
        names = ", ".join(ops[i].name for i in stray)
        raise ValueError(f"the block has comm ops that follow no compute ({names}); the executor runs "
                         "blocks whose every comm ends a compute segment")
    steps: list[Step] = []
    if nanobatches == 1:
        for k, seg in enumerate(segs):
            steps += [Compute(0, i) for i in seg.ops]
            if seg.comm is not None:
                key = keys.get((0, k))
                sms = setting(key)[1] if key is not None else None
                steps += [Launch(0, seg.comm, sms, key, False), Join(0, seg.comm)]
        return Program(tuple(steps))
    if nanobatches != 2:
        raise ValueError(f"the executor runs 1 or 2 nanobatches, got {nanobatches}")

    def run(nb: int, k: int, beside: tuple[int, int] | None) -> None:
        seg = segs[k]
        if beside is None:
            steps.extend(Compute(nb, i) for i in seg.ops)
            return
        key = keys[(nb, k)]
        slot, sms = setting(key)
        start, join = _placement(types[key], seg, slot)
        owner, comm = beside
        if start is None:
            steps.extend((Launch(owner, comm, sms, key, False), Join(owner, comm)))
        for j, i in enumerate(seg.ops):
            if j == start:
                steps.append(Launch(owner, comm, sms, key, True))
            steps.append(Compute(nb, i))
            if start is not None and j == join:
                steps.append(Join(owner, comm))

    run(0, 0, None)
    for k, seg in enumerate(segs):
        run(1, k, None if seg.comm is None else (0, seg.comm))
        if k + 1 < len(segs):
            run(0, k + 1, None if seg.comm is None else (1, seg.comm))
        elif seg.comm is not None:  # the block ends in a comm: nanobatch 1's last runs alone
            steps += [Launch(1, seg.comm, None, None, False), Join(1, seg.comm)]
    return Program(tuple(steps))


def check_program(program: Program, ops: Sequence[Op], nanobatches: int) -> None:
    """Every op of every nanobatch runs once, in order; every comm is joined before an op of its
    nanobatch runs after it; raise AssertionError otherwise (the invariant the executor relies on)."""
    done: dict[int, int] = {nb: 0 for nb in range(nanobatches)}
    pending: dict[int, int] = {}
    for s in program.steps:
        nb = s.nanobatch
        if isinstance(s, Compute):
            assert nb not in pending, f"nanobatch {nb} op {s.op} runs before its comm {pending.get(nb)} joined"
            assert s.op == done[nb], f"nanobatch {nb} runs op {s.op}, expected {done[nb]}"
            done[nb] += 1
        elif isinstance(s, Launch):
            assert s.op == done[nb] and ops[s.op].is_comm and nb not in pending, f"bad launch {s}"
            pending[nb] = s.op
            done[nb] += 1
        else:
            assert pending.pop(nb, None) == s.op, f"join of {s} without its launch"
    assert not pending and all(v == len(ops) for v in done.values()), "the program leaves work undone"


__all__ = ["Compute", "Join", "Launch", "Program", "SEQUENTIAL", "Step", "build_program", "check_program"]
