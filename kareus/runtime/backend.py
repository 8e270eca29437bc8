"""The ``cuda`` hardware backend: a partition's ops on one real megatron-core layer, timed and metered.

Profiling runs the code training runs: each op of a partition's compute chain is the partitioned
executor's own op (:mod:`kareus.runtime.layer_ops`) on one megatron-core ``TransformerLayer`` of the
model's per-GPU shard shapes, random weights and one nanobatch of random inputs
(:mod:`kareus.runtime.layer_kernels`); the backend's config names the model and layout (``model``,
``parallel``: the pipeline sets the run's). Residual work (embedding, output layer, loss, pipeline
sends) and a backend that names no model run stand-in kernels at the ops' shapes
(:mod:`kareus.runtime.kernels`).

One execution of a partition at a candidate: the compute chain runs on the main stream; the comm op
is issued on a side stream just before the slot's op (after the main stream's earlier work, as the
other nanobatch's output is ready then) and the main stream waits for it after the join op (the
chain's end unless the partition names a join). ``sequential`` runs the comm first, alone.
Time comes from CUDA events, energy from the NVML counter or a Zeus window, clock and temperature
from NVML (the GPU matched to torch's device by UUID). The clock itself is locked by a frequency
controller (``nvml``/``zeus``), which reports the locked clock here through ``set_clock``; a window
whose NVML clock runs more than one clock step above it is a failed read (the lock did not hold).
This backend never changes clocks or power limits.

The ranks of a tensor-parallel group measure in lockstep, so every decision that changes how many
collectives a rank issues is the group's: the execution count, and whether a window is good, failed
or must be read again (``_group_verdict``). Each rank runs the search itself, so each window's
numbers are the group's too (``_group_reading``): the slowest rank's time, the ranks' mean energy.
Under torchrun the backend starts torch.distributed itself; a comm backend without a usable process
group is a configuration error (``CommSetupError``).

With ``device: cpu`` the same logic runs without streams (an async gloo collective still overlaps
the chain) and with wall-clock timing; energy is unavailable, so readings carry the time and are
marked failed with the reason. That is how the runtime's logic is tested without a GPU.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kareus.config.schema import ModelConfig, ParallelConfig
from kareus.hardware.base import GPUSpec, LockedClock
from kareus.hardware.spec import GPUConfig
from kareus.registry import COMM_BACKENDS, HARDWARE
from kareus.runtime.comm import init_process_group_from_env
from kareus.runtime.telemetry import EnergyUnavailable, NoEnergy, NVMLDevice, cuda_uuid, energy_meter, nvml_index
from kareus.types import SEQUENTIAL, Candidate, ModelSpec, Op, ParallelSpec, PartitionType, Reading


@dataclass
class CudaConfig(GPUConfig):
    """Schema of ``hardware=*_cuda``: the datasheet fields plus how to run and meter real kernels."""

    name: str = "cuda"
    device: str = "cuda"  # "cuda" or "cpu" (tests: wall-clock timing, no energy)
    device_index: int = -1  # CUDA device; -1 = LOCAL_RANK, else 0
    nvml_index: int = -1  # NVML index of that GPU; -1 = the GPU with the CUDA device's UUID
    comm: str = "nccl"  # a COMM_BACKENDS name: nccl | mscclpp | gloo | copy
    energy: str = "nvml"  # nvml | zeus | none
    dtype: str = "bfloat16"
    head_dim: int = 128  # head dim assumed when sizing stand-in attention kernels (residual ops) from FLOPs and bytes
    scale: float = 1.0  # shrink every stand-in kernel dim by this factor (quick CPU checks); 1 = the op's shape
    # The model and layout whose megatron-core layer partitions run on (set by the pipeline from the
    # run's model and parallel sections; None: stand-in kernels at the ops' shapes, for runtime checks)
    model: Optional[ModelConfig] = None
    parallel: Optional[ParallelConfig] = None
    warmup: int = 2  # untimed executions before a window (allocation, autotuning, caches)
    idle_temperature_c: float = 0.0  # 0 = the temperature read when this process first opens the GPU (as found)
    cpu_threads: int = 1  # torch threads on device=cpu (0 = torch's default); 1 keeps timings steady
    def problems(self, ctx: Any = None) -> list[str]:
        """Cross-field rules, checked by config validation before anything is built (no torch needed)."""
        out = []
        if self.device not in ("cuda", "cpu"):
            out.append(f"hardware.device: must be 'cuda' or 'cpu', got {self.device!r}")
        if self.comm not in COMM_BACKENDS:
            out.append(f"hardware.comm: unknown comm backend {self.comm!r}; known: {', '.join(COMM_BACKENDS.names())}")
        if self.comm == "mscclpp":
            from kareus.runtime.mscclpp_comm import mscclpp_problem, sequence_parallel_problem

            par = self.parallel if self.parallel is not None else getattr(ctx, "parallel", None)
            sp = par is not None and bool(par.sequence_parallel) and int(par.tp) > 1
            out += [p for p in (mscclpp_problem("hardware.comm"), sequence_parallel_problem("hardware.comm", sp)) if p]
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
        layout = self.layout()
        if layout is not None:
            from kareus.runtime.layer_kernels import bench_problems

            out += bench_problems(*layout)
        return out

    def layout(self) -> tuple[ModelSpec, ParallelSpec] | None:
        """The model and layout partitions are measured on, or None when the config names none."""
        if self.model is None or self.parallel is None:
            return None
        return self.model.spec(), self.parallel.spec()

    def real_clock(self) -> bool:
        """On a GPU a frequency controller must lock the clock; on the CPU there is none to lock."""
        return self.device == "cuda"


def with_layout(cfg: CudaConfig, model: ModelSpec, parallel: ParallelSpec) -> CudaConfig:
    """``cfg`` measuring partitions on ``model``'s layer in ``parallel`` (scripts and tests; the
    pipeline gives a backend the run's own model and parallel sections)."""
    from dataclasses import asdict

    from kareus.registry import to_dataclass

    layout = asdict(parallel)
    layout["layer_split"] = list(parallel.layer_split) if parallel.layer_split else None
    return replace(cfg, model=to_dataclass(ModelConfig, asdict(model)), parallel=to_dataclass(ParallelConfig, layout))


