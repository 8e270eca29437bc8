"""The ``cuda`` hardware backend: real torch kernels at the partition's op shapes, timed and metered.

One execution of a partition at a candidate: the compute chain runs on the main stream; the comm op
is issued on a side stream just before the slot's op (after the main stream's earlier work, as the
other nanobatch's output is ready then) and the main stream waits for it after the join op (the
chain's end unless the partition names a join). ``sequential`` runs the comm first, alone.
Time comes from CUDA events, energy from the NVML counter or a Zeus window, clock and temperature
from NVML. The clock itself is locked by a frequency controller (``nvml``/``zeus``), which reports
the locked clock here through ``set_clock``; this backend never changes clocks or power limits.

With ``device: cpu`` the same logic runs without streams (an async gloo collective still overlaps
the chain) and with wall-clock timing; energy is unavailable, so readings carry the time and are
marked failed with the reason. That is how the runtime's logic is tested without a GPU.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kareus.hardware.base import GPUSpec, LockedClock
from kareus.hardware.spec import GPUConfig
from kareus.registry import COMM_BACKENDS, HARDWARE
from kareus.runtime.telemetry import EnergyUnavailable, NoEnergy, NVMLDevice, energy_meter, nvml_index
from kareus.types import SEQUENTIAL, Candidate, Op, PartitionType, Reading


@dataclass
class CudaConfig(GPUConfig):
    """Schema of ``hardware=*_cuda``: the datasheet fields plus how to run and meter real kernels."""

    name: str = "cuda"
    device: str = "cuda"  # "cuda" or "cpu" (tests: wall-clock timing, no energy)
    device_index: int = -1  # CUDA device; -1 = LOCAL_RANK, else 0
    nvml_index: int = -1  # NVML index of that GPU; -1 = through CUDA_VISIBLE_DEVICES
    comm: str = "nccl"  # a COMM_BACKENDS name: nccl | gloo | copy
    energy: str = "nvml"  # nvml | zeus | none
    dtype: str = "bfloat16"
    head_dim: int = 128  # head dim assumed when sizing attention kernels from FLOPs and bytes
    scale: float = 1.0  # shrink every kernel dim by this factor (quick CPU checks); 1 = the op's shape
    warmup: int = 2  # untimed executions before a window (allocation, autotuning, caches)
    idle_temperature_c: float = 0.0  # 0 = the temperature read when the backend starts (GPU as found)
    cpu_threads: int = 1  # torch threads on device=cpu (0 = torch's default); 1 keeps timings steady
    def problems(self, ctx: Any = None) -> list[str]:
        """Cross-field rules, checked by config validation before anything is built (no torch needed)."""
        out = []
        if self.device not in ("cuda", "cpu"):
            out.append(f"hardware.device: must be 'cuda' or 'cpu', got {self.device!r}")
        if self.comm not in COMM_BACKENDS:
            out.append(f"hardware.comm: unknown comm backend {self.comm!r}; known: {', '.join(COMM_BACKENDS.names())}")
        if self.energy not in ("nvml", "zeus", "none"):
            out.append(f"hardware.energy: must be nvml, zeus or none, got {self.energy!r}")
        if self.dtype not in ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32"):
            out.append(f"hardware.dtype: must be bfloat16, float16 or float32, got {self.dtype!r}")
        if not 0 < self.scale <= 1:
            out.append(f"hardware.scale: must be in (0, 1], got {self.scale}")
        if self.warmup < 0:
            out.append(f"hardware.warmup: must be >= 0, got {self.warmup}")
        if self.head_dim <= 0:
            out.append(f"hardware.head_dim: must be positive, got {self.head_dim}")
        return out


class CudaBackend(LockedClock):
    """A real GPU (or the CPU) behind the HardwareBackend protocol; one process per GPU of the group."""

    def __init__(self, cfg: CudaConfig, comm: Any = None, seed: int = 0) -> None:
        import torch

        self.cfg = cfg
        self.gpu: GPUSpec = cfg.gpu_spec()
        self._torch = torch
        torch.manual_seed(seed)
        self.cuda = cfg.device == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("hardware 'cuda' with device=cuda needs a CUDA GPU and a CUDA build of torch; "
                                   "use device=cpu to check the logic without one")
            index = cfg.device_index if cfg.device_index >= 0 else int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
            self.main = torch.cuda.current_stream(self.device)
            self.side = torch.cuda.Stream(self.device)
        elif cfg.device == "cpu":
            index = 0
            if cfg.cpu_threads > 0:
                torch.set_num_threads(cfg.cpu_threads)
            self.device = torch.device("cpu")
            self.main = self.side = None
        else:
            raise ValueError(f"hardware.device must be 'cuda' or 'cpu', got {cfg.device!r}")
        # the device index keeps each GPU's thermal anchors apart when several share one journal
        self.name = f"cuda:{cfg.gpu}:{index}" if self.cuda else f"cpu:{cfg.gpu}"
        self._nvml_error = ""
        self.nvml = self._open_nvml(index) if self.cuda else None
        if self.cuda:
            self.energy = energy_meter(cfg.energy, self.nvml, index)
            if isinstance(self.energy, NoEnergy) and self._nvml_error:
                self.energy.reason += f" ({self._nvml_error})"
        else:
            self.energy = NoEnergy("energy is unavailable on device cpu (no GPU energy counter)")
        if comm is None:  # the comm backend's defaults, built without OmegaConf (a bare GPU box has torch only)
            entry = COMM_BACKENDS.get(cfg.comm)
            comm = entry.factory(entry.config_cls()) if entry.config_cls is not None else entry.factory()
        self.comm = comm
        from kareus.runtime.kernels import torch_dtype

        self.dtype = torch_dtype(cfg.dtype)
        self._clock = self.gpu.max_mhz
        self._t0 = time.perf_counter()
        self._compute: dict[str, list[Callable[[], Any]]] = {}
        self._comm: dict[tuple[str, int], Callable[[], Any]] = {}
        self._idle_c = 35.0
        if cfg.idle_temperature_c > 0:
            self._idle_c = cfg.idle_temperature_c
        elif self.nvml is not None:
            self._idle_c = self.nvml.temperature_c()

    def _open_nvml(self, index: int) -> NVMLDevice | None:
        try:
            return NVMLDevice(nvml_index(index, self.cfg.nvml_index))
        except Exception as e:  # no NVML library or no permission: time still works, energy says why not
            self._nvml_error = f"{type(e).__name__}: {e}"
            return None

    # -- clock, temperature, time ------------------------------------------------------------------


    def temperature(self) -> float:
        if self.nvml is None:
            return self._idle_c
        return self.nvml.temperature_c()

    def idle_temperature(self) -> float:
        return self._idle_c

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def idle(self, seconds: float) -> None:
        self.synchronize()
        if seconds > 0:
            time.sleep(seconds)

    def synchronize(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize(self.device)

    # -- kernels -----------------------------------------------------------------------------------
    def compute_kernels(self, partition: PartitionType) -> list[Callable[[], Any]]:
        hit = self._compute.get(partition.key)
        if hit is None:
            from kareus.runtime.kernels import build_chain

            hit = build_chain(partition.compute, self.device, self.dtype, self.cfg.head_dim, self.cfg.scale)
            self._compute[partition.key] = hit
        return hit

    def comm_launch(self, partition: PartitionType, sms: int) -> Callable[[], Any]:
        key = (partition.key, int(sms))
        hit = self._comm.get(key)
        if hit is None:
            hit = self.comm.prepare(partition.comm, int(sms), self.device)
            self._comm[key] = hit
        return hit

    # -- one execution -----------------------------------------------------------------------------
    def run_partition(self, partition: PartitionType, slot: str, sms: int) -> None:
        """Issue one execution of the partition with these knobs (asynchronous on a GPU)."""
        kernels = self.compute_kernels(partition)
        comm = self.comm_launch(partition, sms)
        start, join = launch_points(partition, slot)
        if start is None:
            _wait(comm())
            for k in kernels:
                k()
            return
        pending = None
        for i, k in enumerate(kernels):
            if i == start:
                pending = self._launch_side(comm)
            k()
            if i == join:
                self._join(pending)
                pending = None

    def _launch_side(self, comm: Callable[[], Any]) -> tuple[Any, Any]:
        if not self.cuda:
            return comm(), None
        torch = self._torch
        self.side.wait_stream(self.main)  # the comm's input is ready once the earlier ops finished
        with torch.cuda.stream(self.side):
            handle = comm()
            done = torch.cuda.Event()
            done.record(self.side)
        return handle, done

    def _join(self, pending: tuple[Any, Any] | None) -> None:
        if pending is None:
            return
        handle, done = pending
        _wait(handle)
        if done is not None:
            self.main.wait_event(done)

    # -- measurements ------------------------------------------------------------------------------
    def run_once(self, partition: PartitionType, candidate: Candidate) -> float:
        self.check_clock(candidate)
        return self._timed(lambda: self.run_partition(partition, candidate.slot, candidate.sms), 1)

    def measure(self, partition: PartitionType, candidate: Candidate, window_s: float) -> Reading:
        self.check_clock(candidate)
        if not 0 < candidate.sms < self.gpu.sms:
            raise ValueError(f"comm SMs must be in 1..{self.gpu.sms - 1}, got {candidate.sms}")
        return self._window(lambda: self.run_partition(partition, candidate.slot, candidate.sms), window_s)

    def measure_ops(self, ops: Sequence[Op], window_s: float) -> Reading:
        from kareus.runtime.kernels import build_chain

        compute = [o for o in ops if not o.is_comm]
        key = "ops:" + "|".join(f"{o.name}:{o.flops:g}:{o.bytes:g}" for o in compute)
        kernels = self._compute.get(key)
        if kernels is None:
            kernels = build_chain(compute, self.device, self.dtype, self.cfg.head_dim, self.cfg.scale)
            self._compute[key] = kernels

        def run() -> None:
            for k in kernels:
                k()

        return self._window(run, window_s)

    def space(self, partition: PartitionType) -> list[Candidate] | None:
        return None


    def _timed(self, run: Callable[[], None], n: int) -> float:
        """Seconds per execution of ``n`` back-to-back executions (CUDA events, or wall clock on CPU)."""
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(n):
                run()
            return (time.perf_counter() - t) / n
        torch = self._torch
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.synchronize()
        begin.record(self.main)
        for _ in range(n):
            run()
        end.record(self.main)
        end.synchronize()
        return begin.elapsed_time(end) / 1000.0 / n

    def _window(self, run: Callable[[], None], window_s: float) -> Reading:
        for _ in range(max(0, self.cfg.warmup)):
            run()
        t1 = min(self._timed(run, 1) for _ in range(3))  # calibration: the window's execution count
        n = max(1, int(math.ceil(window_s / max(t1, 1e-9))))
        agree = getattr(self.comm, "agree", None)
        if agree is not None:  # ranks of a TP group calibrate apart but must run as many collectives
            n = agree(n, self.device)
        self.synchronize()
        torch = self._torch
        wall = time.perf_counter()
        self.energy.begin()
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(self.main)
        for _ in range(n):
            run()
        freq = self._sampled_clock()  # sampled while the queued work runs
        if self.cuda:
            end.record(self.main)
            end.synchronize()
            elapsed = begin.elapsed_time(end) / 1000.0
        else:
            elapsed = time.perf_counter() - wall
        try:
            energy = self.energy.end()
        except EnergyUnavailable as e:
            return Reading(elapsed / n, math.nan, self.temperature(), freq, elapsed, n, False, str(e))
        return Reading(elapsed / n, energy / n, self.temperature(), freq, elapsed, n)

    def _sampled_clock(self) -> float:
        if self.nvml is None:
            return float(self._clock)
        try:
            return self.nvml.sm_clock_mhz()
        except Exception:  # pragma: no cover - NVML hiccup: report the locked clock
            return float(self._clock)

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None


def launch_points(partition: PartitionType, slot: str) -> tuple[int | None, int]:
    """(index of the op the comm launches before, or None for sequential; index it joins after)."""
    last = len(partition.compute) - 1
    join = last if partition.join is None else int(partition.join)
    if slot == SEQUENTIAL:
        return None, join
    s = partition.slot(slot)
    start = s.start
    if not 0 <= start <= last:
        raise ValueError(f"slot {slot!r} of {partition.key!r} starts at op {start}, outside the chain 0..{last}")
    if join < start:
        raise ValueError(f"partition {partition.key!r} joins after op {join}, before slot {slot!r} launches "
                         f"the comm at op {start}")
    return start, min(join, last)


def _wait(handle: Any) -> None:
    if handle is not None and hasattr(handle, "wait"):
        handle.wait()


@HARDWARE.register("cuda", CudaConfig)
def build_cuda(cfg: CudaConfig, seed: int = 0, comm: Any = None) -> CudaBackend:
    """Real kernels on a CUDA GPU (or the CPU for checks), energy from NVML/Zeus."""
    return CudaBackend(cfg, comm=comm, seed=seed)
