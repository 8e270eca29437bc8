"""One megatron-core ``TransformerLayer``'s ops, one callable per op of the workload graph, by its name.

The partitioned executor runs a layer block op by op, two nanobatches interleaved, so it needs each op
of the layer on its own: ``input_norm``, ``qkv``, [``qk_norm``], ``rope``, ``attention``,
``attn_proj``, ``attn_bda``, ``pre_mlp_norm``, ``fc1``, the activation (``swiglu``/``gelu``), ``fc2``,
``mlp_bda`` forward; ``<op>_bwd``, ``<gemm>_dgrad`` and ``<gemm>_wgrad`` backward; and the
collectives that end segments. Every op computes with the layer's own megatron-core modules and
parameters (its norms, ``core_attention``, bias-dropout-add, the linears' weights, megatron-core's
rotary and fused-activation functions), so the model's state dict, optimizer and checkpoints are
megatron-core's. What megatron-core's parallel linears would do inside one call (the GEMM, then the
tensor-parallel collective) is split: the GEMM is an op here, the collective is issued by the executor
at the planned launch slot.

Activations live in a per-nanobatch environment keyed by ``(layer, name)``; layer ``l``'s input is
``(l - 1, "out")`` (``(-1, "out")`` is the block's input). Non-GEMM ops record a small local autograd
graph on detached inputs when their backward will be needed; GEMM backward is explicit (dgrad and
wgrad are separate ops with separate launch slots).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Env = dict  # (layer, name) -> tensor
Grads = dict  # id(param) -> gradient

SEQ_DIM = 0  # megatron-core activations are [sequence, batch, hidden]


@dataclass(frozen=True)
class Linear:
    """A GEMM op: which module's weight, its input and output names, and whether it is column-parallel
    (its input is gathered under sequence parallelism and its input gradient reduced)."""

    module: str
    inp: str
    out: str
    column: bool


@dataclass(frozen=True)
class Local:
    """A non-GEMM op computed with autograd on its own: input names, output names, the function."""

    ins: tuple[str, ...]
    outs: tuple[str, ...]
    fn: Callable[..., Any]  # (layer, call, *inputs) -> output or tuple of outputs
    params: Callable[[Any], list]  # layer -> the parameters the op uses


@dataclass(frozen=True)
class Collective:
    """A collective: ``kind`` (all_reduce, all_gather, reduce_scatter along the sequence), which
    environment it reads and writes (``act`` or ``grad``), source and destination names."""

    kind: str
    space: str
    src: str
    dst: str


def _x(layer_index: int) -> tuple[int, str]:
    return (layer_index - 1, "out")


def resolve(layer_index: int, name: str) -> tuple[int, str]:
    """The environment key of ``name`` in layer ``layer_index`` (its input ``x`` is the previous output)."""
    return _x(layer_index) if name == "x" else (layer_index, name)


# -- the math of each op, on megatron-core's modules -------------------------------------------------
@dataclass(frozen=True)
class Call:
    """What one nanobatch's layer call brings besides activations: its rotary embedding and mask."""

    rotary: Any = None
    mask: Any = None


def _norm(attr: str) -> Callable[..., Any]:
    def fn(layer: Any, call: Call, x: Any) -> Any:
        return getattr(layer, attr)(x)

    return fn


def _split_qkv(attention: Any, mixed: Any) -> tuple[Any, Any, Any]:
    """megatron-core's ``SelfAttention.get_query_key_value_tensors`` after its linear (GQA groups >= tp)."""
    import torch

    ng = attention.num_query_groups_per_partition
    per = attention.num_attention_heads_per_partition // ng
    hn = attention.hidden_size_per_attention_head
    mixed = mixed.view(*mixed.shape[:-1], ng, (per + 2) * hn)
    q, k, v = torch.split(mixed, [per * hn, hn, hn], dim=3)
    return q.reshape(q.size(0), q.size(1), -1, hn), k, v