def gpu_model(name: str) -> str:
    """The GPU model a name speaks of ("A100", "H200"): the first word with a digit, NVIDIA's prefix dropped."""
    for word in name.replace("-", " ").split():
        if any(ch.isdigit() for ch in word) and word.upper() != "NVIDIA":
            return word.upper()
    return name.strip().upper()


def gpu_model_problem(spec_gpu: str, device_name: str) -> str:
    """Why the hardware config names another GPU model than this one, or "" when the models match."""
    want, have = gpu_model(spec_gpu), gpu_model(device_name)
    if want == have:
        return ""
    hint = f"hardware={have.lower()}_cuda" if have.lower() in SHIPPED_CUDA_MODELS else "a hardware config for it"
    return (f"hardware.gpu: {spec_gpu!r} describes the {want}, but this GPU is {device_name!r}; "
            f"choose {hint} (shipped: {_shipped()})")


def gpu_mismatch(cfg: GPUConfig, device_name: str, device_sms: int, device_max_mhz: float | None) -> str:
    """Why the hardware config does not describe this GPU, or "" when it does.

    The search space (SM count, clock range) and the static power come from the config, so
    ``hardware=a100_cuda`` on an H200, or ``h100_cuda`` (SXM, 132 SMs) on an H100 PCIe (114 SMs) or
    a MIG slice, would search SMs the GPU lacks and clocks it cannot lock.
    """
    problem = gpu_model_problem(cfg.gpu, device_name)
    if problem:
        return problem
    own = (f"write a hardware config for it (a copy of conf/hardware/{gpu_model(device_name).lower()}_cuda.yaml "
           "with its gpu, sms, min_mhz, max_mhz, tdp_w and static_power_w)")
    if device_sms and cfg.sms != device_sms:
        return (f"hardware.sms: {cfg.sms} in the config of {cfg.gpu!r}, but {device_name!r} has {device_sms} SMs "
                f"(another variant, or a MIG slice); {own}")
    if device_max_mhz and cfg.max_mhz > device_max_mhz:
        return (f"hardware.max_mhz: {cfg.max_mhz} in the config of {cfg.gpu!r}, above the {device_max_mhz:.0f} MHz "
                f"that {device_name!r} reaches; {own}")
    return ""


