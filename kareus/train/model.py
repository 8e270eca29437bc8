"""A megatron-core GPTModel of a Kareus model and layout, megatron-core's mock GPT data, and the
forward step and gradient finalisation the training loop hands megatron-core's schedule.

The model is built with Kareus' layer spec (:func:`kareus.runtime.partitioned.layer_spec`): its
parameters are megatron-core's, and each instruction runs the plan's partitions or, for Megatron's
layout, megatron-core's own layer forward. Dropout is 0 (Llama-family pre-training): with dropout the
two nanobatches draw their masks in another order than one unsplit microbatch, so a plan and Megatron's
layout would train on different masks (each equally valid).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from kareus.types import ModelSpec, ParallelSpec


def transformer_config(model: ModelSpec, parallel: ParallelSpec, dtype: Any, cpu: bool) -> Any:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_kv_heads, kv_channels=model.head_dim,
        normalization="RMSNorm" if model.norm == "rmsnorm" else "LayerNorm", qk_layernorm=model.qk_layernorm,
        gated_linear_unit=model.activation == "swiglu", activation_func=F.silu if model.activation == "swiglu" else F.gelu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=cpu,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp, sequence_parallel=bool(parallel.sequence_parallel and parallel.tp > 1))


def build_gpt(model: ModelSpec, parallel: ParallelSpec, layer_spec: Any, dtype: Any, cpu: bool) -> Any:
    """This rank's stage of the GPTModel. Input and output embeddings are tied as the model says when one
    stage holds both; across stages they are trained untied (their gradient all-reduce is megatron's DDP's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(model, parallel, dtype, cpu)
    if cpu and config.sequence_parallel:  # megatron-core's torch norm refuses SP; the CPU stand-in marks its weights
        from kareus.runtime.megatron_cpu import cpu_norm_spec

        layer_spec = cpu_norm_spec(config, layer_spec)  # the whole block: the final norm too
    gpt = GPTModel(config, layer_spec, vocab_size=model.vocab_size, max_sequence_length=parallel.seq_len,
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                   position_embedding_type="rope",
                   share_embeddings_and_output_weights=model.tied_embeddings and parallel.pp == 1)
    return gpt.to(dtype) if not cpu else gpt


def mock_batches(model: ModelSpec, parallel: ParallelSpec, seed: int, device: Any) -> Iterator[dict]:
    """Microbatches of megatron-core's MockGPTDataset for this data-parallel rank, forever, on ``device``.

    The dataset is built here, on every rank together (its builder holds a barrier), not at the first
    microbatch: a later pipeline stage draws its first one only after the stage before it sent."""
    from megatron.core import parallel_state as ps

    dataset = _mock_dataset(model.vocab_size, parallel.seq_len, seed)
    return _batches(dataset, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
                    parallel.micro_batch_size, device)


def _batches(dataset: Any, dp: int, rank: int, b: int, device: Any) -> Iterator[dict]:
    import torch

    step = 0
    while True:
        first = (step * dp + rank) * b
        samples = [dataset[(first + i) % len(dataset)] for i in range(b)]
        batch = {k: torch.stack([s[k] for s in samples]).to(device) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        batch["attention_mask"] = torch.stack([s["attention_mask"] for s in samples]).to(device)  # bool, True = masked
        step += 1
        yield batch


def _mock_dataset(vocab: int, seq_len: int, seed: int) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset

    class Documents(MockGPTLowLevelDataset):
        size = 4096  # documents: enough for any run here, and its sample index builds in a blink
        max_sequence_length = max(2, 2 * seq_len)

    class Mock(MockGPTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path: Any, config: Any) -> Any:
            return Documents(config.tokenizer)

    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, tokenizer=_NullTokenizer(vocab),
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, split="1,0,0")
    train, _, _ = BlendedMegatronDatasetBuilder(Mock, [4096, None, None], lambda: True, cfg).build()
    return train


class _NullTokenizer:
    """What the mock dataset asks of a tokenizer: the vocabulary's size and an end-of-document token."""

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab
        self.eod = vocab - 1
        self.pad = vocab - 1
        self.unique_identifiers = {"class": "kareus-null", "vocab_size": vocab}


def forward_step() -> Callable[[Iterator[dict], Any], tuple[Any, Callable]]:
    """megatron-core's ``forward_step_func``: the model's per-token losses, averaged over the loss mask."""

    def loss_func(loss_mask: Any, output: Any) -> tuple[Any, dict]:
        mask = loss_mask.reshape(-1).float()
        loss = (output.float().reshape(-1) * mask).sum() / mask.sum().clamp_min(1.0)
        return loss, {"loss": loss.detach().clone()}  # clone: the schedule divides ``loss`` in place

    def step(data: Iterator[dict], model: Any) -> tuple[Any, Callable]:
        batch = next(data)
        out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return out, lambda output: loss_func(batch["loss_mask"], output)

    return step


def finalize_grads(model: list, num_tokens: Any = None, **_: Any) -> None:
    """megatron-core's finalize step without its DDP wrapper: average gradients over data-parallel
    ranks, and sum those of sequence-parallel norm weights over the tensor-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp, tp = ps.get_data_parallel_group(with_context_parallel=True), ps.get_tensor_model_parallel_group()
    for chunk in model:
        sp = chunk.config.sequence_parallel
        for p in chunk.parameters():
            if p.grad is None:
                continue
            if dp.size() > 1:
                dist.all_reduce(p.grad, group=dp)
                p.grad /= dp.size()
            if sp and tp.size() > 1 and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=tp)
