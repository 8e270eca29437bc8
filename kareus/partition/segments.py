"""Cutting a stage's op sequence into partitions: the algorithm both partitioners share.

1. Cut the layers' ops (one nanobatch) at every comm op: segments of compute, each followed by the
   comm op that ends it (the last segment has none).
2. Pair across the two nanobatches, which run interleaved: nanobatch 0's segment k runs beside
   nanobatch 1's comm from segment k-1; nanobatch 1's segment k runs beside nanobatch 0's comm from
   segment k. With one nanobatch a segment simply runs before its own comm (no overlap possible).
3. Compute with no comm beside it (nanobatch 0's first segment, nanobatch 1's last) is residual.
4. Name each segment by what it holds (``attn``, ``qkv``, ``ao``, ``mlp``, ...; the last one
   ``trail``) and group identical (compute chain, comm) pairs into one partition type. Keys are
   ``<dir>_<segment>`` with ``_<ar|ag|rs>`` added where one segment meets several comms, which gives
   the published keys: ``fwd_attn``/``fwd_mlp``/``bwd_mlp``/``bwd_attn`` for TP only and
   ``fwd_qkv_ar``, ``fwd_qkv_ag``, ``fwd_ao_ag``, ``fwd_ao_ar``, ``fwd_mlp``, ``bwd_mlp``, ``bwd_o_ar``,
   ``bwd_o_ag``, ``bwd_a_ag``, ``bwd_a_rs``, ``bwd_qkv_rs``, ``bwd_qkv_ar`` for CP + TP. Under
   sequence parallelism a column-parallel wgrad sits alone between its input's re-gather and its
   input gradient's reduce-scatter: ``mlpw`` (fc1) and ``qkvw``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kareus.types import Collective, Direction, InstructionWork, Op, OpKind, PartitionType, Partitioning, Slot
from kareus.workload.graph import Workload

COMM_ABBREV = {Collective.ALL_REDUCE: "ar", Collective.ALL_GATHER: "ag",
               Collective.REDUCE_SCATTER: "rs", Collective.SEND_RECV: "p2p"}


@dataclass(frozen=True)
class Piece:
    """One nanobatch's compute chain and the other nanobatch's comm beside it (None: nothing beside)."""

    direction: Direction
    segment: str
    chain: tuple[Op, ...]
    comm: Op | None
    first: bool  # the stage's first segment (its chain lacks the ops the previous layer would add)
    nanobatch: int = 0  # whose compute this is
    segment_index: int = 0  # k: the chain is the block's k-th segment (its ops at ``Segment.ops``)


def comm_signature(op: Op) -> tuple:
    """Comm ops are interchangeable when they move the same bytes the same way; names do not matter."""
    return (op.collective, op.message_bytes, op.group_size, op.link)


@dataclass(frozen=True)
class Segment:
    """Where a segment sits in the block's op list: its compute ops and the comm op that ends it."""

    ops: range  # positions of the compute ops
    comm: int | None  # position of the comm op that ends it (None: the block's last segment)


def segments_of(ops: tuple[Op, ...]) -> tuple[list[Segment], list[int]]:
    """Split at comm ops, by position. Returns (segments, positions of stray comms that follow no
    compute: they run sequentially)."""
    segments: list[Segment] = []
    stray: list[int] = []
    start: int | None = None
    for i, op in enumerate(ops):
        if op.is_comm:
            if start is not None:
                segments.append(Segment(range(start, i), i))
                start = None
            else:
                stray.append(i)
        elif start is None:
            start = i
    if start is not None:
        segments.append(Segment(range(start, len(ops)), None))
    return segments, stray


def cut(ops: tuple[Op, ...]) -> tuple[list[tuple[tuple[Op, ...], Op | None]], list[Op]]:
    """Split at comm ops. Returns (segments, stray comms that follow no compute: run sequentially)."""
    segments, stray = segments_of(ops)
    return ([(tuple(ops[i] for i in s.ops), None if s.comm is None else ops[s.comm]) for s in segments],
            [ops[i] for i in stray])


_FWD_RULES: tuple[tuple[str, Callable[[set[str]], bool]], ...] = (
    ("attn", lambda n: "qkv" in n and "attention" in n),
    ("qkv", lambda n: "qkv" in n),
    ("ao", lambda n: "attention" in n),
    ("mlp", lambda n: "fc1" in n or "fc2" in n),
    ("mlp_norm", lambda n: "pre_mlp_norm" in n or "attn_bda" in n),
    ("attn_norm", lambda n: "input_norm" in n or "mlp_bda" in n),
)
_BWD_RULES: tuple[tuple[str, Callable[[set[str]], bool]], ...] = (
    ("mlp", lambda n: "fc1_dgrad" in n or "fc2_dgrad" in n),
    ("attn", lambda n: "attention_bwd" in n and "qkv_dgrad" in n),
    ("a", lambda n: "attention_bwd" in n),
    ("o", lambda n: "attn_proj_dgrad" in n),
    ("qkv", lambda n: "qkv_dgrad" in n),
    ("mlpw", lambda n: "fc1_wgrad" in n),  # SP: a column-parallel wgrad alone, after its input's re-gather
    ("qkvw", lambda n: "qkv_wgrad" in n),
    ("mlp_norm", lambda n: "pre_mlp_norm_bwd" in n or "attn_bda_bwd" in n),
    ("attn_norm", lambda n: "input_norm_bwd" in n or "mlp_bda_bwd" in n),
)


