"""Numerical equivalence of the partitioned executor with plain megatron-core, on CPU over gloo.

One torchrun worker (``python -m kareus.runtime.equivalence --variant tp2 --out F``) builds the same
small GPTModel twice from the same weights, once with ``get_gpt_layer_local_spec()`` and once with
:func:`kareus.runtime.partitioned.layer_spec` running a plan of random launch slots and SM counts per
partition and instruction (``sequential`` among them, and Megatron's layout for one microbatch), trains
both through megatron-core's schedule (1F1B where pp > 1) with the plan hooks, and compares the step-0
loss and every parameter gradient, and the loss over ``steps`` optimizer steps. Rank 0 writes the result
as JSON. ``launch(variant)`` runs a worker with torchrun and returns that result.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kareus.types import ModelSpec, ParallelSpec

# variant -> (tp, pp, sequence parallel, recompute, world size)
VARIANTS: dict[str, tuple[int, int, bool, str, int]] = {
    "tp2": (2, 1, False, "full", 2), "tp2_sp": (2, 1, True, "full", 2), "pp2_tp2": (2, 2, False, "full", 4),
    "tp2_no_recompute": (2, 1, False, "none", 2)}
MODEL = ModelSpec("equivalence", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=128)
SEQ, MICRO_BATCH, MICROBATCHES, STEPS, LR = 16, 4, 4, 10, 0.2


def layout(variant: str) -> ParallelSpec:
    tp, pp, sp, recompute, _ = VARIANTS[variant]
    return ParallelSpec(tp=tp, pp=pp, micro_batch_size=MICRO_BATCH, num_microbatches=MICROBATCHES, seq_len=SEQ,
                        nanobatches=2, recompute=recompute, sequence_parallel=sp)


def random_plan(model: ModelSpec, parallel: ParallelSpec, seed: int, megatron_microbatches: tuple[int, ...] = (),
                freq_mhz: int = 1410) -> Any:
    """A plan of this layout with a random slot and SM count per partition and instruction (each slot,
    ``sequential`` included, equally likely); the microbatches named run Megatron's layout."""
    from kareus.plan.fixed import layout_plan

    rng = random.Random(seed)
    return layout_plan(model, parallel, freq_mhz, lambda t: (rng.choice(t.slot_labels), rng.randint(1, 64)),
                       megatron_microbatches)


def _max_rel(a: Any, b: Any) -> float:
    import torch

    return float((a - b).abs().max() / b.abs().max().clamp_min(torch.finfo(b.dtype).tiny))


def worker(variant: str, out: str, seed: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from kareus.profiler.frequency import UnlockedFrequencyConfig, UnlockedFrequencyController
    from kareus.runtime import megatron_cpu as mc
    from kareus.runtime.executor import PlanExecutor
    from kareus.runtime.megatron import plan_hooks
    from kareus.runtime.partitioned import PlanRuntime, layer_spec

    tp, pp, sp, recompute, _ = VARIANTS[variant]
    parallel = layout(variant)
    mc.init_parallel(tp, pp)
    stage = ps.get_pipeline_model_parallel_rank()
    kw = dict(num_layers=MODEL.num_layers, hidden=MODEL.hidden_size, heads=MODEL.num_attention_heads,
              kv_heads=MODEL.num_kv_heads, ffn=MODEL.ffn_hidden_size, vocab=MODEL.vocab_size, seq=SEQ,
              sequence_parallel=sp)
    reference = mc.tiny_gpt(get_gpt_layer_local_spec(normalization="RMSNorm"), **kw)
    runtime = PlanRuntime(MODEL, parallel, stage=stage)
    model = mc.tiny_gpt(layer_spec(runtime), **kw)
    mc.copy_weights(reference, model)
    runtime.check_model(model.config)
    plan = random_plan(MODEL, parallel, seed, megatron_microbatches=(MICROBATCHES - 1,))
    executor = PlanExecutor(plan, UnlockedFrequencyController(UnlockedFrequencyConfig()), stage)
    runtime.bind(executor)
    batches = mc.make_batches(MICROBATCHES, MICRO_BATCH, SEQ, MODEL.vocab_size, seed=seed)  # each step: the same data

    def train(m: Any) -> tuple[list[float], dict]:
        with plan_hooks(executor, config=m.config):
            return mc.run_steps(m, batches, STEPS, LR, MICROBATCHES, MICRO_BATCH, SEQ)

    ref_losses, ref_grads = train(reference)
    losses, grads = train(model)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    diffs = {n: _max_rel(grads[n], g) for n, g in ref_grads.items()}
    worst = max(diffs, key=diffs.get)
    grad_diff = diffs[worst]
    loss_diff = max((abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), default=0.0)
    stats = torch.tensor([grad_diff, loss_diff, runtime.counters.overlapped, runtime.counters.sequential],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the worst rank; every stage counts its own launches
    last = torch.tensor(losses + [0.0] * (STEPS - len(losses)), dtype=torch.float64)
    dist.all_reduce(last, op=dist.ReduceOp.SUM if pp > 1 else dist.ReduceOp.MAX)  # only the last stage has them
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, (grad_diff, worst))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"worst_parameter": max(names)[1],
            "variant": variant, "tp": tp, "pp": pp, "sequence_parallel": sp, "recompute": recompute, "seed": seed,
            "steps": STEPS,
            "max_rel_grad_diff": stats[0].item(), "max_rel_loss_diff": stats[1].item(),
            "partitions_overlapped": int(stats[2].item()), "partitions_sequential": int(stats[3].item()),
            "losses": [float(x) for x in (last / (tp if pp > 1 else 1)).tolist()]}) + "\n")
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(variant: str, seed: int = 0, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run one variant's worker under torchrun on this machine; its JSON result (raises on failure)."""
    world = VARIANTS[variant][4]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    for attempt in range(2):  # the free port can be taken before torchrun binds it: one more try on a new one
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                   f"--master-port={_free_port()}", "--master-addr=127.0.0.1", "-m", "kareus.runtime.equivalence",
                   "--variant", variant, "--out", str(out), "--seed", str(seed)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
            if done.returncode == 0 and out.exists():
                return json.loads(out.read_text())
            if attempt == 1 or "address already in use" not in done.stderr.lower():
                break
    raise RuntimeError(f"equivalence worker {variant} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    worker(args.variant, args.out, args.seed)


if __name__ == "__main__":
    main()
