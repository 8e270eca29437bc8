"""The training loop of ``mode=train``: process group, model, executors, iterations, measurements.

Megatron's layout runs as a plan too (:func:`kareus.plan.fixed.layout_plan`: every instruction's
partitions are Megatron's, at the GPU's top clock), so both layouts go through the same hooks and the
same layer spec, and a comparison differs in nothing but the plan.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

from kareus.errors import KareusError
from kareus.train.measure import Iteration, Meter, gather
from kareus.train.plans import TrainPlan

SWITCH_PRICE_FAR = 2.0  # a measured clock-switch cost this many times off the priced one gets a warning


class SwitchTimer:
    """A clock controller wrapper that times each switch: the drain before it and the lock itself."""

    def __init__(self, inner: Any, sync: Any) -> None:
        self.inner, self._sync = inner, sync
        self.locks_gpu = getattr(inner, "locks_gpu", True)
        self.costs: list[float] = []
        self._drain = 0.0

    def sync(self) -> None:
        t = time.perf_counter()
        self._sync()
        self._drain = time.perf_counter() - t

    def set(self, mhz: int) -> None:
        t = time.perf_counter()
        self.inner.set(mhz)
        self.costs.append(self._drain + time.perf_counter() - t)

    def reset(self) -> None:
        self.inner.reset()

    def median(self) -> float | None:
        return statistics.median(self.costs) if self.costs and self.locks_gpu else None


class NoClock:
    """The CPU's stand-in for a clock controller: switches are counted, none is applied (no GPU clock)."""

    locks_gpu = False

    def set(self, mhz: int) -> None:
        pass

    def reset(self) -> None:
        pass