def _qk_norm(layer: Any, call: Call, qkv: Any) -> tuple[Any, Any, Any]:
    att = layer.self_attention
    q, k, v = _split_qkv(att, qkv)
    return att.q_layernorm(q), att.k_layernorm(k), v


def _rope_pair(layer: Any, q: Any, k: Any, rotary: Any) -> tuple[Any, Any]:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config as yarn_scale)

    if rotary is None:
        return q, k
    att = layer.self_attention
    q_emb, k_emb = rotary if isinstance(rotary, tuple) else (rotary, rotary)
    cp = getattr(getattr(att, "pg_collection", None), "cp", None)
    scale = yarn_scale(att.config)
    return (apply_rotary_pos_emb(q, q_emb, config=att.config, cu_seqlens=None, mscale=scale, cp_group=cp),
            apply_rotary_pos_emb(k, k_emb, config=att.config, cu_seqlens=None, mscale=scale, cp_group=cp))


def _activation(layer: Any, call: Call, x: Any) -> Any:
    """megatron-core's ``MLP.forward`` between its two linears (no per-token scale: dense MLPs only)."""
    import torch
    import torch.nn.functional as F

    mlp = layer.mlp
    cfg = mlp.config
    fc1 = mlp.linear_fc1
    bias = fc1.bias if getattr(fc1, "skip_bias_add", False) else None
    if cfg.use_te_activation_func:
        return mlp.activation_func(x if bias is None else x + bias)
    if cfg.bias_activation_fusion:
        if mlp.activation_func == F.gelu:
            if cfg.gated_linear_unit:
                from megatron.core.fusions.fused_bias_geglu import bias_geglu_impl
                return bias_geglu_impl(x, bias)
            from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
            return bias_gelu_impl(x, bias)
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
        return bias_swiglu_impl(x, bias, cfg.activation_func_fp8_input_store, False)
    if bias is not None:
        x = x + bias
    if not cfg.gated_linear_unit:
        return mlp.activation_func(x)
    gate, linear = torch.chunk(x, 2, dim=-1)
    clamp = getattr(cfg, "activation_func_clamp_value", None)
    if clamp is not None:
        gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
    return cfg.activation_func(gate) * (linear + getattr(cfg, "glu_linear_offset", 0.0))


def _bda(which: str, linear: str) -> Callable[..., Any]:
    def fn(layer: Any, call: Call, out: Any, residual: Any) -> Any:
        lin = _module(layer, linear)
        bias = lin.bias if getattr(lin, "skip_bias_add", False) else None
        bda = getattr(layer, which)(layer.training, layer.config.bias_dropout_fusion)
        return bda((out, bias), residual, layer.hidden_dropout)

    return fn


def _module(layer: Any, path: str) -> Any:
    for part in path.split("."):
        layer = getattr(layer, part)
    return layer


def _params(*paths: str) -> Callable[[Any], list]:
    return lambda layer: [p for path in paths for p in _module(layer, path).parameters()]


def _biases(*linears: str) -> Callable[[Any], list]:
    def params(layer: Any) -> list:
        out = []
        for path in linears:
            lin = _module(layer, path)
            if getattr(lin, "bias", None) is not None and getattr(lin, "skip_bias_add", False):
                out.append(lin.bias)
        return out

    return params


