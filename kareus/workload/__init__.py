"""Workload graph: per-stage forward/backward op sequences of a Megatron-core GPT (see graph.py)."""
from kareus.workload.graph import GPUS_PER_NODE, StageWorkload, Workload, build_workload, pp_link
from kareus.workload.layer import ATTENTION_BWD_FACTOR
from kareus.workload.shapes import BYTES, Shard, make_shard, padded_vocab_size

__all__ = [
    "ATTENTION_BWD_FACTOR", "BYTES", "GPUS_PER_NODE", "Shard", "StageWorkload", "Workload",
    "build_workload", "make_shard", "padded_vocab_size", "pp_link",
]
