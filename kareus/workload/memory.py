"""Parameters and activations each GPU holds, per pipeline stage: the least memory a layout needs.

A layout whose weights and gradients alone overflow a GPU cannot train, however the rest is set up;
planning it would produce plans nobody can run. Counts follow megatron-core's GPT layers: fused QKV
(GQA), the attention output projection and the MLP (SwiGLU: three matrices, GELU: two) are split
over tp; the norms are replicated; the embedding sits on the first stage and the output layer on the
last (one matrix when the two are tied on a single stage), the vocabulary padded as Megatron pads it.

Activations add the least any recompute setting keeps. Full recompute in chunks of ``c`` layers
(megatron-core's uniform method, ``recompute_num_layers=c``) keeps each chunk's input for every
microbatch in flight (1F1B holds ``pp - stage`` of them on a stage at its peak), and while one chunk
is recomputed for its backward, the inputs of its other ``c - 1`` layers beside them (besides
everything else those layers save). The bound takes the chunk size that keeps least; less recompute
keeps more.
"""
from __future__ import annotations

from typing import Any

from kareus.workload.ops import mlp_width
from kareus.workload.shapes import BYTES, padded_vocab_size

# bf16 weights and bf16 gradients: below any Megatron setup (fp32 main gradients and the Adam states,
# sharded or offloaded, only add to it), so a layout above it is refused without a doubt
BYTES_PER_PARAMETER_AT_LEAST = 4


def layer_parameters(model: Any) -> tuple[int, int]:
    """(split over tp, replicated) parameters of one transformer layer."""
    h = model.hidden_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    mats = 1 + mlp_width(_value(model.activation))  # FC1 (SwiGLU's gate and up) and FC2
    split = h * (q + 2 * kv) + q * h + mats * h * model.ffn_hidden_size
    qk_norms = 2 * norm_parameters(model, model.head_dim) if model.qk_layernorm else 0
    replicated = 2 * norm_parameters(model, h) + qk_norms
    return split, replicated


def norm_parameters(model: Any, width: int) -> int:
    """One norm's parameters: a scale, and a LayerNorm's bias beside it."""
    return width * (2 if _value(model.norm) == "layernorm" else 1)


def _value(field: Any) -> str:
    return str(getattr(field, "value", field))


def stage_layers(model: Any, parallel: Any) -> list[int]:
    """Transformer layers of each pipeline stage: ``parallel.layer_split``, or an even split."""
    return list(parallel.layer_split) if parallel.layer_split else [model.num_layers // parallel.pp] * parallel.pp


def stage_parameters(model: Any, parallel: Any) -> list[float]:
    """Parameters on one GPU of each pipeline stage (``parallel.layer_split`` or an even split)."""
    split = stage_layers(model, parallel)
    per_layer, replicated = layer_parameters(model)
    embedding = padded_vocab_size(model.vocab_size, parallel.tp) * model.hidden_size / parallel.tp
    out = []
    for i, layers in enumerate(split):
        n = layers * (per_layer / parallel.tp + replicated)
        if i == 0:
            n += embedding
        if i == len(split) - 1:
            n += norm_parameters(model, model.hidden_size)  # the final norm
            if not (model.tied_embeddings and len(split) == 1):
                n += embedding  # the output layer (a copy of the embedding when tied across stages)
        out.append(n)
    return out


def in_flight(parallel: Any, stage: int) -> int:
    """Microbatches whose activations a stage holds at its 1F1B peak."""
    return min(parallel.pp - stage, parallel.num_microbatches)


def least_layer_inputs(layers: int, microbatches: int) -> tuple[int, int]:
    """(layer inputs held at the peak, the chunk size that holds them) of full recompute over ``layers``
    layers in chunks of the size that keeps least: each chunk's input per microbatch in flight, plus the
    other layers' inputs of the one chunk being recomputed."""
    if layers <= 0:
        return 0, 0
    return min((-(-layers // c) * microbatches + c - 1, c) for c in range(1, layers + 1))


def stage_activation_bytes(model: Any, parallel: Any) -> list[float]:
    """Bytes of layer inputs on one GPU of each stage at its 1F1B peak under the least-keeping full
    recompute (``least_layer_inputs``): bf16 [seq / cp (/ tp under sequence parallelism), micro-batch,
    hidden] each."""
    split = stage_layers(model, parallel)
    sp = parallel.tp if parallel.sequence_parallel and parallel.tp > 1 else 1
    per_layer = parallel.seq_len / parallel.cp / sp * parallel.micro_batch_size * model.hidden_size * BYTES
    return [least_layer_inputs(layers, in_flight(parallel, i))[0] * per_layer for i, layers in enumerate(split)]


def memory_problem(model: Any, parallel: Any, gpu_name: str, memory_gb: float) -> str | None:
    """Why the layout cannot fit the GPU's memory (None if it may)."""
    params = stage_parameters(model, parallel)
    most = max(params)
    need_gb = most * BYTES_PER_PARAMETER_AT_LEAST / 1e9
    where = f"{model.name} on tp={parallel.tp} pp={parallel.pp}"
    if need_gb > memory_gb:
        return (f"parallel: {where} puts {most / 1e9:.1f} B parameters on a GPU, at least {need_gb:.0f} GB for bf16 "
                f"weights and gradients alone, more than {gpu_name}'s {memory_gb:g} GB; raise parallel.tp or parallel.pp")
    acts = stage_activation_bytes(model, parallel)
    totals = [n * BYTES_PER_PARAMETER_AT_LEAST / 1e9 + a / 1e9 for n, a in zip(params, acts)]
    stage = max(range(len(totals)), key=totals.__getitem__)
    if totals[stage] <= memory_gb:
        return None
    # more stages rarely help: the first stage's layers shrink as its microbatches in flight grow
    # (up to num_microbatches); fewer layers on the fullest stage do
    sp_hint = ", shard them over tp with parallel.sequence_parallel=true" if (
        parallel.tp > 1 and not parallel.sequence_parallel) else ""
    chunk = least_layer_inputs(stage_layers(model, parallel)[stage], in_flight(parallel, stage))[1]
    return (f"parallel: {where} keeps at least {acts[stage] / 1e9:.0f} GB of layer inputs for "
            f"{in_flight(parallel, stage)} microbatches in flight on stage {stage} (full recompute in chunks of "
            f"{chunk} layers, the least any chunking keeps), "
            f"{totals[stage]:.0f} GB with its weights and gradients, more than {gpu_name}'s {memory_gb:g} GB; "
            f"lower parallel.micro_batch_size or parallel.seq_len, raise parallel.cp{sp_hint}, or give stage "
            f"{stage} fewer layers with parallel.layer_split")
