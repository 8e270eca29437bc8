#!/usr/bin/env python
"""Check Kareus' real-GPU runtime on one GPU in a few minutes; never changes clocks or power limits.

Checks, each reported with its numbers:
- nvml: NVML reads the GPU's name, SM clock, temperature, power, power limit and energy counter;
- partitions: the ``cuda`` backend measures real partitions of Llama-3.2-3B (TP 2 shapes, the comm
  kernel replaced by a copy of its message bytes) at several launch slots: time > 0, energy > 0,
  mean power between 0.8x the idle power read first and 1.1x the enforced power limit;
- overlap: every launch slot of four real partitions at 8 and 32 comm SMs, each against the same
  partition run sequentially (three readings around the slots); some slot must save at least 3% and
  twice the sequential readings' spread (the side stream really overlaps).
  Reported beside it, not checked: four 8192^3 GEMMs beside a 1 GiB copy on 8 or 32 persistent
  blocks (the stand-in for a comm kernel on one GPU), which interfere rather than overlap on an H200;
- nccl: a one-rank NCCL group per comm SM count (CTA options) and a partition with a real NCCL
  all-reduce on the side stream (a one-rank all-reduce of a TP 2 op: plumbing, not bandwidth, so the
  comm backend's world-size check is switched off); the groups are destroyed by ``close``;
- zeus: a ZeusMonitor window reads energy > 0 for the same partition (skipped without zeus);
- layers: the partitioned executor in real megatron-core layers on this one GPU: a bf16 GPTModel of 2
  Llama-3.2-3B layers at one TP 2 rank's shard shapes (megatron-core at TP 1: 12 heads, 4 query groups,
  FFN 4096, hidden 3072, vocabulary 64128; micro batch 4 x 2048 tokens), built once with
  ``get_gpt_layer_local_spec()`` and once with ``layer_spec(PlanRuntime(..., stand_in_tp=True))`` for the
  ``llama3.2-3b pp1_tp2`` layout (each collective a copy of its bytes on the side stream, on the planned
  SMs). Checked: one training step under a random plan gives megatron-core's loss and gradients within
  2e-2 relative (bf16), with partitions overlapped. Reported, not checked: the block's forward+backward
  (CUDA events, median of ``--layer-repeats``) with each partition type at each launch slot, the others
  sequential, against all sequential (read before, amid and after), and with every type at its best
  slot; megatron-core's own block beside it (it does not recompute). Skipped without megatron-core;
- the backend runs with the shipped hardware config of the GPU it finds (``hardware=h200_cuda`` on an
  H200), and refuses one of another GPU model;
- e2e: the whole pipeline, ``python -m kareus +model=tiny parallel=pp2_tp2`` on this GPU's shipped
  config with ``profiler/frequency=unlocked +experiment=no_clock_search`` (the clock left to the GPU),
  short windows and no MLflow: it must exit 0 with a plan; with ``--cpu`` it runs on the simulated
  A100 (skipped where hydra-core, xgboost, highspy, moocore or lowtime is missing);
- train: ``mode=train`` on this one GPU: a short planning run on the simulated GPU of the same model
  (``hardware=<model>_sim``, so the plan's one clock is the top clock Megatron's layout runs at) for
  ``+model=tiny parallel=pp1_tp2 parallel.tp=1`` (seq 1024, micro batch 8, 16 micro-batches: a few tenths
  of a second an iteration, above the NVML energy counter's update period), then
  ``torchrun --nproc-per-node=1 -m kareus mode=train`` of that plan on the shipped ``<model>_cuda``
  config with ``train.compare=true train.blocks=2 train.iterations=4 train.warmup=1``. At tp=1 and pp=1
  there are no collectives, so nothing needs the comm stand-in; the clock is left to the GPU
  (``profiler/frequency=unlocked +experiment=no_clock_search``). Checked: both exit 0, every iteration
  has time > 0 and NVML energy > 0, and the comparison has a measured time and energy saving; reported:
  each block's mean time and energy per layout and the comparison. With ``--cpu``: the simulated A100
  and ``train.device=cpu`` at seq 64, micro batch 2 (energy None, and no measured energy saving);
- clocks_untouched: the enforced power limit and the application clocks are the same before and
  after (NVML has no getter for locked clocks; the checks here lock none).

Prints one JSON summary to stdout and writes it to ``$OUT/device_check.json`` when ``$OUT`` is set.
Exit status 0 when every check that ran passed. Needs torch (CUDA build), nvidia-ml-py and numpy;
Triton (shipped with CUDA torch) for the comm-like copy; zeus optional. Run from the repo root:
``PYTHONUNBUFFERED=1 python3 scripts/device_check.py`` (a few minutes on an H100/H200; the
end-to-end run is most of it). ``--cpu`` runs the same code paths on the CPU with
tiny shapes (energy checks skipped): a dry run of this script where no GPU is present; there ``layers``
runs two tiny layers in fp32 (agreement within 1e-4). ``--only layers,e2e,train`` runs only the sections named
(nvml and clocks_untouched always run on a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _check(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # a failed check is reported, the others still run
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
    out["seconds"] = round(time.perf_counter() - t, 2)
    results[name] = out
    print(f"[device_check] {name}: {'ok' if out.get('ok') else ('skipped' if out.get('skipped') else 'FAILED')}"
          f" ({out['seconds']} s)", file=sys.stderr, flush=True)


def _llama_partitions() -> dict[str, Any]:
    from kareus.partition.nanobatch import NanobatchPartitioner, NanobatchPartitionerConfig
    from kareus.types import ModelSpec, ParallelSpec
    from kareus.workload.graph import build_workload

    model = ModelSpec("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256)
    parallel = ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=2048)
    parts = NanobatchPartitioner(NanobatchPartitionerConfig()).partition(build_workload(model, parallel))
    return {t.key: t for t in parts.types}


def check_nvml(index: int) -> dict[str, Any]:
    from kareus.runtime.telemetry import NVMLDevice

    d = NVMLDevice(index)
    e0 = d.energy_j()
    time.sleep(0.3)
    e1 = d.energy_j()
    out = {"name": d.name(), "sm_clock_mhz": d.sm_clock_mhz(), "max_sm_clock_mhz": d.max_sm_clock_mhz(),
           "temperature_c": d.temperature_c(), "power_w": d.power_w(), "power_limit_w": d.power_limit_w(),
           "idle_energy_j_0.3s": round(e1 - e0, 3)}
    out["ok"] = (out["sm_clock_mhz"] > 0 and 0 < out["temperature_c"] < 110 and out["power_limit_w"] > 0
                 and e1 >= e0)
    d.close()
    return out


def _clock_state(index: int) -> dict[str, Any]:
    """Read-only: the clock and power-limit settings that must be the same after the checks."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    state: dict[str, Any] = {"power_limit_mw": pynvml.nvmlDeviceGetEnforcedPowerLimit(h)}
    for key, fn in (("app_sm_clock_mhz", lambda: pynvml.nvmlDeviceGetApplicationsClock(h, pynvml.NVML_CLOCK_SM)),
                    ("default_app_sm_clock_mhz",
                     lambda: pynvml.nvmlDeviceGetDefaultApplicationsClock(h, pynvml.NVML_CLOCK_SM))):
        try:
            state[key] = fn()
        except Exception as e:  # older drivers lack some queries
            state[key] = f"n/a ({type(e).__name__})"
    return state


