"""Partitioned overlap in real megatron-core layers: the executor that training and profiling share.

``layer_spec(runtime)`` returns a megatron-core ``ModuleSpec`` that drops in where
``get_gpt_layer_local_spec()`` is used: ``GPTModel(config, layer_spec(runtime), ...)`` builds layers
whose submodules and parameters are megatron-core's own (``ColumnParallelLinear`` /
``RowParallelLinear`` weights, norms), so optimizers, the distributed optimizer, gradient accumulation
and checkpoints work unchanged. Nothing in megatron-core is patched.

A plan's partitions span layer boundaries (nanobatch 0's attention chain begins with the previous
layer's residual add), so the block runs as one unit: the stage's first layer runs the whole block's
program through ``BlockFunction`` (a ``torch.autograd.Function``) and the other layers pass its output
through. Its forward runs the forward program of :mod:`kareus.runtime.program` (two nanobatches split
along the batch dimension, each comm launched at its partition's planned slot on the communicator of
its planned SM count, joined before its consumer); its backward runs the backward program with its own
slots (dgrad and wgrad as separate ops, the input gradient's collective of a column-parallel GEMM
issued at its slot). Under ``recompute: full`` the forward keeps only the block's input and the
backward reruns the forward program first, at the backward instruction's settings for the forward
partitions, as the workload graph models it.

``PlanRuntime(..., stand_in_tp=True)`` runs a tp layout's block program on one device: the megatron-core
model is built at tensor-parallel size 1 with one tp rank's shard of each layer (heads, query groups and
FFN width divided by ``parallel.tp``), and each collective is a copy of its bytes on the side stream that
leaves the values as a one-rank collective would (:class:`kareus.runtime.standin.StandInIssuer`): the
partitions' kernels, shapes and launch slots are the layout's, the tensor-parallel sums are not (a
single-GPU check of the executor and its overlap, not of the layout's numbers).

Instructions that run Megatron's layout (``train.plan=megatron``, or a plan's ``megatron:``
instructions), evaluation (no grad) and a runtime with no plan bound run each layer's own
megatron-core forward unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kareus.errors import KareusError
from kareus.runtime.layer_ops import (Call, Linear, Local, accumulate, backward_local, backward_name, linear_dgrad,
                                      linear_wgrad, op_table, run_linear, run_local)
from kareus.runtime.program import Compute, Join, Launch, Program, build_program
from kareus.types import Direction, ModelSpec, ParallelSpec


class PlanLayoutError(KareusError):
    """The plan, the megatron-core model and the layout do not belong together; one line names the key."""


@dataclass
class Counters:
    """Comm launches the executor issued since the runtime was built (for summaries and checks)."""

    overlapped: int = 0
    sequential: int = 0
    blocks: int = 0

    def add(self, program: Program) -> None:
        self.overlapped += program.overlapped
        self.sequential += program.sequential


@dataclass
class _BlockState:
    hidden: Any  # the block's input (kept under recompute)
    calls: list[Call]
    envs: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)


class PlanRuntime:
    """What the partitioned layers share: the workload's op lists and partition keys for this model and
    layout, the plan executor whose current instruction says how to run, and the communicators."""

    def __init__(self, model: ModelSpec, parallel: ParallelSpec, stage: int = 0, merge_boundary: bool = True,
                 comm: "CommIssuer | None" = None, stand_in_tp: bool = False) -> None:
        import kareus.partition  # noqa: F401  (registers the partitioners)
        from kareus.partition.segments import piece_keys
        from kareus.registry import PARTITIONERS
        from kareus.workload import build_workload

        problems = layout_problems(parallel)
        if problems:
            raise PlanLayoutError(problems[0])
        self.model, self.parallel, self.stage = model, parallel, stage
        self.workload = build_workload(model, parallel)
        if not 0 <= stage < len(self.workload.stages):
            raise PlanLayoutError(f"stage {stage} is outside the layout's {len(self.workload.stages)} pipeline stages")
        name = "nanobatch" if parallel.nanobatches == 2 else "sequential"
        part = PARTITIONERS.build(name, config={"merge_boundary": merge_boundary}).partition(self.workload)
        self.types = {t.key: t for t in part.types}
        self.keys = piece_keys(self.workload, parallel.nanobatches, merge_boundary)
        st = self.workload.stages[stage]
        self.layer_ops = {d: tuple(o.name for o in st.layer_ops(d)) for d in Direction}
        self.block_ops = {d: st.block_ops(d) for d in Direction}
        self.table = op_table(model.activation, model.qk_layernorm, parallel.sequence_parallel and parallel.tp > 1,
                              parallel.tp > 1)
        missing = sorted({n for names in self.layer_ops.values() for n in names} - _known_ops(self.table))
        if missing:
            raise PlanLayoutError(f"the partitioned executor has no implementation of op(s) {', '.join(missing)}")
        self.layers: list[Any] = []
        self.executor: Any = None
        self.comm = comm
        self.stand_in_tp = stand_in_tp  # one device holds one tp rank's shard; collectives are stand-in copies
        self.counters = Counters()
        self._programs: dict[tuple, Program] = {}
        self._block_out: Any = None

    # -- binding -------------------------------------------------------------------------------------
    def bind(self, executor: Any) -> None:
        """Run ``executor``'s plan from now on (refused, one line naming the key, if it was made for
        another model or layout or names a partition this layout does not have)."""
        check_plan(executor.plan, self.model, self.parallel, set(self.types), executor.stage, self.stage)
        self.executor = executor
        self._programs.clear()
        if self.comm is None and _distributed() and not self.stand_in_tp:  # the stand-in is built at the block
            self.comm = CommIssuer.for_device(_device(), plan_sms(executor.plan))

    def comm_summary(self, sms: Sequence[int]) -> str:
        """One line for the log: how the comm SM counts ``sms`` (a plan's) are applied."""
        applied = getattr(self.comm, "applied", "")
        if applied:
            return applied
        if not sms:
            return "no comm SM counts to apply (Megatron's layout runs at the library's default)"
        return f"{len(sms)} comm SM counts {list(sms)} not applied: the process group is not NCCL"

    def register(self, layer: Any) -> None:
        if any(existing.layer_number == layer.layer_number for existing in self.layers):
            raise PlanLayoutError(f"layer {layer.layer_number} is built twice from one PlanRuntime: build one "
                                  "runtime per model")
        self.layers.append(layer)
        self.layers.sort(key=lambda x: x.layer_number)

    def check_model(self, config: Any) -> None:
        """Refuse, with one line, a megatron-core config this runtime's layout or executor cannot run."""
        problems = config_problems(config, self.model, self.parallel, len(self.layers) or None,
                                   self.workload.stages[self.stage].layers, self.stand_in_tp)
        if problems:
            raise PlanLayoutError(problems[0])

    # -- what a layer asks ---------------------------------------------------------------------------
    def partitioned(self, layer: Any) -> bool:
        """Whether this forward runs the plan's partitions (else megatron-core's own layer forward)."""
        import torch

        ex = self.executor
        return (ex is not None and ex.current is not None and layer.training and torch.is_grad_enabled()
                and not ex.megatron_layout())

    def passes_through(self, layer: Any, hidden: Any) -> bool:
        """A layer after the first, handed the block's output: the block already ran it."""
        if self._block_out is None or hidden is not self._block_out or layer is self.layers[0]:
            return False
        if layer is self.layers[-1]:
            self._block_out = None
        return True

    def run_block(self, hidden: Any, rotary: Any, mask: Any) -> Any:
        if self.comm is None:
            if self.stand_in_tp:
                from kareus.runtime.standin import StandInIssuer

                self.comm = StandInIssuer(hidden.device)
            else:
                self.comm = CommIssuer.for_device(hidden.device)
        calls = _nanobatch_calls(rotary, mask, hidden.shape[1], self.parallel.nanobatches)
        params = [p for layer in self.layers for p in layer.parameters()]
        out = BlockFunction.apply(self, calls, hidden, *params)
        self.counters.blocks += 1
        self._block_out = out if len(self.layers) > 1 else None
        return out

    # -- programs ------------------------------------------------------------------------------------
    def program(self, direction: Direction) -> Program:
        ex = self.executor
        key = (direction, id(ex.current))
        hit = self._programs.get(key)
        if hit is None:
            def setting(k: str) -> tuple[str, int]:
                s = ex.setting(k)
                return s.slot, int(s.sms)

            hit = build_program(self.block_ops[direction], self.parallel.nanobatches, self.keys[(self.stage, direction)],
                                self.types, setting)
            self._programs[key] = hit
        return hit

    def forward_block(self, hidden: Any, calls: list[Call], record: bool) -> tuple[Any, _BlockState]:
        """Run the forward program; ``record`` keeps what backward needs (else only the input)."""
        import torch

        parts = torch.chunk(hidden, len(calls), dim=1)
        state = _BlockState(hidden.detach() if not record else None, calls)
        state.envs = [{(-1, "out"): p.detach()} for p in parts]
        state.records = [{} for _ in parts] if record else []
        program = self.program(Direction.FWD)
        self._execute(program, Direction.FWD, state, None, None)
        self.counters.add(program)
        last = len(self.layers) - 1
        out = torch.cat([env.pop((last, "out")) for env in state.envs], dim=1)
        if not record:  # the backward reruns the forward from the input
            state.envs = []
        return out, state

    def backward_block(self, state: _BlockState, grad: Any) -> tuple[Any, dict]:
        import torch

        if state.hidden is not None:  # recompute: rerun the forward at the backward instruction's settings
            _, rerun = self.forward_block(state.hidden, state.calls, record=True)
            state.envs, state.records = rerun.envs, rerun.records
        last = len(self.layers) - 1
        grads = [{(last, "out"): g} for g in torch.chunk(grad, len(state.envs), dim=1)]
        param_grads: dict = {}
        program = self.program(Direction.BWD)
        self._execute(program, Direction.BWD, state, grads, param_grads)
        self.counters.add(program)
        gin = torch.cat([g.pop((-1, "out")) for g in grads], dim=1)
        return gin, param_grads

    def _execute(self, program: Program, direction: Direction, state: _BlockState, grads: list | None,
                 param_grads: dict | None) -> None:
        names = self.layer_ops[direction]
        n = len(names)
        pending: dict[tuple[int, int], Any] = {}
        last = len(self.layers) - 1
        for step in program.steps:
            index, name = divmod(step.op, n)
            name = names[name]
            if direction is Direction.BWD:  # the block's backward runs its layers last to first
                index = last - index
            nb = step.nanobatch
            if isinstance(step, Compute):
                self._compute(direction, name, index, nb, state, grads, param_grads)
            elif isinstance(step, Launch):
                coll = self.table[name]
                space = state.envs[nb] if coll.space == "act" else grads[nb]
                src = space[(index, coll.src)] if coll.space == "act" else space.pop((index, coll.src))
                pending[(nb, step.op)] = self.comm.launch(coll.kind, src, step.sms)
            elif isinstance(step, Join):
                coll = self.table[name]
                result = self.comm.join(pending.pop((nb, step.op)))
                if coll.space == "act":
                    state.envs[nb][(index, coll.dst)] = result
                else:
                    accumulate(grads[nb], (index, coll.dst), result)

    def _compute(self, direction: Direction, name: str, index: int, nb: int, state: _BlockState,
                 grads: list | None, param_grads: dict | None) -> None:
        layer = self.layers[index]
        env = state.envs[nb]
        if direction is Direction.FWD:
            op = self.table[name]
            if isinstance(op, Linear):
                run_linear(op, layer, env, index)
            else:
                run_local(op, layer, state.calls[nb], env, index, state.records[nb] if state.records else None)
            return
        fwd, what = backward_name(name)
        op = self.table[fwd]
        if isinstance(op, Linear):
            if what == "dgrad":
                linear_dgrad(op, layer, env, grads[nb], index)
            else:
                linear_wgrad(op, layer, env, grads[nb], index, param_grads)
        else:
            backward_local(op, layer, grads[nb], index, state.records[nb], param_grads)


def plan_sms(plan: Any) -> list[int]:
    """The comm SM counts a plan's partitions use (Megatron's layout runs at the library's default)."""
    from kareus.partition.sequential import MEGATRON_PREFIX

    return sorted({int(s.sms) for st in plan.stages for ins in st.instructions for s in ins.partitions
                   if not s.partition.startswith(MEGATRON_PREFIX)})


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _known_ops(table: dict) -> set[str]:
    names = set(table)
    for name, op in table.items():
        if isinstance(op, Linear):
            names |= {f"{name}_dgrad", f"{name}_wgrad"}
        elif isinstance(op, Local):
            names.add(f"{name}_bwd")
    return names


def _nanobatch_calls(rotary: Any, mask: Any, batch: int, nanobatches: int) -> list[Call]:
    import torch

    if batch % nanobatches:
        raise PlanLayoutError(f"parallel.micro_batch_size: {batch} sequences do not split into "
                              f"{nanobatches} nanobatches; use a multiple of {nanobatches}")
    if mask is not None and mask.dim() > 0 and mask.size(0) == batch and batch > 1:
        return [Call(rotary, m) for m in torch.chunk(mask, nanobatches, dim=0)]
    return [Call(rotary, mask) for _ in range(nanobatches)]


def _block_function() -> type:
    import torch

    class _BlockFunction(torch.autograd.Function):
        """The layer block as one autograd node, so its backward runs the plan's backward program."""

        @staticmethod
        def forward(ctx: Any, runtime: PlanRuntime, calls: list, hidden: Any, *params: Any) -> Any:
            out, state = runtime.forward_block(hidden, calls, record=runtime.parallel.recompute != "full")
            ctx.runtime, ctx.state, ctx.params = runtime, state, params
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            gin, param_grads = ctx.runtime.backward_block(ctx.state, grad)
            ctx.state = None
            return (None, None, gin, *[param_grads.get(id(p)) for p in ctx.params])

    return _BlockFunction


class _Lazy:
    def __init__(self, make: Callable[[], type]) -> None:
        self._make, self._cls = make, None

    def apply(self, *args: Any) -> Any:
        if self._cls is None:
            self._cls = self._make()
        return self._cls.apply(*args)


BlockFunction = _Lazy(_block_function)  # torch is imported on first use, never by the planner


# -- collectives ---------------------------------------------------------------------------------------
class CommIssuer:
    """Issues one tensor-parallel collective asynchronously with its planned SM count and joins it.
    On a GPU the collective runs on a side stream that first waits for the main stream (its producer
    and the ops before its slot), and the join makes the main stream wait for it.

    ``issue(kind, tensor, sms)`` launches the collective on the current stream and returns (a work to
    wait on or None, the result or a function giving it); ``applied`` says, for the log, how SM counts
    are applied."""

    def __init__(self, issue: Callable[[str, Any, int | None], tuple[Any, Any]], device: Any,
                 applied: str = "") -> None:
        import torch

        self.issue = issue
        self.device = device
        self.applied = applied
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.main = torch.cuda.current_stream(device) if self.cuda else None
        self.side = torch.cuda.Stream(device) if self.cuda else None

    @classmethod
    def for_device(cls, device: Any, sms_values: Sequence[int] = (), nccl: Any = None,
                   backend: str = "nccl") -> "CommIssuer":
        """Megatron's tensor-parallel group. ``backend="nccl"``: one communicator of the TP group per SM
        count in ``sms_values`` (CTAs fixed per communicator, ``kareus.runtime.comm.nccl_options``), created
        now on every rank alike (group creation is collective over the world); gloo: SMs do not apply.
        ``backend="mscclpp"``: one MSCCL++ communicator of the TP group, the SM count per launch."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        if backend == "mscclpp":
            from kareus.runtime.mscclpp_comm import mscclpp_issue

            return cls(mscclpp_issue(group, device), device,
                       f"comm SMs {sorted(set(int(s) for s in sms_values))} as MSCCL++ block counts per launch, "
                       "one communicator of the TP group")
        if not sms_values or dist.get_backend(group) != "nccl":
            return cls(lambda kind, t, sms: _issue(kind, t, group), device)
        from kareus.runtime.comm import NO_NCCL_CONFIG, CommSetupError, NCCLConfig, nccl_options

        mine = tuple(dist.get_process_group_ranks(group))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        groups: dict[int, Any] = {}
        for sms in sorted(set(int(s) for s in sms_values)):
            opts = nccl_options(sms, nccl or NCCLConfig())
            if opts is None:
                raise CommSetupError(NO_NCCL_CONFIG)
            for ranks in sorted(set(every)):
                g = dist.new_group(list(ranks), backend="nccl", pg_options=opts)
                if ranks == mine:
                    groups[sms] = g
        return cls(lambda kind, t, sms: _issue(kind, t, group if sms is None else groups[int(sms)]), device,
                   f"{len(groups)} comm SM counts, one NCCL communicator of the TP group each: {sorted(groups)}")

    def launch(self, kind: str, tensor: Any, sms: int | None) -> Any:
        import torch

        if not self.cuda:
            return self.issue(kind, tensor, sms)
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            pending = self.issue(kind, tensor, sms)
            done = torch.cuda.Event()
            done.record(self.side)
        tensor.record_stream(self.side)
        return pending, done

    def join(self, pending: Any) -> Any:
        import torch

        if not self.cuda:
            work, out = pending
            if work is not None:
                work.wait()
            return out() if callable(out) else out
        (work, out), done = pending
        if work is not None:
            work.wait()
        torch.cuda.current_stream(self.device).wait_event(done)
        result = out() if callable(out) else out
        result.record_stream(torch.cuda.current_stream(self.device))
        return result


def _issue(kind: str, tensor: Any, group: Any) -> tuple[Any, Any]:
    """(work to wait on, result or a function giving it) of one collective along the sequence dimension."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return None, tensor
    if kind == "all_reduce":
        return dist.all_reduce(tensor, group=group, async_op=True), tensor
    t = tensor.contiguous()
    if kind == "all_gather":
        out = t.new_empty((t.shape[0] * world, *t.shape[1:]))
        return dist.all_gather_into_tensor(out, t, group=group, async_op=True), out
    if kind == "reduce_scatter":
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: all-reduce, keep this rank's shard
            rank = dist.get_rank(group)
            work = dist.all_reduce(t, group=group, async_op=True)
            return work, lambda: torch.chunk(t, world, dim=0)[rank].contiguous()
        out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
        return dist.reduce_scatter_tensor(out, t, group=group, async_op=True), out
    raise ValueError(f"unknown collective {kind!r}")


# -- checks ----------------------------------------------------------------------------------------------
def layout_problems(parallel: ParallelSpec) -> list[str]:
    """What the partitioned executor cannot run in this layout, one line each."""
    out = []
    if parallel.cp > 1:
        out.append(f"parallel.cp: the partitioned executor runs cp=1 only, got {parallel.cp}; megatron-core's "
                   "context-parallel attention needs Transformer Engine, and its K/V exchange inside the attention "
                   "kernel cannot be split into the plan's separate all-gather and reduce-scatter ops")
    if parallel.nanobatches not in (1, 2):
        out.append(f"parallel.nanobatches: the executor runs 1 or 2, got {parallel.nanobatches}")
    if parallel.micro_batch_size % parallel.nanobatches:
        out.append(f"parallel.micro_batch_size: {parallel.micro_batch_size} does not split into "
                   f"{parallel.nanobatches} nanobatches; use a multiple of {parallel.nanobatches}")
    if parallel.recompute not in ("full", "none"):
        out.append(f"parallel.recompute: the executor runs full or none, got {parallel.recompute!r}")
    return out


def check_plan(plan: Any, model: ModelSpec, parallel: ParallelSpec, keys: set[str], plan_stage: int,
               stage: int) -> None:
    """Refuse a plan made for another model or layout, or naming partitions this layout lacks."""
    from kareus.partition.sequential import MEGATRON_PREFIX
    from kareus.plan.model import MadeFor

    if plan.made_for is None:
        raise PlanLayoutError(f"plan {plan.id} names no model or layout (made_for; saved before plan schema 3): "
                              "compose it again with this version")
    diff = plan.made_for.differences(MadeFor.of(model, parallel))
    if diff:
        raise PlanLayoutError(f"plan {plan.id} was made for another model or layout: {diff[0]}")
    if plan_stage != stage:
        raise PlanLayoutError(f"plan stage {plan_stage} bound to a runtime of pipeline stage {stage}")
    for ins in plan.stages[stage].instructions:
        for s in ins.partitions:
            if not s.partition.startswith(MEGATRON_PREFIX) and s.partition not in keys:
                raise PlanLayoutError(f"plan {plan.id} names partition {s.partition!r}, which this layout does "
                                      f"not have; it has: {', '.join(sorted(keys))}")


def check_plan_layout(plan: Any, model: ModelSpec, parallel: ParallelSpec) -> None:
    """``check_plan`` for every pipeline stage, before anything is built (no torch needed)."""
    problems = layout_problems(parallel)
    if problems:
        raise PlanLayoutError(problems[0])
    keys = set(PlanRuntime(model, parallel).types)
    for stage in range(plan.num_stages if plan.made_for is not None else 1):
        check_plan(plan, model, parallel, keys, stage, stage)


def config_problems(config: Any, model: ModelSpec, parallel: ParallelSpec, built_layers: int | None,
                    stage_layers: int, stand_in_tp: bool = False) -> list[str]:
    """A megatron-core TransformerConfig the runtime's model and layout do not describe, one line each.

    ``stand_in_tp``: the config is a single device's model holding one tp rank's shard of the stage's
    layers (tensor- and pipeline-parallel size 1; heads, query groups and FFN width divided by tp)."""
    want = {"num_layers": model.num_layers, "hidden_size": model.hidden_size,
            "ffn_hidden_size": model.ffn_hidden_size, "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_kv_heads, "kv_channels": model.head_dim,
            "tensor_model_parallel_size": parallel.tp, "pipeline_model_parallel_size": parallel.pp,
            "context_parallel_size": parallel.cp,
            "sequence_parallel": bool(parallel.sequence_parallel and parallel.tp > 1)}
    if stand_in_tp:
        tp = parallel.tp
        for key, total in (("ffn_hidden_size", model.ffn_hidden_size),
                           ("num_attention_heads", model.num_attention_heads), ("num_query_groups", model.num_kv_heads)):
            if total % tp:
                return [f"{key}: {total} does not split over tp={tp}, so no device holds one tp rank's shard"]
            want[key] = total // tp
        want.update(num_layers=stage_layers, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                    sequence_parallel=False)
    out = [f"{k}: the runtime's layout says {v!r}, the megatron-core config {getattr(config, k, None)!r}"
           for k, v in want.items() if getattr(config, k, None) != v]
    if getattr(config, "recompute_granularity", None) is not None:
        out.append("recompute_granularity: the partitioned executor recomputes as parallel.recompute says; set "
                   f"the megatron-core config's recompute_granularity=None (got {config.recompute_granularity!r})")
    if getattr(config, "num_moe_experts", None):
        out.append("num_moe_experts: the partitioned executor runs dense layers only")
    if model.num_kv_heads < parallel.tp:
        out.append(f"num_query_groups: the executor needs at least tp={parallel.tp} query groups, got {model.num_kv_heads}")
    if built_layers is not None and built_layers != stage_layers:
        out.append(f"num_layers: this rank built {built_layers} layers, the layout's stage has {stage_layers}")
    return out


# -- the megatron-core layer -------------------------------------------------------------------------------
def _layer_class() -> type:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class KareusTransformerLayer(TransformerLayer):
        """megatron-core's TransformerLayer (same submodules and parameters) whose block runs a plan."""

        def __init__(self, *args: Any, runtime: PlanRuntime, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.runtime = runtime
            runtime.register(self)

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            rt = self.runtime
            if rt.passes_through(self, hidden):
                return hidden, kwargs.get("context")
            if self is not rt.layers[0] or not rt.partitioned(self):
                return super().forward(*args, **kwargs)
            for key in ("context", "inference_context", "packed_seq_params", "attention_bias"):
                if kwargs.get(key) is not None:
                    raise PlanLayoutError(f"{key}: the partitioned executor runs self-attention training without it")
            out = rt.run_block(hidden, kwargs.get("rotary_pos_emb"), kwargs.get("attention_mask"))
            return out, kwargs.get("context")

    return KareusTransformerLayer


_LAYER: list[type] = []


def layer_class() -> type:
    if not _LAYER:
        _LAYER.append(_layer_class())
    return _LAYER[0]


def layer_spec(runtime: PlanRuntime) -> Any:
    """A megatron-core ``ModuleSpec`` for ``GPTModel``'s ``transformer_layer_spec``: the local spec's
    submodules (so weights and checkpoints are megatron-core's), layers that run ``runtime``'s plan."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[runtime.model.norm]
    base = get_gpt_layer_local_spec(qk_layernorm=runtime.model.qk_layernorm, normalization=norm)
    return ModuleSpec(module=layer_class(), params={"runtime": runtime}, submodules=base.submodules)


__all__ = ["BlockFunction", "CommIssuer", "Counters", "PlanLayoutError", "PlanRuntime", "check_plan", "check_plan_layout",
           "config_problems", "layer_class", "layer_spec", "layout_problems"]