_HARDWARE_CONF = Path(__file__).resolve().parents[1] / "conf" / "hardware"
SHIPPED_CUDA_MODELS = tuple(sorted(p.name[: -len("_cuda.yaml")] for p in _HARDWARE_CONF.glob("*_cuda.yaml")))

log = logging.getLogger(__name__)

# idle temperature per physical GPU, read when the first backend of this process opens it: every
# partition search builds a backend of its own, and one opened after another search's last window
# would read that heat as idle (the cooldowns wait for, and correct heat against, idle)
_IDLE_C: dict[str, float] = {}


def _idle_reading(device_id: str, nvml: Any, fallback_c: float) -> float:
    """The GPU's idle temperature as this process first read it; a failed first read (which would
    stop this rank alone, after its group started) leaves ``fallback_c`` for now and reads again later."""
    if device_id not in _IDLE_C:
        try:
            _IDLE_C[device_id] = nvml.temperature_c()
        except Exception as e:
            log.warning("NVML temperature read failed (%s: %s); idle taken as %.0f C", type(e).__name__, e, fallback_c)
            return fallback_c
    return _IDLE_C[device_id]


def _shipped() -> str:
    return ", ".join(f"{m}_cuda" for m in SHIPPED_CUDA_MODELS)


def shipped_cuda_config(device_name: str, **fields: Any) -> CudaConfig:
    """The shipped ``hardware=<model>_cuda`` config of this GPU, read without Hydra (scripts, tests).

    A GPU model with no shipped config is refused with the models there are.
    """
    import yaml

    from kareus.errors import KareusError

    model = gpu_model(device_name).lower()
    if model not in SHIPPED_CUDA_MODELS:
        raise KareusError(f"no shipped hardware config for {device_name!r} (shipped: {_shipped()})")
    data = yaml.safe_load((_HARDWARE_CONF / f"{model}_cuda.yaml").read_text())
    data.pop("defaults", None)
    return CudaConfig(**{**data, **fields})


def refuse_together(problem: str, agree: Callable[[int], int]) -> None:
    """Stop every rank of the group if any rank's GPU is refused (``problem``: why, "" if not), each with
    one line: a rank that stopped alone would leave its peers waiting in their first collective.
    ``agree``: the group's maximum of a value."""
    from kareus.errors import KareusError

    if agree(1 if problem else 0):
        raise KareusError(problem or "another rank of the group refused its GPU (its own error line says why); "
                                     "nothing was measured")