class Trainer:
    def __init__(self, cfg: Any, typed: dict[str, Any], model: Any, parallel: Any, tplan: TrainPlan,
                 console: Any) -> None:
        import torch
        from megatron.core import parallel_state as ps

        from kareus.plan.fixed import layout_plan
        from kareus.runtime.executor import PlanExecutor
        from kareus.runtime.partitioned import CommIssuer, PlanRuntime, layer_spec, plan_sms
        from kareus.train.model import build_gpt, finalize_grads, mock_batches

        self.cfg, self.tc, self.model, self.parallel, self.tplan, self.console = cfg, cfg.train, model, parallel, tplan, console
        want = str(self.tc.device)  # auto | cpu | cuda (validated with the config)
        cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
        if cuda and not torch.cuda.is_available():
            raise KareusError("train.device: cuda asked for, but torch sees no GPU; use train.device=cpu")
        if self.tc.comm == "mscclpp" and not cuda:
            raise KareusError("train.comm: mscclpp runs on GPUs only; use train.comm=nccl with train.device=cpu")
        self.device = self._start(cuda, int(cfg.seed))
        self.rank = torch.distributed.get_rank()
        stage = ps.get_pipeline_model_parallel_rank()
        self.runtime = PlanRuntime(model, parallel, stage=stage)
        dtype = torch.bfloat16 if cuda else torch.float32
        self.gpt = build_gpt(model, parallel, layer_spec(self.runtime), dtype, cpu=not cuda)
        if cuda:
            self.gpt.cuda(self.device)
        self.runtime.check_model(self.gpt.config)
        self.gpt.config.finalize_model_grads_func = finalize_grads
        # the plan's comm SM counts: one NCCL communicator each (or MSCCL++'s per-launch blocks), made on every rank alike
        sms = plan_sms(tplan.plan) if tplan.plan is not None else []
        self.runtime.comm = CommIssuer.for_device(self.device, sms, backend=str(self.tc.comm))
        if self.rank == 0:
            console.print(f"comm: {self.runtime.comm_summary(sms)}")
        gpu = typed["hardware"].gpu_spec()
        self.timer = SwitchTimer(self._controller(typed, cuda), torch.cuda.synchronize if cuda else (lambda: None))
        self.executors = {"megatron": PlanExecutor(layout_plan(model, parallel, int(gpu.max_mhz), None), self.timer,
                                                   stage, sync=self.timer.sync)}
        if tplan.plan is not None:
            try:
                self.executors["plan"] = PlanExecutor(tplan.plan, self.timer, stage, sync=self.timer.sync)
            except ValueError as err:  # several clocks with a controller that leaves the clock to the GPU
                raise KareusError(f"profiler.frequency: {err}") from None
        self.optimizer = torch.optim.AdamW([p for p in self.gpt.parameters() if p.requires_grad], lr=float(self.tc.lr))
        self.data = mock_batches(model, parallel, int(self.tc.data_seed), self.device)
        energy = str(getattr(typed["hardware"], "energy", "none")) if cuda else "none"
        self.meter = Meter(self.device, energy, int(getattr(typed["hardware"], "nvml_index", -1)))
        self.priced_switch_s = float(tplan.plan.clock_switch_s) if tplan.plan is not None else None

    def _start(self, cuda: bool, seed: int) -> Any:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        p = self.parallel
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if not cuda:
            from kareus.runtime.megatron_cpu import init_parallel

            init_parallel(p.tp, p.pp, p.cp, seed=seed)
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", rank=int(os.environ.get("RANK", "0")),
                                    world_size=int(os.environ.get("WORLD_SIZE", "1")), device_id=device)
        ps.initialize_model_parallel(p.tp, p.pp, context_parallel_size=p.cp)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return device

    def _controller(self, typed: dict[str, Any], cuda: bool) -> Any:
        """The configured frequency controller on a GPU (the simulator's drives no real GPU: the clock is
        left as found there); on the CPU, no clock at all."""
        from kareus.profiler.frequency import UnlockedFrequencyConfig, UnlockedFrequencyController
        from kareus.registry import FREQUENCY_CONTROLLERS

        section = dict(self.cfg.profiler.frequency)
        if not cuda:
            return NoClock()
        if section.get("name") in ("sim", "unlocked"):
            return UnlockedFrequencyController(UnlockedFrequencyConfig())
        return FREQUENCY_CONTROLLERS.build(section["name"], None, config=section)

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        tc = self.tc
        layouts = ["plan", "megatron"] if tc.compare else (["plan"] if self.tplan.plan is not None else ["megatron"])
        iterations: list[Iteration] = []
        n = int(tc.iterations)
        blocks = int(tc.blocks) if tc.compare else 1  # 2..n with compare (validated with the config)
        for layout in layouts:  # warm-up of each layout, left out of every number
            self._block(layout, int(tc.warmup), -1, [])
        sizes = [n // blocks + (1 if b < n % blocks else 0) for b in range(blocks)]
        counter = [0]
        for b, size in enumerate(sizes):
            for layout in layouts:
                self._block(layout, size, b, iterations, counter)
        runtime = self.runtime.counters
        totals = gather([runtime.overlapped, runtime.sequential])
        switch = self.timer.median()
        self._warn_switch_price(switch)
        return {"iterations": iterations, "device": self._device_name(), "world": len(totals),
                "overlapped": int(sum(r[0] for r in totals)), "sequential": int(sum(r[1] for r in totals)),
                "switch_s": {"measured_median": switch, "priced": self.priced_switch_s,
                             "switches_timed": len(self.timer.costs)},
                "energy": "measured" if self.meter.meter is not None else f"unavailable: {self.meter.unmetered}"}

    def _block(self, layout: str, count: int, block: int, out: list, counter: list | None = None) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from kareus.runtime.megatron import plan_hooks
        from kareus.train.model import forward_step

        if count <= 0:
            return
        executor = self.executors[layout]
        self.runtime.bind(executor)
        step = forward_step()
        with plan_hooks(executor, config=self.gpt.config):
            schedule = get_forward_backward_func()  # inside the hooks: the schedule they wrap
            for _ in range(count):
                switches = executor.switch_count
                self.meter.begin()
                self.optimizer.zero_grad(set_to_none=True)
                losses = schedule(forward_step_func=step, data_iterator=self.data, model=self.gpt,
                                  num_microbatches=self.parallel.num_microbatches, seq_length=self.parallel.seq_len,
                                  micro_batch_size=self.parallel.micro_batch_size, forward_only=False)
                self.optimizer.step()
                elapsed, energy = self.meter.end()
                loss = statistics.fmean(float(x["loss"]) for x in losses) if losses else None
                rows = gather([loss, elapsed, energy, executor.switch_count - switches])
                if counter is None:
                    continue
                energies = [r[2] for r in rows]
                out.append(Iteration(counter[0], layout, max(block, 0),
                                     next(r[0] for r in rows if r[0] is not None), max(r[1] for r in rows),
                                     None if None in energies else sum(energies), int(max(r[3] for r in rows))))
                counter[0] += 1

    def _warn_switch_price(self, measured: float | None) -> None:
        priced = self.priced_switch_s
        if measured is None or priced is None or self.rank != 0:
            return
        if priced <= 0 or not 1 / SWITCH_PRICE_FAR <= measured / priced <= SWITCH_PRICE_FAR:
            self.console.print(f"warning: a clock switch measured {1e3 * measured:.1f} ms (median), the plan was "
                               f"composed with {1e3 * priced:.1f} ms: compose again with "
                               f"hardware.clock_switch_s={measured:.4f}")

    def note_run_dir(self, run_dir: Any) -> None:
        """Learn rank 0's run folder (``first_run_dir``): the other ranks' Hydra folders are removed,
        unless it is theirs too (one ``hydra.run.dir`` for all)."""
        import torch.distributed as dist

        dirs: list = [None] * dist.get_world_size()
        dist.all_gather_object(dirs, str(run_dir))
        self.first_run_dir = dirs[0]

    def _device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def close(self) -> None:
        for ex in getattr(self, "executors", {}).values():
            ex.reset()
