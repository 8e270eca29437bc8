"""The launch program of a layer block: every op once and in order, comms joined before their consumers,
and exactly the plan's partitions (keys and counts) at their planned slots."""
from __future__ import annotations

import random
from collections import Counter

import pytest

import kareus.partition  # noqa: F401  (registers the partitioners)
from kareus.partition.segments import piece_keys
from kareus.registry import PARTITIONERS
from kareus.runtime.program import Compute, Join, Launch, build_program, check_program
from kareus.types import SEQUENTIAL, Direction, ModelSpec, ParallelSpec
from kareus.workload import build_workload

MODEL = ModelSpec("t", 4, 64, 128, 4, 2, 16, 128)


def _layout(sp: bool = False, nanobatches: int = 2, recompute: str = "full"):
    par = ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=16, sequence_parallel=sp,
                       nanobatches=nanobatches, recompute=recompute)
    wl = build_workload(MODEL, par)
    part = PARTITIONERS.build("nanobatch" if nanobatches == 2 else "sequential", config={}).partition(wl)
    return wl, part, {t.key: t for t in part.types}, piece_keys(wl, nanobatches, True)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_program_runs_every_op_once_with_the_partitions_the_plan_counts(sp, seed):
    wl, part, types, keys = _layout(sp)
    rng = random.Random(seed)
    work = {w.direction: dict(w.partitions) for w in part.work}
    for d in Direction:
        ops = wl.stages[0].block_ops(d)
        prog = build_program(ops, 2, keys[(0, d)], types,
                             lambda k: (rng.choice(types[k].slot_labels), rng.randint(1, 32)))
        check_program(prog, ops, 2)
        launched = Counter(s.partition for s in prog.steps if isinstance(s, Launch) and s.partition)
        expected = {k: n for k, n in work[d].items() if types[k].direction is d}
        assert launched == expected  # one launch per occurrence the partitioner counted, keyed as the plan is


def test_a_slot_launches_the_comm_before_that_op_of_the_other_nanobatch():
    wl, _, types, keys = _layout()
    ops = wl.stages[0].block_ops(Direction.FWD)
    slots = {k: (types[k].slot_labels[-1], 4) for k in types}  # the last slot of every partition
    prog = build_program(ops, 2, keys[(0, Direction.FWD)], types, lambda k: slots[k])
    steps = list(prog.steps)
    for i, s in enumerate(steps):
        if isinstance(s, Launch) and s.partition == "fwd_attn":
            nxt = steps[i + 1]
            assert isinstance(nxt, Compute) and nxt.nanobatch != s.nanobatch
            assert ops[nxt.op].name == "attn_proj"  # fwd_attn's last slot, linear_1, is attn_proj
            assert s.overlapped and s.sms == 4
    assert prog.overlapped == sum(1 for s in steps if isinstance(s, Launch) and s.partition)


def test_sequential_runs_each_comm_alone_before_the_chain():
    wl, _, types, keys = _layout()
    ops = wl.stages[0].block_ops(Direction.BWD)
    prog = build_program(ops, 2, keys[(0, Direction.BWD)], types, lambda k: (SEQUENTIAL, 2))
    check_program(prog, ops, 2)
    assert prog.overlapped == 0
    steps = list(prog.steps)
    for i, s in enumerate(steps):
        if isinstance(s, Launch):
            assert isinstance(steps[i + 1], Join) and steps[i + 1].op == s.op


def test_one_nanobatch_runs_each_comm_after_its_own_segment():
    wl, _, types, keys = _layout(nanobatches=1)
    ops = wl.stages[0].block_ops(Direction.FWD)
    prog = build_program(ops, 1, keys[(0, Direction.FWD)], types, lambda k: (SEQUENTIAL, 8))
    check_program(prog, ops, 1)
    assert [type(s) for s in prog.steps].count(Launch) == sum(o.is_comm for o in ops)


def test_a_missing_setting_propagates_from_the_executor():
    wl, _, types, keys = _layout()

    def setting(key: str):
        raise KeyError(key)

    with pytest.raises(KeyError):
        build_program(wl.stages[0].block_ops(Direction.FWD), 2, keys[(0, Direction.FWD)], types, setting)
