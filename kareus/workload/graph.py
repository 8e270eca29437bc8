"""The workload graph: per pipeline stage, the ops of one nanobatch's forward and backward.

A stage runs ``pre`` ops, its transformer layers, then ``post`` ops, in each direction. Layers are
identical, so each stage stores one layer's ops and a count. Sizes are per GPU (tp/cp shard) and per
nanobatch; the stage's ``gpus`` (tp * cp) run the same ops in lockstep.

Placement rule for links: ranks follow Megatron's default order (tp fastest, then cp, dp, pp), a node
holds ``gpus_per_node`` GPUs. A tp or cp group stays on NVLink while it fits in one node; a pipeline
boundary uses the network when the two stages' ranks sit on different nodes (with dp = 1 and
tp * cp = 8: every boundary).

A pipeline transfer is one point-to-point exchange: the receiver's recv runs while the sender's send
does, and completes with it. It is charged once, to the sending stage (its ``post`` ops); the receiving
instruction starts when that send ends (the schedule's cross-stage edge). Charging the receiver a recv
of its own as well put every transfer on the critical path twice. In 1F1B's steady state Megatron
batches a stage's send with its next receive (``send_forward_recv_backward``), so a stage's own
timeline also holds one exchange per transfer.
"""
from __future__ import annotations

from dataclasses import dataclass

from kareus.types import Collective, Direction, Link, ModelSpec, Op, OpKind, ParallelSpec
from kareus.workload.layer import layer_backward, layer_forward
from kareus.workload.ops import NORM_FLOPS, comm, gemm, memory
from kareus.workload.shapes import BYTES, Shard, make_shard

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class StageWorkload:
    """One pipeline stage: ``layers`` identical layers between its pre and post ops (one nanobatch)."""

    index: int
    layers: int
    first_layer: int
    gpus: int  # GPUs of this stage in one model replica (tp * cp)
    pre_fwd: tuple[Op, ...]  # embedding (first stage); a receive is the sender's transfer
    layer_fwd: tuple[Op, ...]
    post_fwd: tuple[Op, ...]  # final norm, output layer, loss (last stage) or pipeline send
    pre_bwd: tuple[Op, ...]  # loss/output/final-norm backward (last stage); a receive is the sender's
    layer_bwd: tuple[Op, ...]
    post_bwd: tuple[Op, ...]  # embedding backward (first stage) or gradient send

    def layer_ops(self, direction: Direction) -> tuple[Op, ...]:
        return self.layer_fwd if direction is Direction.FWD else self.layer_bwd

    def block_ops(self, direction: Direction) -> tuple[Op, ...]:
        """All layers of this stage in execution order (one nanobatch)."""
        return self.layer_ops(direction) * self.layers


@dataclass(frozen=True)
class Workload:
    """Everything the partitioners and the simulator need to know about one training configuration."""

    model: ModelSpec
    parallel: ParallelSpec
    shard: Shard
    stages: tuple[StageWorkload, ...]
    gpus_per_node: int = GPUS_PER_NODE

    @property
    def recompute(self) -> bool:
        return self.parallel.recompute == "full"

    def stage(self, index: int) -> StageWorkload:
        return self.stages[index]

    def instruction_ops(self, stage: int, direction: Direction) -> tuple[Op, ...]:
        """One nanobatch's ops of the forward or backward instruction, in launch order.

        Under full recompute the backward first reruns the stage's layers forward (comm included),
        then runs the layers backward, as Megatron's uniform recompute of the whole block does.
        """
        st = self.stages[stage]
        if direction is Direction.FWD:
            return st.pre_fwd + st.block_ops(Direction.FWD) + st.post_fwd
        recompute = st.block_ops(Direction.FWD) if self.recompute else ()
        return st.pre_bwd + recompute + st.block_ops(Direction.BWD) + st.post_bwd

    def microbatch_flops(self, kinds: tuple[OpKind, ...] | None = None) -> float:
        """FLOPs of one microbatch (forward + backward, all nanobatches, all GPUs of one replica)."""
        total = 0.0
        for st in self.stages:
            for d in Direction:
                total += st.gpus * sum(o.flops for o in self.instruction_ops(st.index, d)
                                       if kinds is None or o.kind in kinds)
        return total * self.parallel.nanobatches


def _links(parallel: ParallelSpec, gpus_per_node: int) -> tuple[Link, Link]:
    tp_link = Link.NVLINK if parallel.tp <= gpus_per_node else Link.NETWORK
    cp_link = Link.NVLINK if parallel.tp * parallel.cp <= gpus_per_node else Link.NETWORK
    return tp_link, cp_link


def pp_link(parallel: ParallelSpec, boundary: int, gpus_per_node: int = GPUS_PER_NODE) -> Link:
    """Link between stage ``boundary`` and ``boundary + 1`` under the tp-cp-dp-pp rank order."""
    stride = parallel.tp * parallel.cp * parallel.dp
    first = boundary * stride
    for rank in range(first, first + stride):
        if rank // gpus_per_node != (rank + stride) // gpus_per_node:
            return Link.NETWORK
    return Link.NVLINK


def _embedding(s: Shard, sp: bool, tp_link: Link) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    fwd: list[Op] = [memory("embedding", OpKind.ELEMENTWISE, s.tokens * s.hidden, 0, 2)]
    bwd: list[Op] = []
    if s.tp > 1:
        if sp:
            fwd.append(comm("embedding_reducescatter", Collective.REDUCE_SCATTER, s.sp_tokens * s.hidden * BYTES, s.tp, tp_link))
            bwd.append(comm("embedding_allgather_bwd", Collective.ALL_GATHER, s.sp_tokens * s.hidden * BYTES, s.tp, tp_link))
        else:
            fwd.append(comm("embedding_allreduce", Collective.ALL_REDUCE, s.tokens * s.hidden * BYTES, s.tp, tp_link))
    bwd.append(memory("embedding_bwd", OpKind.ELEMENTWISE, s.tokens * s.hidden, 1, 2))
    return tuple(fwd), tuple(bwd)