def op_table(activation: str, qk_layernorm: bool, sequence_parallel: bool, tensor_parallel: bool = True) -> dict[str, Any]:
    """Every op of one layer by the workload graph's name: ``Linear``, ``Local`` or ``Collective``.
    Without tensor parallelism no collective ends a row-parallel GEMM nor reduces a column-parallel
    one's input gradient: the residual adds read the GEMMs' outputs themselves."""
    reduced = "_r" if tensor_parallel else ""
    rope_in = ("qn", "kn") if qk_layernorm else ("qkv",)
    qkv_in = "ln1_full" if sequence_parallel else "ln1"
    fc1_in = "ln2_full" if sequence_parallel else "ln2"

    def rope(layer: Any, call: Call, *ins: Any) -> tuple[Any, ...]:
        if qk_layernorm:
            q, k = ins
            v = None
        else:
            q, k, v = _split_qkv(layer.self_attention, ins[0])
        q, k = _rope_pair(layer, q, k, call.rotary)
        return (q, k) if qk_layernorm else (q, k, v)

    def attention(layer: Any, call: Call, q: Any, k: Any, v: Any) -> Any:
        att = layer.self_attention
        return att.core_attention(q, k, v, call.mask, attn_mask_type=att.attn_mask_type,
                                  attention_bias=None, packed_seq_params=None)

    table: dict[str, Any] = {
        "input_norm": Local(("x",), ("ln1",), _norm("input_layernorm"), _params("input_layernorm")),
        "qkv": Linear("self_attention.linear_qkv", qkv_in, "qkv", tensor_parallel),
        "rope": Local(rope_in, ("q", "k") if qk_layernorm else ("q", "k", "v"), rope, lambda layer: []),
        "attention": Local(("q", "k", "v"), ("ctx",), attention, _params("self_attention.core_attention")),
        "attn_proj": Linear("self_attention.linear_proj", "ctx", "proj", False),
        "attn_bda": Local((f"proj{reduced}", "x"), ("h",), _bda("self_attn_bda", "self_attention.linear_proj"),
                          _biases("self_attention.linear_proj")),
        "pre_mlp_norm": Local(("h",), ("ln2",), _norm("pre_mlp_layernorm"), _params("pre_mlp_layernorm")),
        "fc1": Linear("mlp.linear_fc1", fc1_in, "fc1", tensor_parallel),
        activation: Local(("fc1",), ("act",), _activation, _biases("mlp.linear_fc1")),
        "fc2": Linear("mlp.linear_fc2", "act", "fc2", False),
        "mlp_bda": Local((f"fc2{reduced}", "h"), ("out",), _bda("mlp_bda", "mlp.linear_fc2"), _biases("mlp.linear_fc2")),
    }
    if qk_layernorm:
        table["qk_norm"] = Local(("qkv",), ("qn", "kn", "v"), _qk_norm,
                                 _params("self_attention.q_layernorm", "self_attention.k_layernorm"))
    out_kind = "reduce_scatter" if sequence_parallel else "all_reduce"
    out_name = "reducescatter" if sequence_parallel else "allreduce"
    table[f"attn_{out_name}"] = Collective(out_kind, "act", "proj", "proj_r")
    table[f"mlp_{out_name}"] = Collective(out_kind, "act", "fc2", "fc2_r")
    for gemm, src in (("fc1", "ln2"), ("qkv", "ln1")):
        table[f"{gemm}_{out_name}_bwd"] = Collective(out_kind, "grad", f"{src}{'_full' if sequence_parallel else ''}@partial", src)
    if sequence_parallel:
        table["attn_allgather"] = Collective("all_gather", "act", "ln1", "ln1_full")
        table["mlp_allgather"] = Collective("all_gather", "act", "ln2", "ln2_full")
        table["attn_allgather_bwd"] = Collective("all_gather", "grad", "proj_r", "proj")
        table["mlp_allgather_bwd"] = Collective("all_gather", "grad", "fc2_r", "fc2")
        table["qkv_regather_bwd"] = Collective("all_gather", "act", "ln1", "ln1_full")
        table["fc1_regather_bwd"] = Collective("all_gather", "act", "ln2", "ln2_full")
    return table


def backward_name(op: str) -> tuple[str, str]:
    """(forward op, what) of a backward op name: ``fc2_dgrad`` -> (fc2, dgrad), ``rope_bwd`` -> (rope, bwd)."""
    for suffix in ("_dgrad", "_wgrad", "_bwd"):
        if op.endswith(suffix):
            return op[: -len(suffix)], suffix[1:]
    raise KeyError(op)


