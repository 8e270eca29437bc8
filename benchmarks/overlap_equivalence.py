"""The partitioned executor against plain megatron-core, on CPU over gloo: is what a plan runs the same
model training?

For each variant (``tp2``: 2 ranks; ``tp2_sp``: with sequence parallelism; ``pp2_tp2``: 4 ranks through
megatron-core's 1F1B schedule; ``tp2_no_recompute``: activations kept instead of recomputed) a torchrun
worker (:mod:`kareus.runtime.equivalence`) builds a 4-layer GPTModel twice from the same weights, with
``get_gpt_layer_local_spec()`` and with Kareus' layer spec running a plan of random launch slots and
comm SM counts per partition and instruction (Megatron's layout for the last microbatch), and trains
both 10 SGD steps in fp32 with dropout 0. Reported per variant: ``max_rel_loss_diff`` (over the 10
steps' losses), ``max_rel_grad_diff`` (step 0, every parameter, the worst rank),
``partitions_overlapped`` (comm launches the executor placed inside the other nanobatch's compute, all
steps, the busiest rank) and ``partitions_sequential``. Wall seconds include torchrun's start and
megatron-core's import (most of it on 2 cores).

    python benchmarks/overlap_equivalence.py [--variants tp2 tp2_sp pp2_tp2 tp2_no_recompute] [--seed 0] [--out PATH]

Writes runs/bench/overlap_equivalence.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kareus.runtime.equivalence import VARIANTS, launch  # noqa: E402

KEYS = ("max_rel_loss_diff", "max_rel_grad_diff", "partitions_overlapped", "partitions_sequential")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0, help="the random plan's and the data's seed")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "overlap_equivalence.json"))
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    results = {}
    for v in args.variants:
        t = time.perf_counter()
        r = launch(v, seed=args.seed)
        r["wall_s"] = round(time.perf_counter() - t, 1)
        results[v] = r
    table = Table(title="Partitioned executor vs plain megatron-core (CPU, gloo, fp32)")
    for col in ("variant", *KEYS, "wall_s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v, r in results.items():
        table.add_row(v, f"{r['max_rel_loss_diff']:.1e}", f"{r['max_rel_grad_diff']:.1e}",
                      str(r["partitions_overlapped"]), str(r["partitions_sequential"]), f"{r['wall_s']:.1f}")
    Console().print(table)
    out = {"seed": args.seed, "tolerance": 1e-5, "variants": results,
           "all_within_tolerance": all(max(r["max_rel_loss_diff"], r["max_rel_grad_diff"]) < 1e-5
                                       for r in results.values())}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