def _cross_entropy(s: Shard, fused: bool, tp_link: Link) -> tuple[list[Op], Op]:
    """The vocab-parallel cross-entropy's forward ops and its backward op (per logit, T x V local)."""
    T, V = s.tokens, s.vocab_local
    if fused:
        # Transformer Engine's fused kernels: an online-softmax pass reads the bf16 logits (2 B), the
        # shards' per-token max, sum and target logit (3 fp32) are gathered once, and a second pass
        # reads the logits again and writes the loss gradient over them (2 + 2 B): 6 B, 3 two-byte
        # passes; backward scales that stored gradient in place (read+write 2 B)
        fwd = [memory("cross_entropy", OpKind.ELEMENTWISE, T * V, 5, 3)]
        if s.tp > 1:
            fwd.append(comm("loss_stats_allgather", Collective.ALL_GATHER, T * 3 * 4, s.tp, tp_link))
        return fwd, memory("cross_entropy_bwd", OpKind.ELEMENTWISE, T * V, 1, 2)
    # megatron-core's unfused vocab-parallel cross-entropy, per logit: cast to fp32 (read 2 B, write 4),
    # max (read 4), subtract the max and exp in place (read+write 4, twice), sum (read 4) and divide
    # by the sum, keeping the softmax for backward (read+write 4): 38 B, 19 two-byte passes
    fwd = [memory("cross_entropy", OpKind.ELEMENTWISE, T * V, 5, 19)]
    if s.tp > 1:  # max, target logit and sum of exp over the vocab shards (fp32 per token)
        fwd += [comm(f"loss_{what}_allreduce", Collective.ALL_REDUCE, T * 4, s.tp, tp_link)
                for what in ("max", "target", "sumexp")]
    # backward: scale the saved fp32 softmax by the loss gradient in place (read+write 4 B), then the
    # cast to the output GEMM's bf16 (read 4, write 2): 14 B, 7 two-byte passes
    return fwd, memory("cross_entropy_bwd", OpKind.ELEMENTWISE, T * V, 2, 7)


def _output(s: Shard, sp: bool, tp_link: Link, fused_loss: bool = False,
            norm: str = "rmsnorm") -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Final norm, vocab-parallel output GEMM and cross-entropy (forward, backward)."""
    T, Ts, h, V = s.tokens, s.sp_tokens, s.hidden, s.vocab_local
    fwd: list[Op] = [memory("final_norm", OpKind.NORM, Ts * h, NORM_FLOPS[norm][0], 2)]
    if s.tp > 1 and sp:
        fwd.append(comm("output_allgather", Collective.ALL_GATHER, Ts * h * BYTES, s.tp, tp_link))
    fwd.append(gemm("output", T, h, V))
    loss_fwd, loss_bwd = _cross_entropy(s, fused_loss, tp_link)
    fwd += loss_fwd
    bwd: list[Op] = [loss_bwd, gemm("output_dgrad", T, V, h)]
    if s.tp > 1 and sp:  # the output layer is column-parallel too: its input is gathered again for wgrad
        bwd.append(comm("output_regather_bwd", Collective.ALL_GATHER, Ts * h * BYTES, s.tp, tp_link))
    bwd.append(gemm("output_wgrad", h, T, V))
    if s.tp > 1:
        if sp:
            bwd.append(comm("output_reducescatter_bwd", Collective.REDUCE_SCATTER, Ts * h * BYTES, s.tp, tp_link))
        else:
            bwd.append(comm("output_allreduce_bwd", Collective.ALL_REDUCE, T * h * BYTES, s.tp, tp_link))
    bwd.append(memory("final_norm_bwd", OpKind.NORM, Ts * h, NORM_FLOPS[norm][1], 3))
    return tuple(fwd), tuple(bwd)


def build_workload(model: ModelSpec, parallel: ParallelSpec, gpus_per_node: int = GPUS_PER_NODE) -> Workload:
    """Build every stage's per-nanobatch op sequences for this model and parallel layout."""
    s = make_shard(model, parallel)
    sp = parallel.sequence_parallel and parallel.tp > 1
    tp_link, cp_link = _links(parallel, gpus_per_node)
    lf = layer_forward(model, s, sp, tp_link, cp_link)
    lb = layer_backward(model, s, sp, tp_link, cp_link)
    emb_f, emb_b = _embedding(s, sp, tp_link)
    out_f, out_b = _output(s, sp, tp_link, parallel.cross_entropy_fusion, model.norm)
    act = s.sp_tokens * s.hidden * BYTES  # the activation crossing a stage boundary
    split = parallel.layers_per_stage(model.num_layers)
    stages = []
    first_layer = 0
    last = parallel.pp - 1
    for i, n in enumerate(split):
        pre_f = emb_f if i == 0 else ()  # the activation arrives with the previous stage's pp_send
        post_f = out_f if i == last else (comm("pp_send", Collective.SEND_RECV, act, 2, pp_link(parallel, i, gpus_per_node)),)
        pre_b = out_b if i == last else ()  # the gradient arrives with the next stage's pp_send_grad
        post_b = emb_b if i == 0 else (comm("pp_send_grad", Collective.SEND_RECV, act, 2, pp_link(parallel, i - 1, gpus_per_node)),)
        stages.append(StageWorkload(i, n, first_layer, parallel.tp * parallel.cp, pre_f, lf, post_f, pre_b, lb, post_b))
        first_layer += n
    return Workload(model, parallel, s, tuple(stages), gpus_per_node)
