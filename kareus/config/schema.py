"""Typed schemas of the sections the core owns: model, parallel layout, and the top level.

Component sections (hardware, search, profiler, compose, launcher, plan, tracking, partitioner) are
typed by the schema their own option file selects (see kareus/config/store.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING

from kareus.types import ModelSpec, ParallelSpec


class Mode(str, Enum):
    run = "run"  # search, compose, plan: the whole pipeline
    describe = "describe"  # print stages, ops, partitions and search-space sizes; measure nothing
    search = "search"  # partition searches only
    train = "train"  # real megatron-core training with a plan applied, measured (under torchrun)
    reset = "reset"  # give back the GPU clocks that Kareus processes locked on this node
    check = "check"  # re-measure a run's settings and flag the partitions that drifted (exit 3)


class Recompute(str, Enum):
    full = "full"
    none = "none"


class Norm(str, Enum):
    rmsnorm = "rmsnorm"
    layernorm = "layernorm"


class Activation(str, Enum):
    swiglu = "swiglu"
    gelu = "gelu"


def _plain(cfg: Any) -> dict[str, Any]:
    """A schema's fields with enums as their values: the keyword arguments of its frozen spec."""
    return {f.name: (v.value if isinstance(v := getattr(cfg, f.name), Enum) else v) for f in fields(cfg)}


@dataclass
class ModelConfig:
    """A transformer's shape. Add a model by dropping a YAML file with these keys into --config-dir/model."""

    name: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int = MISSING
    vocab_size: int = MISSING
    tied_embeddings: bool = False
    qk_layernorm: bool = False
    norm: Norm = Norm.rmsnorm
    activation: Activation = Activation.swiglu

    def spec(self) -> ModelSpec:
        return ModelSpec(**_plain(self))


@dataclass
class ParallelConfig:
    """Megatron's parallel layout and batch shape for one model replica."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    seq_len: int = 4096
    nanobatches: int = 2
    recompute: Recompute = Recompute.full
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    # megatron-core's --cross-entropy-loss-fusion with --cross-entropy-fusion-impl te (the published
    # Kareus setup uses it); off: megatron-core's default, the unfused vocab-parallel cross-entropy
    cross_entropy_fusion: bool = False
    layer_split: Optional[list[int]] = None  # layers per stage; None splits evenly

    def spec(self) -> ParallelSpec:
        kwargs = _plain(self)
        kwargs["layer_split"] = tuple(self.layer_split) if self.layer_split else None
        return ParallelSpec(**kwargs)


@dataclass
class TrainConfig:
    """``mode=train``: which plan to run and how long; ``compare`` alternates it with Megatron's layout."""

    plan: Optional[str] = None  # a plan file, a run directory (its plan_selected.yaml), or megatron
    iterations: int = 10  # measured iterations (per layout with compare), after the warm-up
    warmup: int = 2  # iterations run first and left out of every number
    compare: bool = False  # the plan and Megatron's layout in alternating blocks (A B A B ...)
    blocks: int = 4  # blocks per layout with compare; iterations are spread over them
    lr: float = 1.0e-4  # the optimizer's (AdamW) learning rate
    device: str = "auto"  # auto (cuda where torch sees a GPU) | cuda | cpu
    comm: str = "nccl"  # nccl | mscclpp: the library of the plan's TP collectives on GPUs (gloo on the CPU)
    data_seed: int = 1234  # megatron-core's mock GPT dataset


@dataclass
class CheckConfig:
    """``mode=check``: which run to check and how hard (see kareus.check)."""

    run: Optional[str] = None  # the run directory whose journal (and plan_selected.yaml) is checked
    samples: int = 4  # settings re-measured per partition: the selected plan's first, then along the front
    repeats: int = 3  # fresh readings per setting, in rounds (their spread is the noise the test uses)
    alpha: float = 0.01  # chance of flagging anything when nothing drifted (over all partitions)
    min_shift: float = 0.01  # and the relative shift a flagged partition must exceed
    seed: int = 1  # the fresh windows' noise stream on a simulated GPU (another check: another seed)


@dataclass
class ResetConfig:
    """``mode=reset``: the GPUs whose clocks a Kareus process locked (its state file), or all of them."""

    all: bool = False


@dataclass
class KareusConfig:
    """The whole run. ``model`` is deliberately not defaulted: every run names its model."""

    mode: Mode = Mode.run
    seed: int = 0
    progress: bool = True  # rich progress display (plain lines when stdout is not a terminal)
    resume: Optional[str] = None  # a previous run directory whose journal to continue
    model: Optional[ModelConfig] = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: Any = MISSING
    partitioner: Any = MISSING
    search: Any = MISSING
    profiler: Any = MISSING
    compose: Any = MISSING
    launcher: Any = MISSING
    plan: Any = MISSING
    tracking: Any = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    reset: ResetConfig = field(default_factory=ResetConfig)
