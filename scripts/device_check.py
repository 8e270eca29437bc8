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
- the backend runs with the shipped hardware config of the GPU it finds (``hardware=h200_cuda`` on an
  H200), and refuses one of another GPU model;
- e2e: the whole pipeline, ``python -m kareus +model=tiny parallel=pp2_tp2`` on this GPU's shipped
  config with ``profiler/frequency=unlocked +experiment=no_clock_search`` (the clock left to the GPU),
  short windows and no MLflow: it must exit 0 with a plan; with ``--cpu`` it runs on the simulated
  A100 (skipped where hydra-core, xgboost, highspy, moocore or lowtime is missing);
- clocks_untouched: the enforced power limit and the application clocks are the same before and
  after (NVML has no getter for locked clocks; the checks here lock none).

Prints one JSON summary to stdout and writes it to ``$OUT/device_check.json`` when ``$OUT`` is set.
Exit status 0 when every check that ran passed. Needs torch (CUDA build), nvidia-ml-py and numpy;
Triton (shipped with CUDA torch) for the comm-like copy; zeus optional. Run from the repo root:
``PYTHONUNBUFFERED=1 python3 scripts/device_check.py`` (a few minutes on an H100/H200; the
end-to-end run is most of it). ``--cpu`` runs the same code paths on the CPU with
tiny shapes (energy checks skipped): a dry run of this script where no GPU is present.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (tiny shapes, no energy)")
    ap.add_argument("--window", type=float, default=0.5, help="measurement window in seconds")
    ap.add_argument("--e2e-budget", type=int, default=8, help="profiles per partition in the end-to-end run")
    args = ap.parse_args()

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
        _check(checks, "partitions", lambda: check_partitions(backend, parts, args.window, power_limit, idle_w))
        _check(checks, "overlap", lambda: check_overlap(backend, parts, args.window / 2))
    finally:
        backend.close()
    try:
        summary["gemm_beside_copy"] = gemm_beside_copy(CudaBackend, cfg, cpu, args.window)
    except Exception as e:  # reported only
        summary["gemm_beside_copy"] = {"error": f"{type(e).__name__}: {e}"}
    if not cpu:
        _check(checks, "nccl", lambda: check_nccl(CudaBackend, cfg, parts, args.window))
        _check(checks, "zeus", lambda: check_zeus(CudaBackend, cfg, parts, args.window))
        _check(checks, "wrong_model_refused", lambda: check_wrong_model(CudaBackend, cfg, summary["gpu"]))
    model = None if cpu else gpu_model(cfg.gpu).lower()
    _check(checks, "e2e", lambda: check_e2e(model, args.e2e_budget, 300.0))
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
