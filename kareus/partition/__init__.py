"""Partitioners: turn a workload graph into partition types and per-instruction work.

Importing this package registers ``nanobatch`` and ``sequential`` in ``kareus.registry.PARTITIONERS``.
"""
from kareus.partition.nanobatch import NanobatchPartitioner, NanobatchPartitionerConfig
from kareus.partition.segments import COMM_ABBREV, comm_signature, cut, partition_workload, pieces, segment_name
from kareus.partition.sequential import (MEGATRON_PREFIX, SequentialPartitioner, SequentialPartitionerConfig,
                                        megatron_partitioning)
from kareus.partition.slots import build_slots, slot_group

__all__ = [
    "COMM_ABBREV", "MEGATRON_PREFIX", "NanobatchPartitioner", "NanobatchPartitionerConfig", "SequentialPartitioner",
    "SequentialPartitionerConfig", "build_slots", "comm_signature", "cut", "partition_workload", "pieces",
    "megatron_partitioning", "segment_name", "slot_group",
]