class CudaBackend(LockedClock):
    """A real GPU (or the CPU) behind the HardwareBackend protocol; one process per GPU of the group."""

    def __init__(self, cfg: CudaConfig, comm: Any = None, seed: int = 0) -> None:
        import torch

        self.cfg = cfg
        self.gpu: GPUSpec = cfg.gpu_spec()
        self._torch = torch
        torch.manual_seed(seed)
        self.seed = seed
        self._benches: dict[ParallelSpec, Any] = {}  # megatron-core layers partitions run on, by layout, built once
        self.cuda = cfg.device == "cuda"
        index = self._select_device(cfg)
        # the device index keeps each GPU's thermal anchors apart when several share one journal
        self.name = f"cuda:{cfg.gpu}:{index}" if self.cuda else f"cpu:{cfg.gpu}"
        # the physical GPU, for state learned about it (a Ray task on another node also calls its GPU cuda:0)
        self.device_id = f"{socket.gethostname()}:{cuda_uuid(index) or self.name}" if self.cuda else self.name
        self._nvml_error = ""
        self.nvml = self._open_nvml(index) if self.cuda else None
        self.energy, unmetered = self._open_meter(index)
        problem = self._gpu_problem(index) or unmetered
        try:
            self.comm = self._start_comm(comm)
            # after the group started: a rank that stopped before it would leave its peers waiting there
            refuse_together(problem, self._agree)
        except BaseException:
            if self.nvml is not None:
                self.nvml.close()
            raise
        from kareus.runtime.kernels import torch_dtype

        self.dtype = torch_dtype(cfg.dtype)
        self._clock = self.gpu.max_mhz
        self._clock_locked = False  # set_clock from a controller: windows are checked against NVML's clock
        self._t0 = time.perf_counter()
        self._compute: dict[str, list[Callable[[], Any]]] = {}
        self._comm: dict[tuple[str, int], Callable[[], Any]] = {}
        self._idle_c = 35.0
        if cfg.idle_temperature_c > 0:
            self._idle_c = cfg.idle_temperature_c
        elif self.nvml is not None:
            self._idle_c = _idle_reading(self.device_id, self.nvml, self._idle_c)
        self._last_c = self._idle_c

    def _select_device(self, cfg: CudaConfig) -> int:
        """Bind this process to its GPU (LOCAL_RANK under torchrun) and make its streams; 0 on the CPU."""
        torch = self._torch
        if self.cuda:
            if not torch.cuda.is_available():
                from kareus.errors import KareusError

                raise KareusError("hardware.device: cuda needs a CUDA GPU and a CUDA build of torch, and torch sees "
                                  "none; use hardware.device=cpu to check the logic without one")
            index = cfg.device_index if cfg.device_index >= 0 else int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
            self.main = torch.cuda.current_stream(self.device)
            self.side = torch.cuda.Stream(self.device)
            return index
        if cfg.device != "cpu":
            raise ValueError(f"hardware.device must be 'cuda' or 'cpu', got {cfg.device!r}")
        if cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)
        self.device = torch.device("cpu")
        self.main = self.side = None
        return 0

    def _start_comm(self, comm: Any) -> Any:
        """The comm backend, with its process group started (torchrun) or checked before any candidate.

        A missing group would otherwise fail every candidate the same way, one crash record each.
        """
        if comm is None:  # the comm backend's defaults, built without OmegaConf (a bare GPU box has torch only)
            entry = COMM_BACKENDS.get(self.cfg.comm)
            comm = entry.factory(entry.config_cls()) if entry.config_cls is not None else entry.factory()
        if getattr(comm, "needs_process_group", False):
            init_process_group_from_env(self.device)
            comm.check_ready(self.device)
        return comm

    def _gpu_problem(self, index: int) -> str:
        """Why the config does not describe this GPU (model, SM count, top clock); "" if it does, or on the CPU."""
        if not self.cuda:
            return ""
        torch = self._torch
        top = None
        if self.nvml is not None:
            try:
                top = self.nvml.max_sm_clock_mhz()
            except Exception:  # an NVML query this driver lacks: the SM count still checks
                top = None
        return gpu_mismatch(self.cfg, torch.cuda.get_device_name(index),
                            int(torch.cuda.get_device_properties(index).multi_processor_count), top)

    def _open_meter(self, index: int) -> tuple[Any, str]:
        """(the energy meter, why this GPU cannot be measured without one, or ""). A GPU without a meter
        would run every window in full and fail it, each candidate three times over, for no frontier;
        on the CPU, where the logic is checked, readings fail with the reason instead."""
        if not self.cuda:
            return NoEnergy("energy is unavailable on device cpu (no GPU energy counter)"), ""
        try:
            meter = energy_meter(self.cfg.energy, self.nvml, index, int(self.cfg.nvml_index))
        except ImportError as e:
            return NoEnergy(str(e)), (f"hardware.energy: {self.cfg.energy} needs the zeus package ({e}); install "
                                      f"it with pip install -e '.[runtime]', or use hardware.energy=nvml")
        if not isinstance(meter, NoEnergy):
            return meter, ""
        if self._nvml_error:
            meter.reason += f" ({self._nvml_error})"
        return meter, (f"hardware.energy: {meter.reason}; no candidate can be measured on {self.name} without "
                       f"energy; allowed: nvml, zeus")

    def _open_nvml(self, index: int) -> NVMLDevice | None:
        try:
            return NVMLDevice(nvml_index(index, self.cfg.nvml_index))
        except Exception as e:  # no NVML library or no permission: time still works, energy says why not
            self._nvml_error = f"{type(e).__name__}: {e}"
            return None

    # -- clock, temperature, time ------------------------------------------------------------------
    def set_clock(self, mhz: int) -> None:
        """Record the clock a frequency controller locked; windows are then checked against NVML's."""
        super().set_clock(mhz)
        self._clock_locked = True

    def release_clock(self) -> None:
        """The controller gave the clock back: the GPU picks its own clock again, nothing to check."""
        self._clock_locked = False

    def agree_max(self, value: float) -> float:
        """The group's largest ``value`` (to 0.001): what decides how many windows a rank measures
        (cooldowns, thermal anchors) must be decided alike on every rank, or collectives mismatch."""
        return self._agree(math.ceil(float(value) * 1000.0)) / 1000.0

    def agree_mean(self, value: float) -> float:
        """The group's mean of ``value``, identical on every rank (the same sum in rank order)."""
        gather = getattr(self.comm, "gather", None)
        if gather is None:
            return float(value)
        ranks = gather([float(value)], self.device)
        return math.fsum(row[0] for row in ranks) / len(ranks)

    def _agree(self, value: int) -> int:
        agree = getattr(self.comm, "agree", None)
        return int(agree(int(value), self.device)) if agree is not None else int(value)

    def temperature(self) -> float:
        """NVML's reading; after a failed read, the last good one. A transient NVML error raised here on
        one rank would stop that rank's search alone and leave its peers in their next collective."""
        if self.nvml is None:
            return self._idle_c
        try:
            self._last_c = self.nvml.temperature_c()
        except Exception as e:
            log.warning("NVML temperature read failed (%s: %s); using the last reading, %.0f C",
                        type(e).__name__, e, self._last_c)
        return self._last_c

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
        """One callable per op of the partition's chain (built once per partition): the partitioned
        executor's ops on the model's megatron-core layer (``layer_bench``): one nanobatch's, or the
        whole microbatch's for Megatron's layout (the reference); a partition of neither is refused
        with one line. A config that names no model gets stand-in kernels at the ops' shapes instead
        (scripts that check the runtime itself; the pipeline always gives the run's model)."""
        hit = self._compute.get(partition.key)
        if hit is None:
            layout = self.cfg.layout()
            if layout is None:
                from kareus.runtime.kernels import build_chain

                hit = build_chain(partition.compute, self.device, self.dtype, self.cfg.head_dim, self.cfg.scale)
            else:
                from kareus.runtime.layer_kernels import layer_kernels, partition_layout

                hit = layer_kernels(partition, self.layer_bench(partition_layout(partition, *layout)))
            self._compute[partition.key] = hit
        return hit

    def layer_bench(self, parallel: ParallelSpec | None = None) -> Any:
        """The megatron-core layer (a ``LayerBench``) of the config's model in ``parallel`` (default: the
        config's layout), built once per layout."""
        layout = self.cfg.layout()
        if layout is None:
            from kareus.errors import KareusError

            raise KareusError("hardware.model: this cuda backend names no model and layout to build a layer of; "
                              "set hardware.model and hardware.parallel (runtime.backend.with_layout)")
        model, parallel = layout[0], parallel or layout[1]
        bench = self._benches.get(parallel)
        if bench is None:
            from kareus.runtime.layer_kernels import LayerBench

            bench = self._benches[parallel] = LayerBench(model, parallel, self.device, self.dtype, seed=self.seed)
        return bench

    def comm_launch(self, partition: PartitionType, sms: int) -> Callable[[], Any]:
        return self._comm_call(partition.comm, sms, partition.key)

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
        """A plain op sequence (residual work) in order on the main stream; its collectives (pipeline
        send/recv, the embedding's and the loss's all-reduces) run alone at the comm library's default
        SMs, as Megatron issues them."""
        steps = self.residual_chain(ops)

        def run() -> None:
            for step in steps:
                step()

        return self._window(run, window_s)

    def residual_chain(self, ops: Sequence[Op]) -> list[Callable[[], Any]]:
        """One callable per op of ``ops``, in order: compute kernels, and collectives that wait for
        their end before the next op (built once per sequence and cached)."""
        key = "ops:" + repr(tuple(ops))  # every field: a collective's size is its message_bytes
        hit = self._compute.get(key)
        if hit is None:
            from kareus.runtime.kernels import build_kernel

            hit = [self._blocking(self._comm_call(o, self.gpu.default_comm_sms)) if o.is_comm
                   else build_kernel(o, self.device, self.dtype, self.cfg.head_dim, self.cfg.scale) for o in ops]
            self._compute[key] = hit
        return hit

    def _comm_call(self, op: Op, sms: int, key: str | None = None) -> Callable[[], Any]:
        """The comm backend's launcher for ``op`` at ``sms`` SMs, prepared once per (key, SMs)."""
        k = (key or "op:" + repr(op), int(sms))  # every field: two sizes must not share buffers
        hit = self._comm.get(k)
        if hit is None:
            hit = self.comm.prepare(op, int(sms), self.device)
            self._comm[k] = hit
        return hit

    @staticmethod
    def _blocking(launch: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            _wait(launch())

        return run

    def space(self, partition: PartitionType) -> list[Candidate] | None:
        return None

    def partition_problems(self, partitions: Sequence[PartitionType]) -> list[str]:
        """Partitions this backend cannot measure, found before the first candidate: a layout the
        megatron-core layer cannot stand in for (sequence or context parallel), a partition that is not
        of the config's model and layout, or a comm op this run's process group cannot measure (the comm
        backend sizes collectives by the world, so a layout whose partitions communicate over groups of
        different sizes, tensor and context parallel, would stop at the first partition of the other
        group, after the GPU-time spent on the others)."""
        layout = self.cfg.layout()
        if layout is not None:
            from kareus.runtime.layer_kernels import LayerBenchError, bench_problems, partition_layout

            problems = bench_problems(*layout)
            if problems:  # every partition of the layout alike
                return [f"partition {p.key}: {problems[0]}" for p in partitions]
            wrong = []
            for p in partitions:
                try:
                    partition_layout(p, *layout)
                except LayerBenchError as e:
                    wrong.append(str(e))
            if wrong:
                return wrong
        check = getattr(self.comm, "check_world", None)
        if not getattr(self.comm, "needs_process_group", False) or check is None:
            return []
        from kareus.runtime.comm import CommSetupError

        world, out = self.comm.world_size(), []
        for p in partitions:
            try:
                check(p.comm, world)
            except CommSetupError as e:
                out.append(f"partition {p.key}: {e}")
        return out


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

    def _calibrate(self, run: Callable[[], None], window_s: float) -> float:
        """Seconds per execution, from back-to-back batches that double until one fills 5% of the window.

        One lone execution carries the launch's fixed costs and cold caches: a window sized from it
        ran up to 2.5x short of the asked length (seen on the CPU). Ranks of a TP group agree on every
        doubling, so each issues the same collectives. Costs 15-30% of the window.
        """
        n, t = 1, self._timed(run, 1)
        while self._agree(int(n * t < 0.05 * window_s and n < 1 << 16)):
            n *= 2
            t = self._timed(run, n)
        return min(t, self._timed(run, n))

    def _window(self, run: Callable[[], None], window_s: float) -> Reading:
        for _ in range(max(0, self.cfg.warmup)):
            run()
        t1 = self._calibrate(run, window_s)
        # ranks of a TP group calibrate apart but must run as many collectives
        n = self._agree(max(1, int(math.ceil(window_s / max(t1, 1e-9)))))
        self.synchronize()
        torch = self._torch
        wall = time.perf_counter()
        began: Exception | None = None
        try:
            self.energy.begin()
        except Exception as e:  # an NVML/Zeus hiccup: the window still runs, so this rank issues the
            began = e  # collectives its peers do, and the group then retries it together
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(self.main)
        for _ in range(n):
            run()
        if self.cuda:  # the end marker first: a GPU that drained the queue already must not wait for the sample
            end.record(self.main)
        freq = self._sampled_clock()  # sampled while the queued work runs
        if self.cuda:
            end.synchronize()
            elapsed = begin.elapsed_time(end) / 1000.0
        else:
            elapsed = time.perf_counter() - wall
        return self._finish(elapsed, n, freq, began)

    def _finish(self, elapsed: float, n: int, freq: float, raised: Exception | None = None) -> Reading:
        """End the window and agree its outcome; every rank issues the same collectives whatever happened
        (``raised``: the meter failed to start the window)."""
        try:
            energy, why = self._end_energy()
            temperature = self.temperature()
        except Exception as e:  # an NVML/Zeus hiccup (counter, temperature): a read error, retried
            raised = raised or e
        # the group's time, the slowest rank's (collectives couple them): every rank then judges the
        # window's length alike, and the profiler retries a short one on all ranks or on none
        elapsed = self._agree(math.ceil(elapsed * 1e9)) / 1e9
        if raised is not None:
            return self._group_verdict(raised)
        problem = why or self._clock_problem(freq)
        reading = self._group_verdict(Reading(elapsed / n, energy / n, temperature, freq, elapsed, n, not problem,
                                              problem))
        return self._group_reading(reading)

    def _group_reading(self, r: Reading) -> Reading:
        """The group's reading, identical on every rank: energy and clock the ranks' means,
        temperature the hottest rank's. Every rank runs the search itself on its readings; per-GPU
        numbers would fit different surrogates and pick different candidates, and the ranks would
        then launch different collectives. The mean keeps the per-GPU scale that static power and
        the plans use."""
        gather = getattr(self.comm, "gather", None)
        if gather is None:
            return r
        ranks = gather([float(_usable(r)), r.energy_j, r.freq_mhz, r.temperature_c], self.device)
        if len(ranks) == 1 or not all(row[0] for row in ranks):
            return r  # a window some rank cannot use fails on every rank (the verdict): its own reason stands
        return replace(r, energy_j=math.fsum(row[1] for row in ranks) / len(ranks),
                       freq_mhz=math.fsum(row[2] for row in ranks) / len(ranks),
                       temperature_c=max(row[3] for row in ranks))

    def _end_energy(self) -> tuple[float, str]:
        """Joules of the window, or NaN and why this device has no meter."""
        try:
            return float(self.energy.end()), ""
        except EnergyUnavailable as e:
            return math.nan, str(e)

    def _clock_problem(self, freq: float) -> str:
        """Why the window did not run under the locked clock ("" if NVML's clock is at most one step
        above it). Above the lock, the lock did not hold and the reading would be filed under a clock
        it never ran at. Below it is power or thermal throttling, which training at that lock meets
        too, so the reading stands (it carries the sampled clock). Checked only while a controller
        holds the lock.
        """
        if not self._clock_locked or self.nvml is None or not math.isfinite(freq):
            return ""
        if freq <= self._clock + self.gpu.step_mhz:
            return ""
        return (f"clock: NVML read {freq:.0f} MHz during the window, above the {self._clock} MHz locked "
                f"(more than one {self.gpu.step_mhz} MHz step: the lock did not hold)")

    def _group_verdict(self, outcome: Reading | Exception) -> Reading:
        """The window's outcome as the whole group sees it: every rank fails or retries it together.

        The profiler retries a failed read by measuring again; a rank that did so alone would wait in
        its next collective for peers that moved on, and the group would hang. Each rank's verdict
        (0 good, 1 invalid reading, 2 read error) is agreed and the worst holds on every rank: a read
        error becomes a ReadError everywhere (retried), an invalid reading a failed one everywhere.
        """
        raised = outcome if isinstance(outcome, Exception) else None
        local = 2 if raised is not None else (0 if _usable(outcome) else 1)
        worst = self._agree(local)
        if worst >= 2:
            from kareus.profiler.profiler import ReadError

            why = f"{type(raised).__name__}: {raised}" if raised is not None else \
                "another rank of the group failed to read its window"
            raise ReadError(why) from raised
        if worst == 1 and local == 0:
            return replace(outcome, ok=False, error="another rank of the group read an invalid window")
        return outcome

    def _sampled_clock(self) -> float:
        if self.nvml is None:
            return float(self._clock)
        try:
            return self.nvml.sm_clock_mhz()
        except Exception:  # pragma: no cover - NVML hiccup: report the locked clock
            return float(self._clock)

    def close(self) -> None:
        """Destroy the comm backend's process groups and release NVML (the default group stays: the
        process may build another backend; it is destroyed at exit)."""
        close = getattr(self.comm, "close", None)
        try:
            benches = getattr(self, "_benches", {})
            if benches:
                self._compute.clear()
            while benches:
                benches.popitem()[1].close()
            if callable(close):
                close()
        finally:
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


def _usable(r: Reading) -> bool:
    """A reading the profiler can use: ok, with finite positive time and energy."""
    return r.ok and math.isfinite(r.time_s) and r.time_s > 0 and math.isfinite(r.energy_j) and r.energy_j > 0


def _wait(handle: Any) -> None:
    if handle is not None and hasattr(handle, "wait"):
        handle.wait()


@HARDWARE.register("cuda", CudaConfig)
def build_cuda(cfg: CudaConfig, seed: int = 0, comm: Any = None) -> CudaBackend:
    """Real kernels on a CUDA GPU (or the CPU for checks), energy from NVML/Zeus."""
    return CudaBackend(cfg, comm=comm, seed=seed)