def segment_name(chain: tuple[Op, ...], direction: Direction, last: bool) -> str:
    """``attn``/``mlp`` (TP only), ``qkv``/``ao`` (CP splits attention), ``o``/``a`` (CP backward)..."""
    if last:
        return "trail"
    names = {o.name for o in chain}
    for label, rule in (_FWD_RULES if direction is Direction.FWD else _BWD_RULES):
        if rule(names):
            return label
    return "seg"


def pieces(ops: tuple[Op, ...], direction: Direction, nanobatches: int) -> tuple[list[Piece], list[Op]]:
    """Pair one block's segments across nanobatches. Returns (pieces, residual ops for all nanobatches)."""
    segments, stray = cut(ops)
    residual: list[Op] = []
    for _ in range(nanobatches):
        residual += stray
    out: list[Piece] = []
    n = len(segments)
    if nanobatches == 1:
        for k, (chain, c) in enumerate(segments):
            out.append(Piece(direction, segment_name(chain, direction, c is None and k == n - 1), chain, c, k == 0,
                             0, k))
    elif nanobatches == 2:
        prev: Op | None = None
        for k, (chain, c) in enumerate(segments):
            name = segment_name(chain, direction, c is None and k == n - 1)
            out.append(Piece(direction, name, chain, prev, k == 0, 0, k))
            out.append(Piece(direction, name, chain, c, k == 0, 1, k))
            prev = c
        if prev is not None:  # a block ending in a comm: nanobatch 1's last comm has nothing beside it
            residual.append(prev)
    else:
        raise ValueError(f"partitioning supports 1 or 2 nanobatches, got {nanobatches}")
    paired = []
    for p in out:
        if p.comm is None:
            residual += p.chain
        else:
            paired.append(p)
    return paired, residual


def _scope(op: Op) -> str:
    """Which parallel group a comm op serves, from its name: ``cp``, ``pp`` or ``tp``."""
    return op.name.split("_")[0] if op.name.startswith(("cp_", "pp_")) else "tp"


def _is_memory(op: Op) -> bool:
    return op.kind not in (OpKind.GEMM, OpKind.ATTENTION, OpKind.COMM)


Group = tuple  # (direction, segment name, comm signature): pieces that may share a partition type
Chain = tuple  # tuple[Op, ...]
Instr = dict  # (stage, direction) -> (pieces, residual ops)


def _instruction_pieces(workload: Workload, nanobatches: int) -> Instr:
    """Pieces and residual ops of every (stage, direction) instruction, pre/post ops multiplied out."""
    out: Instr = {}
    for st in workload.stages:
        fwd_p, fwd_r = pieces(st.block_ops(Direction.FWD), Direction.FWD, nanobatches)
        bwd_p, bwd_r = pieces(st.block_ops(Direction.BWD), Direction.BWD, nanobatches)
        out[(st.index, Direction.FWD)] = (fwd_p, list(st.pre_fwd) * nanobatches + fwd_r + list(st.post_fwd) * nanobatches)
        if workload.recompute:  # the backward instruction reruns the forward block first
            bwd_p, bwd_r = fwd_p + bwd_p, fwd_r + bwd_r
        out[(st.index, Direction.BWD)] = (bwd_p, list(st.pre_bwd) * nanobatches + bwd_r + list(st.post_bwd) * nanobatches)
    return out


def _group(p: Piece) -> Group:
    return (p.direction, p.segment, comm_signature(p.comm))


def _canonical(chains: dict[Group, dict[Chain, int]], merge_boundary: bool) -> dict[tuple[Group, Chain], Chain]:
    """Map each chain to the chain its type uses: itself, or (merging) the full chain it is a suffix of
    when the missing leading ops are all memory-bound (a stage's first chain lacks the residual add)."""
    canonical: dict[tuple[Group, Chain], Chain] = {}
    for g, cs in chains.items():
        for c in cs:
            target = c
            if merge_boundary:
                for f in sorted(cs, key=lambda x: -cs[x]):
                    head = f[:len(f) - len(c)]
                    if len(f) > len(c) and f[len(f) - len(c):] == c and all(_is_memory(o) for o in head):
                        target = f
                        break
            canonical[(g, c)] = target
    return canonical


