"""The Megatron baseline: same partitions and counts, but every comm runs after its compute (no slots)."""
from __future__ import annotations

from dataclasses import dataclass

from kareus.partition.segments import partition_workload
from kareus.partition.slots import build_slots
from kareus.registry import PARTITIONERS
from kareus.types import Partitioning
from kareus.workload.graph import Workload


@dataclass
class SequentialPartitionerConfig:
    name: str = "sequential"
    merge_boundary: bool = True  # as for the nanobatch partitioner, so both share partition keys


class SequentialPartitioner:
    """No overlap: the search space of each partition is comm SMs x clocks only."""

    def __init__(self, cfg: SequentialPartitionerConfig) -> None:
        self.cfg = cfg

    def partition(self, workload: Workload) -> Partitioning:
        return partition_workload(workload, workload.parallel.nanobatches, with_slots=False,
                                  merge_boundary=self.cfg.merge_boundary, build_slots=build_slots)


@PARTITIONERS.register("sequential", SequentialPartitionerConfig)
def make_sequential(cfg: SequentialPartitionerConfig) -> SequentialPartitioner:
    """No overlap (Megatron baseline): comm after compute, search over comm SMs x clocks."""
    return SequentialPartitioner(cfg)
