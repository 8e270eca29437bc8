"""Partition kernels that run the partitioned executor's own ops on one real megatron-core layer.

Profiling runs the code training runs: the ``cuda`` backend measures a partition by calling, for each
op of its compute chain, the function the partitioned executor (:mod:`kareus.runtime.partitioned`)
calls for that op in training (``run_local``/``run_linear`` forward, ``backward_local``,
``linear_dgrad``/``linear_wgrad`` backward, from :mod:`kareus.runtime.layer_ops`), on one megatron-core
``TransformerLayer`` built from ``get_gpt_layer_local_spec()`` at the model's per-GPU shard shapes:
a tensor-parallel size of 1 with ``heads / tp`` query heads, ``kv_heads / tp`` query groups and an FFN
``ffn / tp`` wide (the hidden size unchanged), one nanobatch of ``micro_batch_size / nanobatches``
sequences of ``seq_len`` tokens, random weights (megatron-core's own initialisation) and random inputs,
on the backend's device and dtype. The tensor-parallel collectives are not part of a chain (the comm
backend runs the partition's comm op beside it), so a one-rank layer computes exactly one GPU's share.

:class:`LayerBench` builds the layer and runs one recorded forward and one backward of a nanobatch
through those functions, keeping, for every op, the environment as it stood just before the op ran
(activations, gradients, recorded local graphs, parameter gradients: shallow copies, the tensors are
shared). :func:`layer_kernels` returns one zero-argument callable per op of a partition's chain; each
runs its op on a fresh shallow copy of that op's environment, so it can run any number of times with
the same inputs and the same result (local backward ops keep their recorded graph, ``retain_graph``):
the executor's pops and gradient sums touch the copy only, and a gradient that training adds to one
already there (the residual's two consumers) is added here too. Ops are found by name within the one
layer, so a chain that spans two layers (``fwd_attn`` begins with the previous layer's ``mlp_bda``)
runs every op on the same layer's state: the shapes are the same. Each op reads its prepared inputs
rather than its predecessor's fresh output, and weight gradients are those of a block's first
nanobatch (written, not added to the other nanobatch's).

Megatron's layout (the reference a plan is compared with) runs each microbatch unsplit: its partitions
get a bench of ``micro_batch_size`` sequences (``partition_layout`` tells which layout a partition is of).

Forward ops record their local autograd graphs as training's forward does under
``parallel.recompute: none`` and run without them under ``full`` (the forward pass of the forward
instruction; the backward instruction's recompute records them).

Under sequence parallelism the layer's input is one rank's ``seq / tp`` shard: norms, residual adds
and their backward see the shard, GEMMs and attention the gathered sequence, as in training. On one
rank each collective is stood in by ``one_rank`` (an all-gather repeats the shard, a reduce-scatter
keeps the first shard), so every op gets its real shapes. Context parallelism is refused
(``bench_problems``): its K/V exchange runs inside the attention kernel. torch and megatron-core are
imported inside the functions only, so the planner imports this module without them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from kareus.errors import KareusError
from kareus.types import Direction, ModelSpec, Op, OpKind, ParallelSpec, PartitionType

Kernel = Callable[[], Any]
INDEX = 0  # the bench layer's index in the executor's environments (its input is (-1, "out"))


class LayerBenchError(KareusError):
    """The layer bench cannot measure this layout or partition; one line naming the key."""


def bench_problems(model: ModelSpec, parallel: ParallelSpec) -> list[str]:
    """What one megatron-core layer of the per-GPU shard cannot stand in for, one line each (no torch)."""
    out = []
    if parallel.cp > 1:
        out.append(f"parallel.cp: the cuda backend measures partitions on one megatron-core layer at cp=1 only, got "
                   f"cp={parallel.cp} (context-parallel attention exchanges K/V inside the attention kernel)")
    if _sequence_parallel(parallel) and parallel.seq_len % parallel.tp:
        out.append(f"parallel.seq_len: {parallel.seq_len} does not split into tp={parallel.tp} sequence-parallel "
                   "shards")
    if parallel.nanobatches < 1 or parallel.micro_batch_size % parallel.nanobatches:
        out.append(f"parallel.micro_batch_size: {parallel.micro_batch_size} does not split into "
                   f"{parallel.nanobatches} nanobatches")
    for key, value in (("num_attention_heads", model.num_attention_heads), ("num_kv_heads", model.num_kv_heads),
                       ("ffn_hidden_size", model.ffn_hidden_size)):
        if value % parallel.tp:
            out.append(f"model.{key}: {value} is not divisible by tp={parallel.tp}")
    if model.num_kv_heads % parallel.tp == 0 and model.num_attention_heads % model.num_kv_heads:
        out.append(f"model.num_attention_heads: {model.num_attention_heads} is not a multiple of "
                   f"num_kv_heads={model.num_kv_heads}")
    if model.activation not in ("swiglu", "gelu"):
        out.append(f"model.activation: the layer bench runs swiglu or gelu, got {model.activation!r}")
    if model.norm not in ("rmsnorm", "layernorm"):
        out.append(f"model.norm: the layer bench runs rmsnorm or layernorm, got {model.norm!r}")
    return out


def _sequence_parallel(parallel: ParallelSpec) -> bool:
    return bool(parallel.sequence_parallel) and parallel.tp > 1


def one_rank(kind: str, t: Any, tp: int) -> Any:
    """What a collective over ``tp`` ranks hands one rank, with this rank's tensor standing in for every
    rank's: an all-gather repeats it ``tp`` times along the sequence, a reduce-scatter keeps its first
    shard, an all-reduce passes it on (the sizes of the real collective's result, the values of one rank)."""
    import torch

    if kind == "all_gather":
        return torch.cat([t] * tp, dim=0)
    if kind == "reduce_scatter":
        return t.chunk(tp, dim=0)[0].contiguous()
    return t


# -- the process state megatron-core needs to build a layer ------------------------------------------------
@dataclass
class _Process:
    """What this module set up in the process (and undoes when its last bench closes)."""

    users: int = 0
    dist: bool = False  # a one-rank default process group of ours
    parallel_state: bool = False  # megatron's parallel state, initialised by us
    tracker: tuple[Any, bool] | None = None  # the RNG tracker (and its flag) ours replaced
    shims: bool = False  # megatron_cpu's CUDA shims, installed by us (a CPU device only)


_PROCESS = _Process()


def _acquire(device: Any, seed: int) -> None:
    """megatron's parallel state at tp = pp = cp = 1 and its RNG tracker, set up where absent.

    A process without a process group gets a one-rank one (gloo on the CPU, NCCL on a GPU); one with a
    group (torchrun ranks of a profiled tensor-parallel group) keeps it, and megatron's groups are made
    over it (every rank builds its bench at the same point of the lockstep search). A parallel state
    already initialised at another size is refused: the bench layer holds one GPU's shard at size 1.
    On a CPU device megatron_cpu's CUDA shims are installed while a bench is open (megatron-core's
    attention takes its scratch buffer on ``torch.cuda.current_device()``); on a GPU nothing is patched.
    """
    if _PROCESS.users == 0:
        try:
            _set_up(getattr(device, "type", str(device)) != "cuda", device, seed)
        except BaseException:
            _undo()
            raise
    _PROCESS.users += 1


def _set_up(cpu: bool, device: Any, seed: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random

    if cpu:
        from kareus.runtime import megatron_cpu

        _PROCESS.shims = not megatron_cpu.shims_installed()
        megatron_cpu.install_cuda_shims()
    if not ps.model_parallel_is_initialized():
        if not dist.is_initialized():
            dist.init_process_group("gloo" if cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1)
            _PROCESS.dist = True
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        _PROCESS.parallel_state = True
    sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
             ps.get_context_parallel_world_size())
    if sizes != (1, 1, 1):
        raise LayerBenchError(f"hardware: megatron's parallel state in this process is tp, pp, cp = {sizes}; the "
                              "layer bench builds one layer of a GPU's shard at 1, 1, 1: measure partitions in a "
                              "process that has not initialised megatron's model parallelism")
    tracker = tp_random.get_cuda_rng_tracker()
    if tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.get_states():
        from kareus.runtime.megatron_cpu import CpuRNGStatesTracker, add_tracker_states

        _PROCESS.tracker = (tp_random._CUDA_RNG_STATE_TRACKER, tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
        if cpu:
            ours: Any = CpuRNGStatesTracker()
            add_tracker_states(ours, seed)
        else:
            ours = tp_random.CudaRNGStatesTracker()
            with torch.cuda.device(device):  # the tracker seeds and restores this device's generator
                add_tracker_states(ours, seed)
        tp_random._CUDA_RNG_STATE_TRACKER = ours
        tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _release() -> None:
    _PROCESS.users = max(0, _PROCESS.users - 1)
    if _PROCESS.users == 0:
        _undo()


def _undo() -> None:
    """Put back the RNG tracker, parallel state and process group this module set up (and nothing else)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as tp_random

    if _PROCESS.tracker is not None:
        tp_random._CUDA_RNG_STATE_TRACKER, tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _PROCESS.tracker
        _PROCESS.tracker = None
    if _PROCESS.parallel_state:
        ps.destroy_model_parallel()
        _PROCESS.parallel_state = False
    if _PROCESS.dist:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _PROCESS.dist = False
    if _PROCESS.shims:
        from kareus.runtime import megatron_cpu

        megatron_cpu.uninstall_cuda_shims()
        _PROCESS.shims = False


# -- the bench -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _State:
    """The executor's environment as it stood just before one op ran (shallow copies)."""

    env: dict
    grads: dict
    records: dict
    param_grads: dict


class LayerBench:
    """One megatron-core ``TransformerLayer`` of the model's per-GPU shard, with one nanobatch's
    forward and backward run through the executor's ops, ready for :func:`layer_kernels`.

    ``layer``, ``hidden`` (the layer's input, [seq, sequences, hidden]), ``call`` (its rotary
    embedding and causal mask), ``output`` (the layer's output by the executor's ops), ``grad_output``,
    ``input_grad`` and ``param_grads`` (by parameter name) are kept for checks. ``close()`` frees the
    layer and undoes the process state it set up.
    """

    def __init__(self, model: ModelSpec, parallel: ParallelSpec, device: Any, dtype: Any, seed: int = 0) -> None:
        problems = bench_problems(model, parallel)
        if problems:
            raise LayerBenchError(problems[0])
        import torch

        from kareus.runtime.layer_ops import op_table

        self.model, self.parallel = model, parallel
        self.device, self.dtype = torch.device(device), dtype
        self.sp = _sequence_parallel(parallel)
        self.table = op_table(model.activation, model.qk_layernorm, self.sp)
        self.order = {d: tuple(ops) for d, ops in _layer_ops(model, parallel).items()}  # the graph's order
        missing = sorted(n for names in self.order.values() for n in names if _entry(self.table, n) is None)
        if missing:
            raise LayerBenchError(f"model: the executor has no implementation of op(s) {', '.join(missing)}")
        self.record_forward = parallel.recompute != "full"
        self.sequences = parallel.micro_batch_size // parallel.nanobatches
        self.seq_len = parallel.seq_len
        self._open = False
        _acquire(self.device, seed)
        self._open = True
        cuda = self.device.type == "cuda"
        try:  # the weights and inputs of ``seed``, whatever the process' generators held (they are left as found)
            with (torch.cuda.device(self.device) if cuda else contextlib.nullcontext()), \
                    torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
                torch.manual_seed(seed)
                self._build()
                self._prepare()
        except BaseException:
            self.close()
            raise

    # -- building ------------------------------------------------------------------------------------------
    def config(self) -> Any:
        """The megatron-core TransformerConfig of one GPU's shard at tensor-parallel size 1."""
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        m, tp = self.model, self.parallel.tp
        return TransformerConfig(
            num_layers=1, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size // tp,
            num_attention_heads=m.num_attention_heads // tp, num_query_groups=m.num_kv_heads // tp,
            kv_channels=m.head_dim, hidden_dropout=0.0, attention_dropout=0.0,
            normalization={"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[m.norm],
            gated_linear_unit=m.activation == "swiglu", activation_func=F.silu if m.activation == "swiglu" else F.gelu,
            add_bias_linear=False, qk_layernorm=m.qk_layernorm, use_cpu_initialization=self.device.type != "cuda",
            params_dtype=self.dtype, pipeline_dtype=self.dtype, bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            context_parallel_size=1, sequence_parallel=False)

    def _build(self) -> None:
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from kareus.runtime.layer_ops import Call

        cfg = self.config()
        norm = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[self.model.norm]
        spec = get_gpt_layer_local_spec(qk_layernorm=self.model.qk_layernorm, normalization=norm)
        layer = TransformerLayer(cfg, spec.submodules, layer_number=1)
        self.layer = layer.to(device=self.device, dtype=self.dtype).train()
        rope = RotaryEmbedding(kv_channels=self.model.head_dim, rotary_percent=1.0,
                               use_cpu_initialization=self.device.type != "cuda",
                               cp_group=ps.get_context_parallel_group())
        if self.device.type == "cuda":
            rotary = rope(self.seq_len)
        else:  # its forward moves the frequencies to the current CUDA device first: the same embedding here
            freqs = rope.get_freqs_non_repeated(self.seq_len)
            rotary = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        mask = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool, device=self.device).triu(1)[None, None]
        self.call = Call(rotary=rotary, mask=mask)  # as GPTModel hands each layer (True: masked out)
        tokens = self.seq_len // self.parallel.tp if self.sp else self.seq_len  # a sequence-parallel shard
        self.hidden = torch.randn(tokens, self.sequences, self.model.hidden_size, device=self.device, dtype=self.dtype)
        self.grad_output = torch.randn_like(self.hidden)

    def _prepare(self) -> None:
        """One recorded forward and one backward through the executor's ops, keeping each op's state."""
        from kareus.runtime.layer_ops import (Collective, Linear, accumulate, backward_local, backward_name,
                                              linear_dgrad, linear_wgrad, run_linear, run_local)

        env: dict = {(-1, "out"): self.hidden}
        records: dict = {}
        for name in self.order[Direction.FWD]:
            op = self.table[name]
            if isinstance(op, Linear):
                run_linear(op, self.layer, env, INDEX)
            else:
                run_local(op, self.layer, self.call, env, INDEX, records)
            self._forward_collectives(env, name)
        self.output = env[(INDEX, "out")]
        self._regather(env)  # the gathered inputs a GEMM's forward dropped, for the forward kernels
        self.forward_state = _State(dict(env), {}, dict(records), {})
        grads: dict = {(INDEX, "out"): self.grad_output}
        param_grads: dict = {}
        self.backward_states: dict[str, _State] = {}
        for name in self.order[Direction.BWD]:
            self._regather(env)
            self.backward_states[name] = _State(dict(env), dict(grads), dict(records), dict(param_grads))
            fwd, what = backward_name(name)
            op = self.table[fwd]
            if isinstance(op, Linear):
                if what == "dgrad":
                    linear_dgrad(op, self.layer, env, grads, INDEX)
                else:
                    linear_wgrad(op, self.layer, env, grads, INDEX, param_grads)
            else:
                backward_local(op, self.layer, grads, INDEX, records, param_grads, retain_graph=True)
            for coll in self.table.values():  # one rank: each collective of the gradient, as one_rank stands it in
                if isinstance(coll, Collective) and coll.space == "grad" and (INDEX, coll.src) in grads:
                    accumulate(grads, (INDEX, coll.dst), one_rank(coll.kind, grads.pop((INDEX, coll.src)), self.parallel.tp))
        self.input_grad = grads.get((INDEX - 1, "out"))
        by_id = {id(p): n for n, p in self.layer.named_parameters()}
        self.param_grads = {by_id[k]: v for k, v in param_grads.items()}

    def _forward_collectives(self, env: dict, name: str) -> None:
        """One rank: the forward collectives of op ``name``'s output, as ``one_rank`` stands them in."""
        from kareus.runtime.layer_ops import Collective, Linear

        op = self.table[name]
        outs = (op.out,) if isinstance(op, Linear) else op.outs
        for coll in self.table.values():
            if isinstance(coll, Collective) and coll.space == "act" and coll.src in outs:
                env[(INDEX, coll.dst)] = one_rank(coll.kind, env[(INDEX, coll.src)], self.parallel.tp)

    def _regather(self, env: dict) -> None:
        """Under sequence parallelism a GEMM's forward drops its gathered input; the backward gathers it
        again for the weight gradient (``*_regather_bwd``), as training does."""
        from kareus.runtime.layer_ops import Collective

        for coll in self.table.values():
            if isinstance(coll, Collective) and coll.space == "act" and (INDEX, coll.dst) not in env \
                    and (INDEX, coll.src) in env:
                env[(INDEX, coll.dst)] = one_rank(coll.kind, env[(INDEX, coll.src)], self.parallel.tp)

    # -- checks ------------------------------------------------------------------------------------------------
    def check(self, partition: PartitionType) -> None:
        """Refuse, with one line, a partition that is not of this layer's layout, or whose GEMMs and
        attention this layer does not size as the workload graph does."""
        problem = partition_problem(partition, self.model, self.parallel)
        if problem:
            raise LayerBenchError(f"partition {partition.key}: {problem}")
        for op in partition.compute:
            want = self.expected_shape(op)
            if want is not None and op.shape is not None and tuple(op.shape) != want:
                raise LayerBenchError(
                    f"partition {partition.key}: op {op.name} has shape {tuple(op.shape)}, but the megatron-core "
                    f"layer built for it ({self.model.name}, tp={self.parallel.tp}) gives {want}")

    def expected_shape(self, op: Op) -> tuple[int, ...] | None:
        """The op's kernel shape in this layer (the workload graph's convention), or None if unsized."""
        from kareus.runtime.layer_ops import Linear, _module, backward_name

        tokens = self.sequences * self.seq_len
        if op.kind is OpKind.ATTENTION:
            return (self.sequences, self.model.num_attention_heads // self.parallel.tp, self.seq_len,
                    self.model.head_dim, 1)
        if op.kind is not OpKind.GEMM:
            return None
        name, what = (op.name, "") if op.name in self.table else backward_name(op.name)
        lin = self.table[name]
        if not isinstance(lin, Linear):
            return None
        n, k = _module(self.layer, lin.module).weight.shape
        return {"": (tokens, k, n), "dgrad": (tokens, n, k), "wgrad": (k, tokens, n)}[what]

    def close(self) -> None:
        if self._open:
            self._open = False
            self.layer = self.forward_state = self.backward_states = None  # type: ignore[assignment]
            _release()


def _entry(table: dict, name: str) -> Any:
    """The op table's entry for a compute op name (forward or backward), or None."""
    from kareus.runtime.layer_ops import Collective, Linear, Local, backward_name

    entry = table.get(name)
    if entry is not None:
        return None if isinstance(entry, Collective) else entry
    try:
        fwd, what = backward_name(name)
    except KeyError:
        return None
    entry = table.get(fwd)
    if isinstance(entry, Linear) and what in ("dgrad", "wgrad") or isinstance(entry, Local) and what == "bwd":
        return entry
    return None


@lru_cache(maxsize=8)
def _layer_ops(model: ModelSpec, parallel: ParallelSpec) -> dict[Direction, dict[str, Op]]:
    from kareus.workload import build_workload

    stage = build_workload(model, parallel).stages[0]
    return {d: {o.name: o for o in stage.layer_ops(d) if not o.is_comm} for d in Direction}


def partition_layout(partition: PartitionType, model: ModelSpec, parallel: ParallelSpec) -> ParallelSpec:
    """The layout whose layer ``partition``'s ops are: ``parallel``'s nanobatches, or the microbatch
    unsplit (Megatron's layout, the reference a plan is compared with); LayerBenchError, one line, if
    neither (no torch)."""
    unsplit = dataclasses.replace(parallel, nanobatches=1)
    for layout in (parallel, unsplit) if parallel.nanobatches != 1 else (parallel,):
        if not partition_problem(partition, model, layout):
            return layout
    raise LayerBenchError(f"partition {partition.key}: {partition_problem(partition, model, parallel)}")


def partition_problem(partition: PartitionType, model: ModelSpec, parallel: ParallelSpec) -> str:
    """Why ``partition`` is not one of ``model``'s layer partitions in ``parallel`` ("" if it is): each
    compute op must be the workload graph's op of that name, at its shape (no torch)."""
    try:
        ops = _layer_ops(model, parallel)[partition.direction]
    except ValueError as e:  # the layout does not shard this model
        return str(e)
    for op in partition.compute:
        ref = ops.get(op.name)
        if ref is None:
            return (f"op {op.name!r} is not a {partition.direction.value} op of the model's transformer layer; the "
                    f"cuda backend measures the partitions of the workload's layers only")
        if (ref.shape, ref.flops) != (op.shape, op.flops):
            return (f"op {op.name} has shape {op.shape} ({op.flops:.4g} FLOPs), but {model.name}'s layer in this "
                    f"layout has {ref.shape} ({ref.flops:.4g} FLOPs): the partition is of another model or layout")
    return ""


# -- kernels ---------------------------------------------------------------------------------------------------
def layer_kernels(partition: PartitionType, bench: LayerBench) -> list[Kernel]:
    """One callable per op of ``partition.compute`` (same order), each running that op as the
    partitioned executor runs it in training, on ``bench``'s layer and that op's prepared state;
    each returns what its op produced (a tuple of tensors)."""
    bench.check(partition)
    return [_kernel(op.name, bench) for op in partition.compute]


def _kernel(name: str, bench: LayerBench) -> Kernel:
    from kareus.runtime.layer_ops import (Linear, backward_local, backward_name, linear_dgrad, linear_wgrad,
                                          run_linear, run_local)

    layer, table = bench.layer, bench.table
    if name in table:  # forward
        op, state = table[name], bench.forward_state
        if isinstance(op, Linear):
            def forward_linear() -> Any:
                env = dict(state.env)
                run_linear(op, layer, env, INDEX)
                return (env[(INDEX, op.out)],)

            return forward_linear
        record, call = bench.record_forward, bench.call

        def forward_local() -> Any:
            env = dict(state.env)
            run_local(op, layer, call, env, INDEX, {} if record else None)
            return tuple(env[(INDEX, n)] for n in op.outs)

        return forward_local
    fwd, what = backward_name(name)
    op, state = table[fwd], bench.backward_states[name]
    if isinstance(op, Linear) and what == "dgrad":
        def dgrad() -> Any:
            grads = dict(state.grads)
            linear_dgrad(op, layer, dict(state.env), grads, INDEX)
            return _written(state.grads, grads)

        return dgrad
    if isinstance(op, Linear):
        def wgrad() -> Any:
            param_grads = dict(state.param_grads)
            linear_wgrad(op, layer, dict(state.env), dict(state.grads), INDEX, param_grads)
            return _written(state.param_grads, param_grads)

        return wgrad

    def backward() -> Any:
        grads, param_grads = dict(state.grads), dict(state.param_grads)
        backward_local(op, layer, grads, INDEX, dict(state.records), param_grads, retain_graph=True)
        return _written(state.grads, grads) + _written(state.param_grads, param_grads)

    return backward


def _written(before: dict, after: dict) -> tuple[Any, ...]:
    """The values an op wrote into a copy of ``before`` (new keys, or keys it replaced), in key order."""
    return tuple(v for k, v in after.items() if before.get(k) is not v)


__all__ = ["LayerBench", "LayerBenchError", "bench_problems", "layer_kernels", "partition_layout", "partition_problem"]