def check_partitions(backend: Any, parts: dict[str, Any], window_s: float, power_limit_w: float,
                     idle_w: float) -> dict[str, Any]:
    from kareus.types import Candidate

    rows = []
    ok = True
    for key, slots in (("fwd_attn", ("sequential", "norm_0", "attn_0")), ("bwd_attn", ("sequential", "attn_0")),
                       ("fwd_mlp", ("sequential", "linear_0"))):
        p = parts[key]
        for slot in slots:
            c = Candidate(key, slot, 16, backend.clock())
            r = backend.measure(p, c, window_s)
            power = r.energy_j / r.time_s if r.ok and r.time_s > 0 else float("nan")
            good = r.time_s > 0 and (not backend.cuda or (r.ok and r.energy_j > 0
                                                          and 0.8 * idle_w <= power <= 1.1 * power_limit_w))
            ok &= good
            rows.append({"partition": key, "slot": slot, "ok": good, "time_ms": round(r.time_s * 1e3, 4),
                         "energy_j": round(r.energy_j, 5) if r.ok else None, "power_w": round(power, 1) if r.ok else None,
                         # read from the GPU; on the CPU they are the backend's placeholders, so none is shown
                         "sm_clock_mhz": r.freq_mhz if backend.cuda else None,
                         "temperature_c": r.temperature_c if backend.cuda else None, "executions": r.executions,
                         "error": r.error})
    return {"ok": ok, "backend": backend.name, "power_bounds_w": [round(0.8 * idle_w, 1), round(1.1 * power_limit_w, 1)],
            "rows": rows}


