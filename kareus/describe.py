"""``mode=describe``: print what a run would search, before anything is measured."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kareus.types import Direction, Op, OpKind, Partitioning

if TYPE_CHECKING:
    from rich.console import Console

    from kareus.workload.graph import Workload


def _g(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.2f}"


def _comm(op: Op) -> str:
    return f"{op.collective.value} {_mb(op.message_bytes)} MB x{op.group_size} {op.link.value if op.link else ''}".strip()


def _layer_table(workload: "Workload", direction: Direction):
    from rich.table import Table

    st = workload.stages[0]
    t = Table(title=f"One layer, {direction.value} (one nanobatch, one GPU)")
    for col in ("op", "kind", "GFLOP", "HBM MB", "comm"):
        t.add_column(col, justify="left" if col in ("op", "kind", "comm") else "right")
    for op in st.layer_ops(direction):
        t.add_row(op.name, op.kind.value, "" if op.is_comm else _g(op.flops), "" if op.is_comm else _mb(op.bytes),
                  _comm(op) if op.is_comm else "")
    return t


def describe(console: "Console", workload: "Workload", partitioning: Partitioning,
             space_sizes: dict[str, int] | None = None, slots: dict[str, list[str]] | None = None) -> None:
    """Print stages, one layer's ops, the partition types with slots and counts, and the search space.
    ``slots``: the launch slots each partition's search keeps (``search.space.slots``); default all."""
    from rich.table import Table

    m, p = workload.model, workload.parallel
    sh = workload.shard
    console.print(
        f"[bold]{m.name}[/bold]: {m.num_layers} layers, hidden {m.hidden_size}, ffn {m.ffn_hidden_size}, "
        f"{m.num_attention_heads} heads / {m.num_kv_heads} kv, vocab {m.vocab_size}\n"
        f"tp={p.tp} cp={p.cp} pp={p.pp} dp={p.dp}, micro-batch {p.micro_batch_size} x {p.num_microbatches}, "
        f"seq {p.seq_len}, {p.nanobatches} nanobatches of {sh.sequences} sequences ({sh.tokens} tokens per GPU), "
        f"recompute={p.recompute}, sequence_parallel={p.sequence_parallel}\n"
        f"one microbatch: {workload.microbatch_flops() / 1e12:,.1f} TFLOP over all GPUs "
        f"({workload.microbatch_flops((OpKind.GEMM, OpKind.ATTENTION)) / 1e12:,.1f} in GEMM and attention)"
    )

    stages = Table(title="Pipeline stages")
    for col in ("stage", "layers", "GPUs", "before the layers (fwd)", "after the layers (fwd)"):
        stages.add_column(col)
    for st in workload.stages:
        stages.add_row(str(st.index), f"{st.layers} ({st.first_layer}-{st.first_layer + st.layers - 1})", str(st.gpus),
                       ", ".join(o.name for o in st.pre_fwd), ", ".join(o.name for o in st.post_fwd))
    console.print(stages)
    console.print(_layer_table(workload, Direction.FWD))
    console.print(_layer_table(workload, Direction.BWD))

    instrs = [(w.stage, w.direction) for w in partitioning.work]
    types = Table(title="Partition types (compute of one nanobatch beside the other's comm)")
    for col in ("key", "compute chain", "comm", "slots"):
        types.add_column(col)
    for s, d in instrs:
        types.add_column(f"s{s} {d.value}", justify="right")
    types.add_column("search space", justify="right")
    for t in partitioning.types:
        counts = [str(partitioning.instruction(s, d).counts.get(t.key, "")) for s, d in instrs]
        size = (space_sizes or {}).get(t.key)
        labels = (slots or {}).get(t.key, list(t.slot_labels))
        types.add_row(t.key, " > ".join(o.name for o in t.compute), _comm(t.comm), ", ".join(labels),
                      *counts, f"{size:,}" if size is not None else f"{len(labels)} slots")
    console.print(types)

    resid = Table(title="Residual work per instruction (sequential, both nanobatches)")
    for col in ("instruction", "ops", "GFLOP", "comm MB"):
        resid.add_column(col, justify="right" if col != "instruction" else "left")
    for w in partitioning.work:
        resid.add_row(f"stage {w.stage} {w.direction.value}", str(len(w.residual)),
                      _g(sum(o.flops for o in w.residual)), _mb(sum(o.message_bytes for o in w.residual)))
    console.print(resid)
    if space_sizes:
        console.print(f"total search space: {sum(space_sizes.values()):,} candidates over {len(space_sizes)} partitions")
