"""The per-GPU shard of one nanobatch: tokens, heads and widths after tp/cp/sp sharding.

Every op size in the workload graph derives from these few numbers, so they live in one place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kareus.types import ModelSpec, ParallelSpec

BYTES = 2  # bf16 activations and weights
VOCAB_DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron pads the vocabulary to a multiple of ``divisible_by * tp`` so the output layer shards evenly."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class Shard:
    """Sizes of one nanobatch on one GPU (tp/cp shard)."""

    sequences: int  # sequences in one nanobatch
    seq_len: int  # full sequence length
    tokens: int  # tokens this GPU holds: sequences * seq_len / cp
    sp_tokens: int  # tokens outside the tp region (tokens / tp under sequence parallelism, else tokens)
    hidden: int
    ffn_local: int  # ffn width per GPU (one half of the SwiGLU FC1 output)
    q_local: int  # query width per GPU: heads / tp * head_dim
    kv_local: int  # key (= value) width per GPU: kv heads / tp * head_dim
    heads_local: int
    vocab_local: int  # padded vocabulary / tp
    tp: int
    cp: int

    @property
    def kv_tokens(self) -> int:
        """Tokens of K/V the attention reads: the whole sequence once context parallelism gathers it."""
        return self.sequences * self.seq_len

    @property
    def causal_pairs(self) -> float:
        """Query-key pairs this GPU scores with a causal mask (load-balanced across cp ranks)."""
        return self.sequences * self.seq_len * self.seq_len / (2 * self.cp)


def make_shard(model: ModelSpec, parallel: ParallelSpec) -> Shard:
    """Check divisibility and compute the shard; errors name the offending fields."""
    tp, cp, nb = parallel.tp, parallel.cp, parallel.nanobatches
    problems = []
    if parallel.micro_batch_size % nb:
        problems.append(f"micro_batch_size {parallel.micro_batch_size} is not divisible by nanobatches {nb}")
    if parallel.seq_len % cp:
        problems.append(f"seq_len {parallel.seq_len} is not divisible by cp {cp}")
    for name, value in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", model.num_kv_heads),
                        ("ffn_hidden_size", model.ffn_hidden_size)):
        if value % tp:
            problems.append(f"{name} {value} is not divisible by tp {tp}")
    tokens = parallel.micro_batch_size // nb * parallel.seq_len // cp
    if parallel.sequence_parallel and (parallel.seq_len // cp) % tp:  # each sequence is scattered over tp
        problems.append(f"a sequence's tokens per GPU {parallel.seq_len // cp} are not divisible by tp {tp} "
                        "(sequence parallel)")
    split = parallel.layers_per_stage(model.num_layers)
    if len(split) != parallel.pp or sum(split) != model.num_layers or min(split) < 1:
        problems.append(f"layers per stage {split} do not split {model.num_layers} layers over pp={parallel.pp}")
    if parallel.recompute not in ("full", "none"):
        problems.append(f"recompute must be 'full' or 'none', got {parallel.recompute!r}")
    if problems:
        raise ValueError("cannot build the workload: " + "; ".join(problems))
    return Shard(
        sequences=parallel.micro_batch_size // nb,
        seq_len=parallel.seq_len,
        tokens=tokens,
        sp_tokens=tokens // tp if parallel.sequence_parallel else tokens,
        hidden=model.hidden_size,
        ffn_local=model.ffn_hidden_size // tp,
        q_local=model.num_attention_heads // tp * model.head_dim,
        kv_local=model.num_kv_heads // tp * model.head_dim,
        heads_local=model.num_attention_heads // tp,
        vocab_local=padded_vocab_size(model.vocab_size, tp) // tp,
        tp=tp,
        cp=cp,
    )