def check_overlap(backend: Any, parts: dict[str, Any], window_s: float) -> dict[str, Any]:
    """Each slot of four real partitions against the same partition run sequentially, at 8 and 32 SMs.

    Sequential is read before, amid and after the slots; a slot counts as overlapping only when it
    beats the median sequential time by 3% and by twice the sequential readings' spread (the clock
    is not locked here, so a window can also be fast by luck).
    """
    from statistics import median

    from kareus.types import SEQUENTIAL, Candidate

    rows, best = [], None
    for key in ("fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp"):
        p = parts[key]
        for sms in (8, 32):
            def read(slot: str) -> Any:
                return backend.measure(p, Candidate(key, slot, sms, backend.clock()), window_s)

            slots = list(p.slot_labels[1:])
            half = len(slots) // 2
            seq = [read(SEQUENTIAL)]
            got = {slot: read(slot) for slot in slots[:half]}
            seq.append(read(SEQUENTIAL))
            got.update({slot: read(slot) for slot in slots[half:]})
            seq.append(read(SEQUENTIAL))
            base = median(r.time_s for r in seq)
            spread = (max(r.time_s for r in seq) - min(r.time_s for r in seq)) / base
            base_energy = median(r.energy_j for r in seq) if all(r.ok for r in seq) else None
            for slot, r in got.items():
                saved = 1.0 - r.time_s / base
                row = {"partition": key, "sms": sms, "slot": slot, "sequential_ms": round(base * 1e3, 4),
                       "sequential_spread": round(spread, 4), "time_ms": round(r.time_s * 1e3, 4),
                       "time_saved": round(saved, 4), "margin": round(saved - max(0.03, 2 * spread), 4),
                       "energy_saved": round(1.0 - r.energy_j / base_energy, 4) if r.ok and base_energy else None}
                rows.append(row)
                best = row if best is None or row["margin"] > best["margin"] else best
    out: dict[str, Any] = {"best": best, "rows": rows}
    out["ok"] = True if not backend.cuda else best is not None and best["margin"] > 0
    if not backend.cuda:
        out["note"] = "no streams on the CPU: overlap is reported, not checked"
    return out


