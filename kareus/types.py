"""Core value types that flow between stages. Frozen and plain, so any stage can hold them safely."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping


class OpKind(str, Enum):
    GEMM = "gemm"
    ATTENTION = "attention"
    NORM = "norm"
    ELEMENTWISE = "elementwise"
    ROPE = "rope"
    COMM = "comm"


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    SEND_RECV = "send_recv"


class Link(str, Enum):
    NVLINK = "nvlink"
    NETWORK = "network"


class Direction(str, Enum):
    FWD = "fwd"
    BWD = "bwd"


@dataclass(frozen=True)
class ModelSpec:
    """Transformer shape, as Megatron-core builds it (GQA, RMSNorm, SwiGLU by default)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = False
    qk_layernorm: bool = False
    norm: str = "rmsnorm"
    activation: str = "swiglu"


@dataclass(frozen=True)
class ParallelSpec:
    """How one model replica is split: tensor, pipeline, context parallelism and the batch shape."""

    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    seq_len: int
    cp: int = 1
    dp: int = 1
    nanobatches: int = 2
    recompute: str = "full"  # "full" | "none"
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    cross_entropy_fusion: bool = False  # Transformer Engine's fused vocab-parallel cross-entropy
    layer_split: tuple[int, ...] | None = None  # layers per stage; None = even split

    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        if self.layer_split:
            return tuple(self.layer_split)
        return (num_layers // self.pp,) * self.pp


@dataclass(frozen=True)
class Op:
    """One kernel of one nanobatch on one GPU (already sharded by tp/cp). Comm ops carry the collective."""

    name: str
    kind: OpKind
    flops: float = 0.0
    bytes: float = 0.0  # HBM bytes read + written
    collective: Collective | None = None
    message_bytes: float = 0.0  # payload of the collective per GPU (the full tensor for all-reduce)
    group_size: int = 1
    link: Link | None = None
    # Kernel shape where the runtime needs it: (m, k, n) for a GEMM, (batch, heads, seq, head_dim) for
    # attention. FLOPs and bytes stay the source of truth for the simulator and the planner.
    shape: tuple[int, ...] | None = None

    @property
    def is_comm(self) -> bool:
        return self.kind is OpKind.COMM


SEQUENTIAL = "sequential"


@dataclass(frozen=True)
class Slot:
    """A launch position: the comm kernel starts just before compute op ``ops[0]`` of the chain.

    ``label`` follows the published naming by op kind and index (``norm_0``, ``linear_1``, ``attn_0``);
    ``kind`` is "memory" (a group of consecutive memory-bound ops), "gemm" or "attention".
    """

    label: str
    ops: tuple[int, ...]
    kind: str

    @property
    def start(self) -> int:
        return self.ops[0]


@dataclass(frozen=True)
class PartitionType:
    """One nanobatch's compute chain beside the other nanobatch's comm kernel.

    Identical partitions across layers (and stages) share one PartitionType and one configuration.
    The comm joins at the end of the chain unless ``join`` names the op after which it is joined.
    """

    key: str
    direction: Direction
    compute: tuple[Op, ...]
    comm: Op
    slots: tuple[Slot, ...]
    join: int | None = None

    @property
    def slot_labels(self) -> tuple[str, ...]:
        return (SEQUENTIAL,) + tuple(s.label for s in self.slots)

    def slot(self, label: str) -> Slot | None:
        """The slot with this label, or None for ``sequential``."""
        if label == SEQUENTIAL:
            return None
        for s in self.slots:
            if s.label == label:
                return s
        raise KeyError(f"partition {self.key!r} has no slot {label!r}; slots: {', '.join(self.slot_labels)}")


@dataclass(frozen=True)
class InstructionWork:
    """What one pipeline instruction (forward or backward of one microbatch on one stage) executes.

    ``partitions`` maps partition key -> occurrences; ``residual`` is the work outside any partition
    (embedding, output layer, loss, pipeline send/recv, compute not paired with a comm op), whose
    ops run sequentially on both nanobatches (already multiplied out).
    """

    stage: int
    direction: Direction
    partitions: tuple[tuple[str, int], ...]
    residual: tuple[Op, ...] = ()

    @property
    def counts(self) -> Mapping[str, int]:
        return dict(self.partitions)


@dataclass(frozen=True)
class Partitioning:
    """The output of a partitioner: the distinct partition types and each instruction's work."""

    types: tuple[PartitionType, ...]
    work: tuple[InstructionWork, ...]

    def type(self, key: str) -> PartitionType:
        for t in self.types:
            if t.key == key:
                return t
        raise KeyError(key)

    def instruction(self, stage: int, direction: Direction) -> InstructionWork:
        for w in self.work:
            if w.stage == stage and w.direction == direction:
                return w
        raise KeyError((stage, direction))


@dataclass(frozen=True, order=True)
class Candidate:
    """One setting of the three knobs for one partition type."""

    partition: str
    slot: str  # a Slot label or SEQUENTIAL
    sms: int
    freq_mhz: int

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.partition, self.slot, self.sms, self.freq_mhz)


@dataclass(frozen=True)
class Reading:
    """One measurement window from a hardware backend: per-execution time and energy."""

    time_s: float
    energy_j: float
    temperature_c: float
    freq_mhz: float
    window_s: float
    executions: int = 1
    ok: bool = True
    error: str = ""


REREAD = "reading:"  # the flag of a search's deliberate re-measurement: ``reading:<k>``, its k-th (k >= 1)


def reading_of(flags: Iterable[str]) -> int:
    """Which reading of its candidate a measurement with ``flags`` is: 0 for the first measurement, k for
    the k-th re-measurement a search asked for (flagged ``reading:<k>``)."""
    return next((int(f[len(REREAD):]) for f in flags if f.startswith(REREAD)), 0)


@dataclass(frozen=True)
class Measurement:
    """A profiled candidate: robust aggregate of its repeats. ``failed`` ones carry no numbers."""

    candidate: Candidate
    time_s: float
    energy_j: float
    dynamic_energy_j: float
    static_power_w: float
    temperature_c: float
    freq_mhz: float
    repeats: int
    failed: bool = False
    flags: tuple[str, ...] = ()
    readings: tuple[Reading, ...] = field(default=(), compare=False, repr=False)

    @property
    def static_energy_j(self) -> float:
        return self.static_power_w * self.time_s

    @classmethod
    def failure(cls, candidate: Candidate, reason: str, readings: tuple[Reading, ...] = ()) -> "Measurement":
        nan = float("nan")
        return cls(candidate, nan, nan, nan, nan, nan, nan, 0, True, (reason,), readings)


@dataclass(frozen=True)
class FrontierPoint:
    time_s: float
    energy_j: float
    payload: Any = field(default=None, compare=False)
