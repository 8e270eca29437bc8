"""Datasheet fields shared by every hardware config, so validation can size things without a backend."""
from __future__ import annotations

from dataclasses import dataclass

from kareus.config.bounds import out_of_bounds
from kareus.hardware.base import GPUSpec


@dataclass
class GPUConfig:
    """The GPU's datasheet description; the defaults are the A100-SXM4-40GB (the published testbed)."""

    name: str = "sim"
    gpu: str = "A100-SXM4-40GB"
    sms: int = 108
    min_mhz: int = 210
    max_mhz: int = 1410
    step_mhz: int = 15
    static_power_w: float = 85.0  # power of a GPU blocked in a pipeline receive (the published definition)
    tdp_w: float = 400.0
    idle_power_w: float = 60.0
    memory_gb: float = 40.0
    hbm_gbps: float = 1555.0
    nvlink_gbps: float = 600.0  # bidirectional; each direction carries half
    network_gbps: float = 25.0  # 200 Gb/s per GPU across nodes
    peak_tflops: float = 312.0  # dense bf16/fp16 tensor core
    gpus_per_node: int = 8
    max_comm_sms: int = 32
    # The comm library's untuned SM count (NCCL's default channel count for NVLink all-reduce,
    # one CTA per channel): the Megatron reference point runs with it.
    default_comm_sms: int = 16
    # GPU idle time per clock change between pipeline instructions (the executor drains the device,
    # then locks the next clock), priced into every plan's predicted time; 0: not priced
    clock_switch_s: float = 0.0

    def real_clock(self) -> bool:
        """Whether this backend runs on a physical GPU whose clock a frequency controller must lock."""
        return False

    def recorded_space(self) -> bool:
        """Whether this backend answers only a recorded set of settings (replay): ``search.space``
        then filters that set by its explicit fields alone, and its defaults do not apply."""
        return False

    def gpu_spec(self) -> GPUSpec:
        """The GPUSpec this config describes; needs no backend (config validation calls it)."""
        problems = []
        if self.sms <= 0:
            problems.append(f"hardware.sms: must be > 0, got {self.sms}")
        if not 0 < self.min_mhz <= self.max_mhz:
            problems.append(f"hardware.min_mhz: must satisfy 0 < min_mhz <= max_mhz, got {self.min_mhz}..{self.max_mhz}")
        if self.step_mhz <= 0:
            problems.append(f"hardware.step_mhz: must be > 0, got {self.step_mhz}")
        elif 0 < self.min_mhz <= self.max_mhz and (self.max_mhz - self.min_mhz) % self.step_mhz:
            problems.append(f"hardware.min_mhz/max_mhz: {self.min_mhz}..{self.max_mhz} MHz is no whole number of "
                            f"step_mhz={self.step_mhz} steps; a GPU locks max_mhz less whole steps")
        if self.sms > 0 and not 0 < self.max_comm_sms < max(self.sms, 2):  # (no bound to name from a bad sms)
            problems.append(f"hardware.max_comm_sms: must be in 1..{self.sms - 1}, got {self.max_comm_sms}")
        if not 0 < self.default_comm_sms <= self.max_comm_sms:
            problems.append(f"hardware.default_comm_sms: must be in 1..max_comm_sms={self.max_comm_sms}, "
                            f"got {self.default_comm_sms}")
        problems += out_of_bounds(self, "hardware.", nonnegative=("static_power_w", "idle_power_w", "clock_switch_s"),
                                  positive=("tdp_w", "memory_gb", "hbm_gbps", "nvlink_gbps", "network_gbps",
                                            "peak_tflops", "gpus_per_node"))
        for key in ("static_power_w", "idle_power_w"):
            if getattr(self, key) >= self.tdp_w > 0:
                problems.append(f"hardware.{key}: must be below tdp_w ({self.tdp_w}), got {getattr(self, key)}")
        if problems:
            raise ValueError("\n".join(problems))  # every problem, one per line
        return GPUSpec(
            name=self.gpu, sms=self.sms, min_mhz=self.min_mhz, max_mhz=self.max_mhz, step_mhz=self.step_mhz,
            static_power_w=self.static_power_w, tdp_w=self.tdp_w, idle_power_w=self.idle_power_w,
            memory_gb=self.memory_gb, hbm_gbps=self.hbm_gbps, nvlink_gbps=self.nvlink_gbps,
            network_gbps=self.network_gbps, peak_tflops=self.peak_tflops, gpus_per_node=self.gpus_per_node,
            max_comm_sms=self.max_comm_sms, default_comm_sms=self.default_comm_sms,
            clock_switch_s=self.clock_switch_s,
        )
