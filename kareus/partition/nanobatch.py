"""Kareus' partitioned overlap: two nanobatches, each one's compute beside the other's comm."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kareus.partition.segments import partition_workload
from kareus.partition.slots import build_slots
from kareus.registry import PARTITIONERS
from kareus.types import Partitioning
from kareus.workload.graph import Workload


@dataclass
class NanobatchPartitionerConfig:
    name: str = "nanobatch"
    # Count a stage's first chain, which lacks only the previous layer's memory-bound ops (its residual
    # add or norm backward), as the full partition type instead of a separate one (as published).
    merge_boundary: bool = True

    def problems(self, ctx: Any = None) -> list[str]:
        """Kareus' partitioned overlap pairs exactly two nanobatches."""
        n = getattr(getattr(ctx, "parallel", None), "nanobatches", 2)
        return [] if n == 2 else [f"parallel.nanobatches: the nanobatch partitioner needs 2, got {n}"]


class NanobatchPartitioner:
    """Splits each microbatch into two nanobatches and forms overlap partitions with launch slots."""

    def __init__(self, cfg: NanobatchPartitionerConfig) -> None:
        self.cfg = cfg

    def partition(self, workload: Workload) -> Partitioning:
        if workload.parallel.nanobatches != 2:
            raise ValueError(f"the nanobatch partitioner needs parallel.nanobatches=2, got {workload.parallel.nanobatches}")
        return partition_workload(workload, 2, with_slots=True, merge_boundary=self.cfg.merge_boundary,
                                  build_slots=build_slots)


@PARTITIONERS.register("nanobatch", NanobatchPartitionerConfig)
def make_nanobatch(cfg: NanobatchPartitionerConfig) -> NanobatchPartitioner:
    """Kareus partitioned overlap of two nanobatches (launch slot x comm SMs x clock)."""
    return NanobatchPartitioner(cfg)
