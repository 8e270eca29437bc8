"""No overlap: the nanobatch partitions with every comm after its compute (the no-kernel-scheduling
ablation), and Megatron-LM's own layout, the reference every plan is compared with."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kareus.partition.segments import partition_workload
from kareus.partition.slots import build_slots
from kareus.registry import PARTITIONERS
from kareus.types import SEQUENTIAL, Op, PartitionType, Partitioning, Slot
from kareus.workload.graph import Workload


@dataclass
class SequentialPartitionerConfig:
    name: str = "sequential"
    merge_boundary: bool = True  # as for the nanobatch partitioner, so both share partition keys

    def problems(self, ctx: Any = None) -> list[str]:
        """The partitions are built from one or two nanobatches (two: the nanobatch partitioner's, run
        without overlap)."""
        n = getattr(getattr(ctx, "parallel", None), "nanobatches", 1)
        return [] if n in (1, 2) else [f"parallel.nanobatches: the sequential partitioner needs 1 or 2, got {n}"]


class SequentialPartitioner:
    """No overlap: the search space of each partition is comm SMs x clocks only."""

    def __init__(self, cfg: SequentialPartitionerConfig) -> None:
        self.cfg = cfg

    def partition(self, workload: Workload) -> Partitioning:
        return partition_workload(workload, workload.parallel.nanobatches, with_slots=False,
                                  merge_boundary=self.cfg.merge_boundary, build_slots=build_slots)


@PARTITIONERS.register("sequential", SequentialPartitionerConfig)
def make_sequential(cfg: SequentialPartitionerConfig) -> SequentialPartitioner:
    """No overlap: the same partitions, comm after compute, search over comm SMs x clocks."""
    return SequentialPartitioner(cfg)


MEGATRON_PREFIX = "megatron:"


def megatron_partitioning(workload: Workload, merge_boundary: bool = False) -> Partitioning:
    """Megatron-LM's layout of ``workload``'s model and parallelism: each microbatch unsplit (one
    nanobatch, whatever ``parallel.nanobatches`` says), every comm after its compute but the ones
    megatron-core runs asynchronously beside a column-parallel GEMM's backward: the input gradient's
    all-reduce (reduce-scatter under SP), launched after dgrad with wgrad under it, and under SP the
    re-gather of the GEMM's input, launched with dgrad. Such a partition has one slot, at that wgrad
    or dgrad (see :func:`megatron_slot`); the others have none.

    Splitting a microbatch costs kernel efficiency (smaller kernels, more launches), so a reference
    measured on nanobatched partitions would flatter every plan. Each stage's first chain is its own
    type by default (no merging), so the reference's work is exact. Keys carry ``megatron:`` so these
    measurements stay apart from the searched partitions' in the journal.
    """
    from kareus.workload import build_workload

    unsplit = build_workload(workload.model, dataclasses.replace(workload.parallel, nanobatches=1), workload.gpus_per_node)
    p = partition_workload(unsplit, 1, with_slots=False, merge_boundary=merge_boundary, build_slots=build_slots)
    types = tuple(dataclasses.replace(t, key=MEGATRON_PREFIX + t.key, slots=_megatron_overlap_slot(t.compute, t.comm))
                  for t in p.types)
    work = tuple(dataclasses.replace(w, partitions=tuple((MEGATRON_PREFIX + k, n) for k, n in w.partitions))
                 for w in p.work)
    return Partitioning(types, work)


def _megatron_overlap_slot(chain: tuple[Op, ...], comm: Op) -> tuple[Slot, ...]:
    """Where megatron-core overlaps ``comm`` with the end of ``chain``: the input-gradient all-reduce
    (reduce-scatter under SP) of a column-parallel GEMM runs under that GEMM's wgrad, and under SP the
    re-gather of its input runs under its dgrad. One slot, at that op; otherwise none."""
    if not comm.name.endswith("_bwd") or not chain or comm.name.count("_") < 2:
        return ()
    gemm, kind = comm.name.rsplit("_", 2)[:2]  # qkv_allreduce_bwd -> qkv, allreduce
    at = {"allreduce": f"{gemm}_wgrad", "reducescatter": f"{gemm}_wgrad", "regather": f"{gemm}_dgrad"}.get(kind)
    if at is None or chain[-1].name != at:
        return ()
    slot = build_slots(chain)[-1]
    return (slot,) if slot.ops == (len(chain) - 1,) else ()


def megatron_slot(partition: PartitionType) -> str:
    """Where Megatron-LM launches a ``megatron:`` partition's comm: beside the wgrad it overlaps, or
    after all its compute."""
    return partition.slots[0].label if partition.slots else SEQUENTIAL
