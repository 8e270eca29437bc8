"""Launch slots of a compute chain, named the way the published partitions name them.

Each op belongs to a slot group (``norm``, ``rope``, ``activation``, ``elementwise``: memory-bound;
``linear``, ``attn``: compute-bound). Consecutive memory-bound ops of the same group share one slot
(launching the comm before any of them is nearly the same); every GEMM and attention kernel gets its
own slot. Labels are ``<group>_<index>`` counted per group: ``norm_0``, ``linear_0``, ``rope_0``,
``attn_0``, ``linear_1``, ...
"""
from __future__ import annotations

from kareus.types import Op, OpKind, Slot
from kareus.workload.ops import ACTIVATIONS

MEMORY_GROUPS = frozenset({"norm", "rope", "activation", "elementwise"})


def slot_group(op: Op) -> str:
    """The slot group of one compute op; residual adds sit with norms, qk-norm with rotary (QKV post-processing)."""
    if op.kind is OpKind.GEMM:
        return "linear"
    if op.kind is OpKind.ATTENTION:
        return "attn"
    if op.kind is OpKind.ROPE or op.name.startswith("qk_norm"):
        return "rope"
    if op.kind is OpKind.NORM or "bda" in op.name:
        return "norm"
    if op.name.removesuffix("_bwd") in ACTIVATIONS:
        return "activation"
    if op.kind is OpKind.COMM:
        raise ValueError(f"comm op {op.name!r} inside a compute chain")
    return "elementwise"


def build_slots(chain: tuple[Op, ...]) -> tuple[Slot, ...]:
    slots: list[Slot] = []
    counters: dict[str, int] = {}
    prev: str | None = None
    current: list[int] = []
    for i, op in enumerate(chain):
        group = slot_group(op)
        if group in MEMORY_GROUPS and group == prev:
            current.append(i)
            slots[-1] = Slot(slots[-1].label, tuple(current), "memory")
            continue
        n = counters.get(group, 0)
        counters[group] = n + 1
        kind = "memory" if group in MEMORY_GROUPS else ("attention" if group == "attn" else "gemm")
        current = [i]
        slots.append(Slot(f"{group}_{n}", (i,), kind))
        prev = group if group in MEMORY_GROUPS else None
    return tuple(slots)