def _keys(chains: dict[Group, dict[Chain, int]], canonical: dict[tuple[Group, Chain], Chain],
          first_only: dict[tuple[Group, Chain], bool], comm_op: dict[Group, Op]) -> dict[tuple[Group, Chain], str]:
    """``<dir>_<segment>``, plus ``_<comm>`` (and ``_<tp|cp>``) when one segment meets several comms,
    plus ``_first`` / ``_v<n>`` for a less frequent chain under the same name."""
    by_seg: dict[tuple[Direction, str], list[Group]] = {}
    for g in chains:
        by_seg.setdefault((g[0], g[1]), []).append(g)
    keys: dict[tuple[Group, Chain], str] = {}
    used: set[str] = set()
    for (d, seg), groups in by_seg.items():
        for g in groups:
            base = f"{d.value}_{seg}"
            if len(groups) > 1:
                base += "_" + COMM_ABBREV[g[2][0]]
                if sum(1 for h in groups if h[2][0] == g[2][0]) > 1:
                    base += "_" + _scope(comm_op[g])
            targets: dict[Chain, int] = {}
            for c, n in chains[g].items():
                t = canonical[(g, c)]
                targets[t] = targets.get(t, 0) + n
            for i, t in enumerate(sorted(targets, key=lambda x: -targets[x])):
                key = base if i == 0 else base + ("_first" if first_only.get((g, t)) else f"_v{i + 1}")
                while key in used:
                    key += "_x"
                used.add(key)
                keys[(g, t)] = key
    return keys


def _keying(instrs: Instr, merge_boundary: bool) -> tuple:
    """Distinct chains per group with occurrence counts, each chain's canonical chain, and the key of
    every (group, canonical chain): what names a piece's partition type."""
    chains: dict[Group, dict[Chain, int]] = {}
    comm_op: dict[Group, Op] = {}
    first_only: dict[tuple[Group, Chain], bool] = {}
    for ps, _ in instrs.values():
        for p in ps:
            g = _group(p)
            chains.setdefault(g, {})
            chains[g][p.chain] = chains[g].get(p.chain, 0) + 1
            comm_op.setdefault(g, p.comm)
            first_only[(g, p.chain)] = first_only.get((g, p.chain), True) and p.first
    canonical = _canonical(chains, merge_boundary)
    return chains, comm_op, first_only, canonical, _keys(chains, canonical, first_only, comm_op)


def piece_keys(workload: Workload, nanobatches: int, merge_boundary: bool) -> dict[tuple[int, Direction], dict[tuple[int, int], str]]:
    """The partition key of every paired piece of each stage's layer block, per (stage, direction):
    ``{(nanobatch, segment index): key}``, keyed exactly as :func:`partition_workload` keys its types,
    so an executor that runs the block's segments finds each one's plan setting by the plan's own key."""
    instrs = _instruction_pieces(workload, nanobatches)
    _, _, _, canonical, keys = _keying(instrs, merge_boundary)
    out: dict[tuple[int, Direction], dict[tuple[int, int], str]] = {}
    for st in workload.stages:
        for d in Direction:
            ps, _ = pieces(st.block_ops(d), d, nanobatches)
            out[(st.index, d)] = {(p.nanobatch, p.segment_index): keys[(_group(p), canonical[(_group(p), p.chain)])]
                                  for p in ps}
    return out


def partition_workload(workload: Workload, nanobatches: int, with_slots: bool, merge_boundary: bool,
                       build_slots: Callable[[tuple[Op, ...]], tuple[Slot, ...]]) -> Partitioning:
    """Cut, pair, group and count; ``with_slots=False`` gives the sequential (no-overlap) variant."""
    instrs = _instruction_pieces(workload, nanobatches)
    chains, comm_op, first_only, canonical, keys = _keying(instrs, merge_boundary)

    # partition types and per-instruction counts, ordered as a layer runs them (fwd first;
    # segments as they first appear; nanobatch 0's piece before nanobatch 1's)
    types: dict[str, PartitionType] = {}
    order: dict[str, tuple[int, int, int, int]] = {}
    seg_order: dict[tuple[Direction, str], int] = {}
    counted: list[tuple[int, Direction, dict[str, int], list[Op]]] = []
    for (stage, direction), (ps, residual) in instrs.items():
        counts: dict[str, int] = {}
        for p in ps:
            g = _group(p)
            t = canonical[(g, p.chain)]
            key = keys[(g, t)]
            if key not in types:
                types[key] = PartitionType(key, p.direction, t, comm_op[g], build_slots(t) if with_slots else ())
            seg = seg_order.setdefault((p.direction, p.segment), len(seg_order))
            rank = (0 if p.direction is Direction.FWD else 1, seg, p.nanobatch, 1 if first_only.get((g, t)) else 0)
            order[key] = min(order.get(key, rank), rank)
            counts[key] = counts.get(key, 0) + 1
        counted.append((stage, direction, counts, residual))
    ranked = sorted(types, key=lambda k: order[k])
    work = [InstructionWork(stage, direction, tuple((k, counts[k]) for k in ranked if k in counts), tuple(residual))
            for stage, direction, counts, residual in counted]
    return Partitioning(tuple(types[k] for k in ranked), tuple(work))


__all__ = ["COMM_ABBREV", "Piece", "Segment", "comm_signature", "cut", "partition_workload", "piece_keys", "pieces",
           "segment_name", "segments_of"]