def gemm_beside_copy(backend_cls: Any, cfg: Any, cpu: bool, window_s: float) -> dict[str, Any]:
    """Four large GEMMs beside a copy on persistent blocks, sequential and overlapped: reported only."""
    from kareus.runtime.comm import CopyBackend, CopyConfig
    from kareus.types import Candidate, Collective, Direction, Link, PartitionType, Slot
    from kareus.workload.ops import comm, gemm

    n = 512 if cpu else 8192
    msg = (64 << 20) if cpu else (1 << 30)  # bytes the stand-in copies (read + write twice that)
    chain = tuple(gemm(f"g{i}", n, n, n) for i in range(4))
    p = PartitionType("overlap", Direction.FWD, chain, comm("copy", Collective.ALL_REDUCE, msg, 1, Link.NVLINK),
                      (Slot("linear_0", (0,), "gemm"),))
    copy = CopyBackend(CopyConfig())
    b = backend_cls(replace(cfg, comm="copy"), comm=copy)
    run = max(1, int(n * cfg.scale))  # the kernels shrink every GEMM dimension by hardware.scale
    out: dict[str, Any] = {"gemm": f"{run}^3 x 4", "copy_bytes": msg, "chain_ms": round(b.measure_ops(chain, window_s).time_s * 1e3, 3)}
    for sms in (8, 32):
        seq = b.measure(p, Candidate("overlap", "sequential", sms, b.clock()), window_s)
        ovl = b.measure(p, Candidate("overlap", "linear_0", sms, b.clock()), window_s)
        out[f"sms_{sms}"] = {"sequential_ms": round(seq.time_s * 1e3, 3), "overlapped_ms": round(ovl.time_s * 1e3, 3),
                             "time_saved": round(1.0 - ovl.time_s / seq.time_s, 4)}
    out["copy_kernel"] = copy.kernel_used
    b.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_nccl(backend_cls: Any, cfg: Any, parts: dict[str, Any], window_s: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from kareus.runtime.comm import NCCLBackend, NCCLConfig, nccl_options
    from kareus.types import Candidate

    if not dist.is_nccl_available():
        return {"ok": False, "skipped": True, "error": "this torch build has no NCCL"}
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        comm = NCCLBackend(NCCLConfig(check_group_size=False))  # one rank runs the TP 2 op: plumbing only
        opts = nccl_options(8, NCCLConfig())
        b = backend_cls(replace(cfg, comm="nccl"), comm=comm)
        rows = []
        for sms in (4, 16):
            r = b.measure(parts["fwd_attn"], Candidate("fwd_attn", "attn_0", sms, b.clock()), window_s)
            rows.append({"sms": sms, "time_ms": round(r.time_s * 1e3, 4), "ok": r.ok, "error": r.error})
        groups = sorted(comm._groups)
        b.close()
        return {"ok": all(r["ok"] for r in rows) and len(groups) == 2 and not comm._groups,
                "per_communicator_ctas": opts is not None, "groups": groups, "rows": rows}
    finally:
        dist.destroy_process_group()


def check_zeus(backend_cls: Any, cfg: Any, parts: dict[str, Any], window_s: float) -> dict[str, Any]:
    from kareus.types import Candidate

    try:
        import zeus.monitor  # noqa: F401
    except Exception as e:  # zeus is optional: NVML's counter is the default meter
        return {"ok": False, "skipped": True, "error": f"zeus is not installed ({type(e).__name__})"}
    b = backend_cls(replace(cfg, energy="zeus"))
    r = b.measure(parts["fwd_attn"], Candidate("fwd_attn", "attn_0", 16, b.clock()), window_s)
    b.close()
    return {"ok": r.ok and r.energy_j > 0, "time_ms": round(r.time_s * 1e3, 4),
            "energy_j": r.energy_j if r.ok else None, "error": r.error}


E2E_NEEDS = ("hydra", "omegaconf", "yaml", "scipy", "threadpoolctl", "xgboost", "highspy", "moocore", "lowtime",
             "rich")


def check_e2e(model: str | None, budget: int, timeout_s: float) -> dict[str, Any]:
    """The whole pipeline in a subprocess: ``model`` names the shipped ``<model>_cuda`` config (None:
    the simulated A100); the clock is left to the GPU, so nothing is locked."""
    import importlib.util
    import subprocess
    import tempfile

    missing = [m for m in E2E_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        return {"ok": False, "skipped": True, "error": f"needs {', '.join(missing)} (pip install -e .)"}
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "kareus", "+model=tiny", "parallel=pp2_tp2", "profiler/frequency=unlocked",
                "+experiment=no_clock_search", "tracking.enabled=false", "progress=false", f"search.budget={budget}",
                "profiler.target_window_s=0.3", "profiler.min_window_s=0.1", "profiler.cooldown.seconds=0",
                "profiler.settle_s=0", f"hydra.run.dir={tmp}/run"]
        if model is not None:
            args += [f"hardware={model}_cuda", "hardware.comm=copy"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        summary_path = Path(tmp) / "run" / "summary.json"
        out: dict[str, Any] = {"command": " ".join(args[1:-1]), "rc": done.returncode,
                               "tail": (done.stdout + done.stderr)[-1500:]}
        if done.returncode == 0 and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            out.update({"hardware": summary.get("hardware"), "simulated": summary.get("simulated"),
                        "profiled": summary.get("profiled"), "reference": summary.get("reference"),
                        "selected": summary.get("selected")})
        out["ok"] = done.returncode == 0 and bool(out.get("selected"))
        return out


# mode=train's layout on one GPU: tp=1 and pp=1, so no collective runs and no comm stand-in is needed.
# On a GPU the iteration is sized to last a few tenths of a second (the NVML energy counter updates every
# few tens of ms); on the CPU it is the tests' tiny one (under a second an iteration)
TRAIN_LAYOUT = ("+model=tiny", "parallel=pp1_tp2", "parallel.tp=1")
TRAIN_SHAPE = {True: ("parallel.seq_len=64", "parallel.micro_batch_size=2"),
               False: ("parallel.seq_len=1024", "parallel.micro_batch_size=8", "parallel.num_microbatches=16")}
TRAIN_CLOCK = ("profiler/frequency=unlocked", "+experiment=no_clock_search")  # the clock left to the GPU


def check_train(model: str | None, timeout_s: float) -> dict[str, Any]:
    """``mode=train`` of a freshly planned tiny model on one device, compared with Megatron's layout.

    ``model`` names the GPU's shipped configs (``<model>_sim`` plans, ``<model>_cuda`` trains and meters
    energy by NVML); None: the CPU dry run (simulated A100, ``train.device=cpu``, energy None). At tp=1
    and pp=1 there is no collective, so nothing needs the comm stand-in; no clock is locked."""
    import importlib.util
    import subprocess
    import tempfile

    missing = [m for m in (*E2E_NEEDS, "megatron") if importlib.util.find_spec(m) is None]
    if missing:
        return {"ok": False, "skipped": True, "error": f"needs {', '.join(missing)} (pip install -e . megatron-core)"}
    cpu = model is None
    layout = (*TRAIN_LAYOUT, *TRAIN_SHAPE[cpu])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.setdefault("PYTHONWARNINGS", "ignore")
    deadline = time.perf_counter() + timeout_s
    out: dict[str, Any] = {"layout": " ".join(layout)}
    with tempfile.TemporaryDirectory() as tmp:
        plan_dir, train_dir = Path(tmp) / "plan", Path(tmp) / "train"
        plan = [sys.executable, "-m", "kareus", *layout, *TRAIN_CLOCK, "search.budget_frac=0.05",
                "tracking.enabled=false", "progress=false", f"hydra.run.dir={plan_dir}"]
        if not cpu:
            plan.append(f"hardware={model}_sim")  # the plan's one clock: this GPU's top clock, as Megatron's layout
        t = time.perf_counter()
        done = subprocess.run(plan, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s)
        out["planning"] = {"command": " ".join(plan[1:-1]), "rc": done.returncode,
                           "wall_s": round(time.perf_counter() - t, 2)}
        if done.returncode != 0 or not (plan_dir / "plan_selected.yaml").is_file():
            out["planning"]["tail"] = (done.stdout + done.stderr)[-1500:]
            out["ok"] = False
            return out
        train = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={_free_port()}",
                 "--master-addr=127.0.0.1", "-m", "kareus", "mode=train", *layout, *TRAIN_CLOCK,
                 f"train.plan={plan_dir}", "train.compare=true", "train.blocks=2", "train.iterations=4",
                 "train.warmup=1", f"train.device={'cpu' if cpu else 'cuda'}", "tracking.enabled=false",
                 "progress=false", f"hydra.run.dir={train_dir}"]
        if not cpu:
            train.append(f"hardware={model}_cuda")  # energy by NVML
        t = time.perf_counter()
        done = subprocess.run(train, cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=max(1.0, deadline - time.perf_counter()))
        out["training"] = {"command": " ".join(train[1:-1]), "rc": done.returncode,
                           "wall_s": round(time.perf_counter() - t, 2)}
        path = train_dir / "train_summary.json"
        if done.returncode != 0 or not path.is_file():
            out["training"]["tail"] = _before_agent(done.stdout + done.stderr)[-2500:]
            out["ok"] = False
            return out
        summary = json.loads(path.read_text())
    its = summary.get("iterations") or []
    comp = summary.get("comparison") or {}
    out.update({"device": summary.get("device"), "energy": summary.get("energy"),
                "iterations": len(its), "blocks": _train_blocks(its), "comparison": comp,
                "first_loss": its[0]["loss"] if its else None, "last_loss": its[-1]["loss"] if its else None,
                "partitions_overlapped": summary.get("partitions_overlapped"),
                "clock_switches": summary.get("clock_switches")})
    times = [i.get("time_s") for i in its]
    energies = [i.get("energy_j") for i in its]
    checks = {"iterations": len(its) == 8 and {i.get("layout") for i in its} == {"plan", "megatron"},
              "time_s > 0": bool(its) and all(isinstance(x, (int, float)) and x > 0 for x in times),
              "energy_j": (all(x is None for x in energies) if cpu
                           else bool(its) and all(isinstance(x, (int, float)) and x > 0 for x in energies)),
              "measured_time_saving": comp.get("measured_time_saving") is not None,
              "measured_energy_saving": cpu or comp.get("measured_energy_saving") is not None}
    out["checks"] = checks
    out["ok"] = all(checks.values())
    if not cpu and times and min(times) < 0.1:  # shorter than a few of the counter's updates
        out["note"] = (f"an iteration took {min(times):.3f} s: NVML's energy counter updates every few tens of "
                       "ms, so energy per iteration is coarse")
    if cpu:
        out["note"] = "the CPU has no energy counter: energy is None and no energy saving is measured"
    return out


def _before_agent(text: str) -> str:
    """A torchrun run's output up to the launcher's own report of the failed rank (its traceback says
    nothing of the rank's error, which comes before it)."""
    cuts = [i for i in (text.find("torch/distributed/elastic/"), text.find("torch.distributed.elastic.")) if i >= 0]
    if not cuts:
        return text
    cut = min(cuts)
    return text[: text.rfind("\n", 0, cut) + 1] or text


def _train_blocks(its: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per layout, each block's mean time and energy per iteration (energy None where unmeasured)."""
    from statistics import fmean

    out: dict[str, list[dict[str, Any]]] = {}
    for layout in ("plan", "megatron"):
        rows = []
        for block in sorted({i["block"] for i in its if i["layout"] == layout}):
            mine = [i for i in its if i["layout"] == layout and i["block"] == block]
            energies = [i["energy_j"] for i in mine]
            rows.append({"block": block, "iterations": len(mine),
                         "mean_time_s": round(fmean(i["time_s"] for i in mine), 6),
                         "mean_energy_j": None if None in energies else round(fmean(energies), 4)})
        out[layout] = rows
    return out


def check_wrong_model(backend_cls: Any, cfg: Any, device_name: str) -> dict[str, Any]:
    """A hardware config of another GPU model is refused at backend start, naming the one to use."""
    from kareus.errors import KareusError
    from kareus.runtime.backend import gpu_model

    other = "H100-SXM5-80GB" if gpu_model(device_name) != "H100" else "A100-SXM4-40GB"
    try:
        backend_cls(replace(cfg, gpu=other)).close()
    except KareusError as e:
        return {"ok": "hardware.gpu" in str(e), "message": str(e)}
    return {"ok": False, "error": f"hardware.gpu={other} was accepted on {device_name}"}


def _layers_layout(cpu: bool) -> tuple[Any, Any]:
    """The layout the layers section runs: 2 of Llama-3.2-3B's layers in its pp1_tp2 layout (tiny on the CPU)."""
    from kareus.types import ModelSpec, ParallelSpec

    if cpu:
        return (ModelSpec("llama-tiny", 2, 96, 256, 6, 2, 16, 256),
                ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=32))
    return (ModelSpec("llama3.2-3b", 2, 3072, 8192, 24, 8, 128, 128256),
            ParallelSpec(tp=2, pp=1, micro_batch_size=4, num_microbatches=2, seq_len=2048))


def _with_slots(plan: Any, slots: dict[str, str], sms: int) -> Any:
    """``plan`` with every partition at ``slots[key]`` (else sequential) on ``sms`` SMs."""
    from kareus.plan.model import PartitionSetting
    from kareus.types import SEQUENTIAL

    stages = tuple(replace(st, instructions=tuple(
        replace(ins, partitions=tuple(PartitionSetting(p.partition, slots.get(p.partition, SEQUENTIAL), sms, p.count)
                                      for p in ins.partitions))
        for ins in st.instructions)) for st in plan.stages)
    return replace(plan, stages=stages)


def _max_rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def check_layers(cpu: bool, repeats: int, sms: int = 16, seed: int = 0) -> dict[str, Any]:
    """The partitioned executor in megatron-core layers on one device, against megatron-core's own layers.

    The device holds one TP rank's shard (megatron-core at TP 1 with the heads, query groups, FFN width and
    vocabulary divided by TP); the runtime runs the TP layout's block program with ``stand_in_tp=True``.
    """
    try:
        import megatron.core  # noqa: F401
    except Exception as e:  # megatron-core is not a dependency of the planner
        return {"ok": False, "skipped": True,
                "error": f"megatron-core is not installed ({type(e).__name__}); pip install megatron-core"}
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.is_initialized():  # the section needs a world of its own (one rank)
        return {"ok": False, "skipped": True, "error": "a torch.distributed process group already exists"}
    if not cpu:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    mc = None
    try:
        with torch.random.fork_rng(devices=[] if cpu else [0]):  # the seeds below stay in this section
            if cpu:  # the CPU helpers' shims patch torch.cuda in this process: the --cpu dry run only
                from kareus.runtime import megatron_cpu as mc

                mc.init_parallel(1, 1)
            else:
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
                model_parallel_cuda_manual_seed(1234)
            return _run_layers(cpu, repeats, sms, seed)
    finally:
        if mc is not None:
            mc.uninstall_cuda_shims()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        if not cpu:
            torch.cuda.empty_cache()


def _run_layers(cpu: bool, repeats: int, sms: int, seed: int) -> dict[str, Any]:
    from statistics import median

    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from kareus.profiler.frequency import UnlockedFrequencyConfig, UnlockedFrequencyController
    from kareus.runtime.equivalence import random_plan
    from kareus.runtime.executor import PlanExecutor
    from kareus.runtime.partitioned import PlanRuntime, layer_spec
    from kareus.runtime.standin import StandInIssuer

    spec, parallel = _layers_layout(cpu)
    tp, b, s, h = parallel.tp, parallel.micro_batch_size, parallel.seq_len, spec.hidden_size
    vocab = spec.vocab_size // tp
    dtype = torch.float32 if cpu else torch.bfloat16
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    tol = 1e-4 if cpu else 2e-2

    def build(layer: Any) -> Any:
        config = TransformerConfig(
            num_layers=spec.num_layers, hidden_size=h, num_attention_heads=spec.num_attention_heads // tp,
            num_query_groups=spec.num_kv_heads // tp, kv_channels=spec.head_dim,
            ffn_hidden_size=spec.ffn_hidden_size // tp, hidden_dropout=0.0, attention_dropout=0.0,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype is torch.bfloat16, use_cpu_initialization=cpu,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        torch.manual_seed(seed)
        m = GPTModel(config, layer, vocab_size=vocab, max_sequence_length=s, position_embedding_type="rope",
                     share_embeddings_and_output_weights=spec.tied_embeddings)
        return m.to(device=device, dtype=dtype).train()  # as megatron-core's Float16Module casts it

    issuer = StandInIssuer(device, default_sms=sms)
    runtime = PlanRuntime(spec, parallel, stand_in_tp=True, comm=issuer)
    reference = build(get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = build(layer_spec(runtime))
    model.load_state_dict(reference.state_dict())
    runtime.check_model(model.config)

    def executor(plan: Any) -> Any:
        ex = PlanExecutor(plan, UnlockedFrequencyController(UnlockedFrequencyConfig()), 0)  # clocks untouched
        runtime.bind(ex)
        return ex

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=gen).to(device)
    positions = torch.arange(s, device=device).expand(b, s)
    mask = torch.ones(s, s, dtype=torch.bool, device=device).triu(1).expand(b, 1, s, s)  # True: masked out

    # one training step under a random plan (slots and SMs per partition), against megatron-core's layers
    base = random_plan(spec, parallel, seed)
    ex = executor(base)

    def step(m: Any) -> tuple[float, dict[str, Any]]:
        m.zero_grad(set_to_none=True)
        ex.begin(0, "fwd")
        loss = m(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
        ex.begin(0, "bwd")
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        return float(loss.detach()), grads

    ref_loss, ref_grads = step(reference)
    loss, grads = step(model)
    ex.reset()
    diffs = {n: _max_rel(grads[n], g) for n, g in ref_grads.items() if n in grads}
    worst = max(diffs, key=diffs.get) if diffs else None
    loss_diff = abs(loss - ref_loss) / abs(ref_loss)
    counters = runtime.counters
    equivalence = {"tolerance": tol, "loss": loss, "reference_loss": ref_loss, "rel_loss_diff": loss_diff,
                   "max_rel_grad_diff": diffs.get(worst), "worst_grad": worst, "grads": len(grads),
                   "partitions_overlapped": counters.overlapped, "partitions_sequential": counters.sequential,
                   "missing_grads": sorted(set(ref_grads) ^ set(grads))}
    equivalence["ok"] = (not equivalence["missing_grads"] and bool(diffs) and loss_diff <= tol
                         and diffs[worst] <= tol and counters.overlapped > 0)
    del grads, ref_grads

    # the block's forward+backward (the decoder: both layers and the final norm) per plan
    hidden = torch.randn(s, b, h, generator=gen).to(device, dtype).requires_grad_()
    grad_out = torch.randn(s, b, h, generator=gen).to(device, dtype)
    rotary = model.rotary_pos_emb(s)

    def block_ms(plan: Any | None, m: Any = model) -> float:
        ex = executor(plan) if plan is not None else None
        times = []
        for i in range(repeats + 1):  # the first run warms up (and builds the plan's programs)
            hidden.grad = None
            m.zero_grad(set_to_none=True)
            if cpu:
                t0 = time.perf_counter()
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            if ex is not None:
                ex.begin(0, "fwd")
            out = m.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)
            if ex is not None:
                ex.begin(0, "bwd")
            out.backward(grad_out)
            if cpu:
                elapsed = (time.perf_counter() - t0) * 1e3
            else:
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            if i:
                times.append(elapsed)
        if ex is not None:
            ex.reset()
        return median(times)

    sequential = _with_slots(base, {}, sms)
    rows, best = [], {}
    for key, ptype in sorted(runtime.types.items()):
        slots = list(ptype.slot_labels[1:])
        half = len(slots) // 2
        seq = [block_ms(sequential)]
        got = {slot: block_ms(_with_slots(base, {key: slot}, sms)) for slot in slots[:half]}
        seq.append(block_ms(sequential))
        got.update({slot: block_ms(_with_slots(base, {key: slot}, sms)) for slot in slots[half:]})
        seq.append(block_ms(sequential))
        base_ms = median(seq)
        for slot, t in got.items():
            rows.append({"partition": key, "slot": slot, "sms": sms, "sequential_ms": round(base_ms, 4),
                         "sequential_spread": round((max(seq) - min(seq)) / base_ms, 4), "time_ms": round(t, 4),
                         "time_saved": round(1.0 - t / base_ms, 4)})
        if got:
            best[key] = min(got, key=got.get)
    seq_ms = block_ms(sequential)
    all_best_ms = block_ms(_with_slots(base, best, sms))
    megatron_ms = block_ms(None, reference)
    times = [r["time_ms"] for r in rows] + [r["sequential_ms"] for r in rows] + [seq_ms, all_best_ms, megatron_ms]
    out: dict[str, Any] = {
        "model": f"{spec.name}: {spec.num_layers} layers, one tp={tp} shard (heads {spec.num_attention_heads // tp}, "
                 f"query groups {spec.num_kv_heads // tp}, ffn {spec.ffn_hidden_size // tp}, hidden {h}, "
                 f"vocab {vocab}), micro batch {b} x {s}, {str(dtype).removeprefix('torch.')}",
        "layout": f"tp={tp} pp={parallel.pp} nanobatches={parallel.nanobatches} recompute={parallel.recompute} "
                  f"sequence_parallel={parallel.sequence_parallel}",
        "equivalence": equivalence, "repeats": repeats,
        "stand_in": {"launches": issuer.launches, "gib": round(issuer.bytes / 2**30, 3),
                     "kernels": dict(issuer.kernels)},
        "block": {"sequential_ms": round(seq_ms, 4), "all_best_ms": round(all_best_ms, 4),
                  "all_best_saved": round(1.0 - all_best_ms / seq_ms, 4), "best_slots": best,
                  "megatron_local_spec_ms": round(megatron_ms, 4)},
        "rows": rows}
    out["ok"] = equivalence["ok"] and all(t > 0 for t in times)
    if cpu:
        out["note"] = "no streams on the CPU: the timings are reported, not meaningful"
    return out


# the sections --only can name, in the order they run (nvml and clocks_untouched always run on a GPU)
SECTIONS = ("partitions", "overlap", "gemm_beside_copy", "nccl", "zeus", "wrong_model_refused", "layers", "e2e",
            "train")
BACKEND_SECTIONS = ("partitions", "overlap", "gemm_beside_copy", "nccl", "zeus", "wrong_model_refused")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (tiny shapes, no energy)")
    ap.add_argument("--window", type=float, default=0.5, help="measurement window in seconds")
    ap.add_argument("--e2e-budget", type=int, default=8, help="profiles per partition in the end-to-end run")
    ap.add_argument("--layer-repeats", type=int, default=None,
                    help="timed runs per plan in the layers section, after one warm-up (default: 5; 1 with --cpu)")
    ap.add_argument("--only", default="", help=f"comma-separated sections to run (default: all): {', '.join(SECTIONS)}")
    args = ap.parse_args()
    only = {name for name in args.only.split(",") if name}
    if only - set(SECTIONS):
        ap.error(f"--only: no section {', '.join(sorted(only - set(SECTIONS)))}; there are {', '.join(SECTIONS)}")

    def want(name: str) -> bool:
        return not only or name in only

    import torch

    from kareus.errors import KareusError
    from kareus.runtime.backend import CudaBackend, gpu_model, shipped_cuda_config
    from kareus.runtime.telemetry import nvml_index

    cpu = args.cpu
    t0 = time.perf_counter()
    summary: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "mode": "cpu" if cpu else "gpu",
                               "window_s": args.window, "checks": {}}
    checks = summary["checks"]
    if not cpu and not torch.cuda.is_available():  # a GPU check without a GPU fails; --cpu asks for the dry run
        checks["cuda"] = {"ok": False, "error": "torch sees no CUDA GPU (CPU-only build, or no driver); "
                                                "use --cpu for the dry run"}
        summary["passed"] = False
        _emit(summary)
        return 1
    if not cpu:
        summary["gpu"] = torch.cuda.get_device_name(0)
        summary["gpu_count"] = torch.cuda.device_count()
    before = None
    power_limit, idle_w = 1000.0, 25.0
    if not cpu:
        index = nvml_index(0)  # the NVML index of cuda:0, matched by UUID
        summary["nvml_index"] = index
        _check(checks, "nvml", lambda: check_nvml(index))
        power_limit = float(checks["nvml"].get("power_limit_w") or power_limit)
        idle_w = float(checks["nvml"].get("power_w") or idle_w)  # read before any kernel ran
        try:
            before = _clock_state(index)
        except Exception as e:
            summary["clock_state_error"] = repr(e)
    cfg = None
    if any(want(name) for name in BACKEND_SECTIONS):
        parts = _llama_partitions()
        device = "cpu" if cpu else "cuda"
        try:  # a GPU with no shipped config, or of another variant (SMs, top clock): the summary says so
            cfg = shipped_cuda_config("A100" if cpu else summary["gpu"], device=device, comm="copy",
                                      energy="none" if cpu else "nvml", scale=0.125 if cpu else 1.0)
            backend = CudaBackend(cfg)
        except KareusError as e:
            checks["hardware"] = {"ok": False, "error": str(e)}
            summary["passed"] = False
            _emit(summary)
            return 1
        summary["hardware"] = f"{cfg.gpu} (conf/hardware/{cfg.gpu.split('-')[0].lower()}_cuda.yaml)"
        try:
            if want("partitions"):
                _check(checks, "partitions", lambda: check_partitions(backend, parts, args.window, power_limit, idle_w))
            if want("overlap"):
                _check(checks, "overlap", lambda: check_overlap(backend, parts, args.window / 2))
        finally:
            backend.close()
        if want("gemm_beside_copy"):
            try:
                summary["gemm_beside_copy"] = gemm_beside_copy(CudaBackend, cfg, cpu, args.window)
            except Exception as e:  # reported only
                summary["gemm_beside_copy"] = {"error": f"{type(e).__name__}: {e}"}
        if not cpu:
            if want("nccl"):
                _check(checks, "nccl", lambda: check_nccl(CudaBackend, cfg, parts, args.window))
            if want("zeus"):
                _check(checks, "zeus", lambda: check_zeus(CudaBackend, cfg, parts, args.window))
            if want("wrong_model_refused"):
                _check(checks, "wrong_model_refused", lambda: check_wrong_model(CudaBackend, cfg, summary["gpu"]))
    if want("layers"):
        repeats = args.layer_repeats if args.layer_repeats is not None else (1 if cpu else 5)
        _check(checks, "layers", lambda: check_layers(cpu, max(1, repeats)))
    model = None if cpu else gpu_model(cfg.gpu if cfg is not None else summary["gpu"]).lower()
    if want("e2e"):
        _check(checks, "e2e", lambda: check_e2e(model, args.e2e_budget, 300.0))
    if want("train"):
        _check(checks, "train", lambda: check_train(model, 300.0))
    if not cpu and before is not None:
        after = _clock_state(index)
        checks["clocks_untouched"] = {"ok": after == before, "before": before, "after": after}
    ran = [c for c in checks.values() if not c.get("skipped")]
    summary["passed"] = bool(ran) and all(c.get("ok") for c in ran)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    _emit(summary)
    return 0 if summary["passed"] else 1


def _emit(summary: dict[str, Any]) -> None:
    """Print the JSON summary and write it to ``$OUT/device_check.json`` when ``$OUT`` is set."""
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "device_check.json").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
