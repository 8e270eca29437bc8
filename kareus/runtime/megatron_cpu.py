"""Train megatron-core (0.16) GPTModels on CPU over gloo, for tests and benchmarks (not production).

``cuda_shims`` patches, in this process only, the few places where the pipeline schedules, p2p and the
TP layers assume CUDA; ``init_parallel`` sets up gloo groups, megatron's parallel state and a CPU RNG
tracker; ``tiny_gpt`` builds a small fp32 swiglu/RMSNorm/rope/GQA GPTModel whose weights do not depend
on the TP/PP layout; ``run_steps`` trains it through ``get_forward_backward_func()`` (1F1B for pp > 1).
Nothing in ``kareus`` imports this module (it imports torch and megatron-core at the top).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel import schedules as _schedules
from megatron.core.tensor_parallel import random as _tp_random
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, _get_block_submodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from kareus.train.model import finalize_grads

_CPU = torch.device("cpu")


class _CpuTorch(ModuleType):
    """``torch`` as the schedules module sees it: ``torch.zeros(..., device="cuda")`` lands on CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = _CPU
        return torch.zeros(*args, **kwargs)


def _cpu_current_device() -> torch.device:
    return _CPU


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    return None


# (owner, attribute, replacement, why): the whole list; each was seen failing without it.
_SHIMS: list[tuple[Any, str, Any, str]] = [
    (torch.cuda, "current_device", _cpu_current_device,
     "device= of p2p shape/recv buffers, rope's inv_freq move, the global memory buffer, SP gather buffers"),
    (torch.cuda, "synchronize", _no_op,
     "p2p calls it after batch_isend_irecv (batch_p2p_sync); a waited gloo op is already complete"),
    (_schedules, "torch", _CpuTorch(),
     "every schedule allocates its token counter with torch.zeros([], device='cuda')"),
]
_saved: list[tuple[Any, str, Any]] = []


def install_cuda_shims() -> None:
    """Apply the shims (idempotent)."""
    if _saved:
        return
    for owner, attr, new, _why in _SHIMS:
        _saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)


def uninstall_cuda_shims() -> None:
    """Restore what ``install_cuda_shims`` replaced."""
    while _saved:
        owner, attr, old = _saved.pop()
        setattr(owner, attr, old)


@contextlib.contextmanager
def cuda_shims() -> Iterator[None]:
    """The shims for the duration of a ``with`` block (left installed if they already were)."""
    already = bool(_saved)
    install_cuda_shims()
    try:
        yield
    finally:
        if not already:
            uninstall_cuda_shims()


class CpuRNGStatesTracker(_tp_random.CudaRNGStatesTracker):
    """megatron's RNG tracker over the CPU generator: ``fork(name)`` swaps in ``name``'s CPU RNG state."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name} (seed {seed}) already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def cpu_manual_seed(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` on CPU: megatron's tracker names and seeds, CPU generator states;
    the default CPU generator gets ``seed`` (it drives ``use_cpu_initialization``)."""
    tracker = CpuRNGStatesTracker()
    _tp_random._CUDA_RNG_STATE_TRACKER = tracker
    _tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    add_tracker_states(tracker, seed, ps.get_tensor_model_parallel_rank(),
                       100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank())


def add_tracker_states(tracker: Any, seed: int, tp_rank: int = 0, expert_offset: int = 0) -> None:
    """The states ``model_parallel_cuda_manual_seed`` adds to megatron's RNG tracker, by its names and seeds."""
    tracker.add(_tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + expert_offset)


def shims_installed() -> bool:
    """Whether ``install_cuda_shims`` is in effect in this process."""
    return bool(_saved)