# -- running ops -------------------------------------------------------------------------------------
def run_local(op: Local, layer: Any, call: Call, env: Env, index: int, records: dict | None) -> None:
    """Forward of a non-GEMM op; with ``records`` its local autograd graph is kept for backward."""
    import torch

    ins = [env[resolve(index, n)] for n in op.ins]
    if records is None:
        with torch.no_grad():
            outs = op.fn(layer, call, *ins)
    else:
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(t.is_floating_point()) for t in ins]
            outs = op.fn(layer, call, *ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if records is not None:
        records[(index, op.outs)] = (ins, outs)
    for name, t in zip(op.outs, outs):
        env[(index, name)] = t.detach()


def backward_local(op: Local, layer: Any, grads: Env, index: int, records: dict, param_grads: Grads,
                   retain_graph: bool = False) -> None:
    """Backward of a non-GEMM op through its recorded graph: input gradients and parameter gradients.

    ``retain_graph`` keeps the recorded graph's saved tensors, so the same record can be run backward
    again (profiling repeats one op on a prepared record; training frees it)."""
    import torch

    ins, outs = records.pop((index, op.outs))
    pairs = [(o, grads.pop(resolve(index, n), None)) for o, n in zip(outs, op.outs)]
    pairs = [(o, g) for o, g in pairs if g is not None and o.requires_grad]
    if not pairs:
        return
    params = [p for p in op.params(layer) if p.requires_grad]
    wanted = [t for t in ins if t.requires_grad] + params
    got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True,
                              retain_graph=retain_graph)
    k = 0
    for name, t in zip(op.ins, ins):
        if t.requires_grad:
            accumulate(grads, resolve(index, name), got[k])
            k += 1
    for p, g in zip(params, got[k:]):
        accumulate(param_grads, id(p), g)


def accumulate(store: dict, key: Any, value: Any) -> None:
    if value is None:
        return
    store[key] = value if key not in store else store[key] + value


def run_linear(op: Linear, layer: Any, env: Env, index: int) -> None:
    """The GEMM of a megatron-core parallel linear, without its collective (the executor issues it)."""
    lin = _module(layer, op.module)
    x = env.pop((index, op.inp)) if op.inp.endswith("_full") else env[(index, op.inp)]  # re-gathered for wgrad
    y = x.matmul(lin.weight.t())
    if getattr(lin, "bias", None) is not None and not getattr(lin, "skip_bias_add", False):
        y = y + lin.bias
    env[(index, op.out)] = y


def linear_dgrad(op: Linear, layer: Any, env: Env, grads: Env, index: int) -> None:
    """Input gradient; a column-parallel GEMM's is a partial sum the executor then reduces."""
    lin = _module(layer, op.module)
    g = _output_grad(op, grads, index)
    target = (index, f"{op.inp}@partial") if op.column else (index, op.inp)
    accumulate(grads, target, g.matmul(lin.weight))


def linear_wgrad(op: Linear, layer: Any, env: Env, grads: Env, index: int, param_grads: Grads) -> None:
    lin = _module(layer, op.module)
    g = _output_grad(op, grads, index)
    x = env.pop((index, op.inp))
    g2 = g.reshape(-1, g.shape[-1])
    if lin.weight.requires_grad:
        accumulate(param_grads, id(lin.weight), g2.t().matmul(x.reshape(-1, x.shape[-1])))
    if getattr(lin, "bias", None) is not None and not getattr(lin, "skip_bias_add", False) and lin.bias.requires_grad:
        accumulate(param_grads, id(lin.bias), g2.sum(dim=0))
    grads.pop((index, op.out), None)


def _output_grad(op: Linear, grads: Env, index: int) -> Any:
    """The gradient of the GEMM's output: a row-parallel GEMM's all-reduce passes it through unchanged."""
    key = (index, op.out)
    if key not in grads:  # all-reduce backward is the identity: the reduced output's gradient
        grads[key] = grads.pop((index, op.out + "_r"))
    return grads[key]


__all__ = ["Call", "Collective", "Linear", "Local", "SEQ_DIM", "accumulate", "backward_local", "backward_name",
           "linear_dgrad", "linear_wgrad", "op_table", "resolve", "run_linear", "run_local"]