def init_parallel(tp: int, pp: int, cp: int = 1, seed: int = 1234, rank: int | None = None,
                  world_size: int | None = None) -> None:
    """Init torch.distributed over gloo (torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT unless rank and
    world_size are given; a single process needs neither), megatron's parallel state (data parallel size
    = world / (tp * pp * cp)), the CPU RNG tracker, and install the shims for the process."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # only silences a warning of TP linears
    if not torch.distributed.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size,
                                             timeout=datetime.timedelta(minutes=5))
    install_cuda_shims()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, context_parallel_size=cp, create_gloo_process_groups=False)
    cpu_manual_seed(seed)


class _CpuNorm:
    """WrappedTorchNorm without its sequence-parallel refusal: marks the weight ``sequence_parallel`` so
    ``run_steps`` sums its gradient over the TP group (each TP rank normed only its slice of the sequence)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def _swap_norms(spec: Any) -> Any:
    """A copy of a spec with every WrappedTorchNorm replaced by _CpuNorm."""
    if spec is WrappedTorchNorm:
        return _CpuNorm
    if isinstance(spec, list):
        return [_swap_norms(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _swap_norms(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def cpu_norm_spec(config: TransformerConfig, spec: ModuleSpec | TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """This stage's block submodules of ``spec`` with megatron-core's torch norms swapped for ``_CpuNorm``,
    which accepts sequence parallelism (megatron-core's refuses it; Apex's and TE's need a GPU)."""
    return _swap_norms(_get_block_submodules(config, spec))


def _seeded(layer_cls: type, seed: int) -> type:
    """``layer_cls`` reseeding the CPU RNG from ``seed`` and its global layer number before it builds, so a
    layer's weights do not depend on which pipeline stage builds it."""
    if getattr(layer_cls, "_kareus_seeded", False):
        return layer_cls

    def __init__(self: Any, config: TransformerConfig, *args: Any, layer_number: int = 1, **kwargs: Any) -> None:
        offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"))
        torch.manual_seed(seed + 7919 * (layer_number + offset))
        layer_cls.__init__(self, config, *args, layer_number=layer_number, **kwargs)

    return type(layer_cls.__name__, (layer_cls,), {"__init__": __init__, "_kareus_seeded": True})


def tiny_gpt(layer_spec: ModuleSpec | TransformerBlockSubmodules, num_layers: int = 4, hidden: int = 64,
             heads: int = 4, kv_heads: int = 2, ffn: int = 128, vocab: int = 128, seq: int = 16,
             sequence_parallel: bool = False, seed: int = 1234, **config_overrides: Any) -> GPTModel:
    """A small fp32 GPTModel (RMSNorm, swiglu, rope, GQA, no biases, no dropout, untied embeddings) for this
    rank's pipeline stage, initialised on CPU from ``seed``: the same weights for any TP/PP layout, and for
    any spec whose layers create their parameters in the same order. Call ``init_parallel`` first."""
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
        ffn_hidden_size=ffn, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel, **config_overrides)  # megatron's fusions default to off
    block = _get_block_submodules(config, layer_spec)  # this stage's layer specs and the final norm
    block = dataclasses.replace(block, layer_specs=[dataclasses.replace(s, module=_seeded(s.module, seed))
                                                    for s in block.layer_specs])
    if sequence_parallel:  # WrappedTorchNorm (the local spec's, the final norm) refuses it
        block = cpu_norm_spec(config, block)
    torch.manual_seed(seed)  # the embedding's init; each layer reseeds; the output layer follows the last
    return GPTModel(config, block, vocab_size=vocab, max_sequence_length=seq,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy ``src``'s parameters and buffers into ``dst`` by state_dict name (same layout, any spec)."""
    theirs = {k: v for k, v in src.state_dict().items() if not k.endswith("_extra_state")}
    result = dst.load_state_dict(theirs, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    """The mask megatron's local DotProductAttention takes: bool [batch, 1, seq, seq], True = masked out
    (it would build its default on CUDA)."""
    return torch.ones(seq, seq, dtype=torch.bool).triu(1).expand(batch, 1, seq, seq)


def make_batches(count: int, micro_batch_size: int, seq: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` microbatches of token ids [micro_batch_size, seq + 1] from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (micro_batch_size, seq + 1), generator=gen) for _ in range(count)]


def run_steps(model: GPTModel, batches: Sequence[torch.Tensor] | None, steps: int, lr: float,
              num_microbatches: int, micro_batch_size: int, seq: int,
              optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``steps`` iterations of ``num_microbatches`` microbatches through ``get_forward_backward_func()``.

    ``batches``: token tensors [micro_batch_size, seq + 1] (inputs and shifted labels), the same on every
    rank, taken in turn and cycled (None: ``make_batches(steps * num_microbatches, ...)``, seed 0).
    Returns the per-step losses (mean over microbatches) on the last pipeline stage ([] elsewhere) and
    this rank's step-0 gradients (TP shards, after DP/SP reduction) by parameter name."""
    if batches is None:
        batches = make_batches(steps * num_microbatches, micro_batch_size, seq, model.vocab_size)
    model.config.finalize_model_grads_func = finalize_grads
    mask, positions = causal_mask(micro_batch_size, seq), torch.arange(seq).expand(micro_batch_size, seq)
    opt = optimizer([p for p in model.parameters() if p.requires_grad], lr=lr)
    forward_backward = get_forward_backward_func()

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # clone: the schedule divides ``loss`` in place

    def forward_step(data: Iterator[torch.Tensor], m: GPTModel) -> tuple[torch.Tensor, Callable[..., Any]]:
        tokens = next(data)
        return m(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]), loss_func

    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    model.train()
    with cuda_shims():
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            first = step * num_microbatches
            out = forward_backward(
                forward_step_func=forward_step, model=model, num_microbatches=num_microbatches,
                data_iterator=(batches[(first + i) % len(batches)] for i in range(num_microbatches)),
                seq_length=seq, micro_batch_size=micro_batch_size, forward_only=False)
            if step == 0:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            if ps.is_pipeline_last_stage():
                losses.append(float(torch.stack([o["loss"] for o in out]).mean()))
    return losses, grads
