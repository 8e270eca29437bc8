"""Plausible ranges of the simulator's assumed parameters: the one place they are stated.

A parameter is *assumed* where its ``conf/hardware/*_sim.yaml`` comment starts with "assumed" (or "A100
prior carried over"): a prior no public measurement pins down, unlike the datasheet, paper and fitted
values. Claims made on the simulated GPU hold only as far as they survive these ranges, so the held-out
workloads (``benchmarks/heldout.py``) and the sensitivity study (``benchmarks/paper.py --sensitivity``)
draw from here, and each YAML comment states its parameter's range as ``Range.text`` writes it (a test
holds the two together).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "conf" / "hardware"


@dataclass(frozen=True)
class Range:
    """Where an assumed parameter plausibly lies: factors on the shipped value (``relative``) or
    absolute values, and why."""

    low: float
    high: float
    source: str
    relative: bool = True

    def bounds(self, shipped: float) -> tuple[float, float]:
        """The absolute (low, high) around ``shipped``."""
        return (shipped * self.low, shipped * self.high) if self.relative else (self.low, self.high)

    def text(self) -> str:
        """The range as the YAML comments state it: ``range x0.85..x1.1`` or ``range 0.001..0.003``."""
        x = "x" if self.relative else ""
        return f"range {x}{self.low:g}..{x}{self.high:g}"


HOST = "public TE/PyTorch CPU-overhead reports: per-op Python + launch costs vary ~0.7-1.4x across hosts"
RANGES: dict[str, Range] = {
    "static_power_w": Range(0.8, 1.2, "H100/H200 only (the A100's is the paper's): no published figure"),
    "eff_gemm": Range(0.85, 1.1, "cuBLAS bf16 GEMMs of these sizes reach ~64-83% of peak"),
    "eff_attention": Range(0.8, 1.2, "FlashAttention-2 forward reaches ~44-66% of peak (FA2 paper)"),
    "eff_memory": Range(0.8, 1.3, "unfused elementwise kernels reach ~40-65% of HBM peak"),
    "gemm_tile_flops": Range(0.5, 2.0, "cuBLAS picks 64- to 256-wide tiles; K varies with the layer"),
    "memory_sat_frac": Range(0.7, 1.3, "a third to two thirds of the SMs saturate HBM"),
    "host_gemm_s": Range(0.7, 1.4, HOST),
    "host_attention_s": Range(0.7, 1.4, HOST),
    "host_norm_s": Range(0.7, 1.4, HOST),
    "host_elementwise_s": Range(0.7, 1.4, HOST),
    "host_rope_s": Range(0.7, 1.4, HOST),
    "host_comm_s": Range(0.7, 1.4, HOST),
    "host_tail_s": Range(0.7, 1.4, HOST),
    "launch_latency_s": Range(0.5, 2.0, "kernel launch latency on an idle GPU is ~2.5-10 us"),
    "comm_clock_exp": Range(0.75, 1.2, "between latency-bound (~0.6) and issue-bound (~1) per-SM comm rates"),
    "comm_latency_s": Range(0.5, 2.0, "NVLink ring step latency ~2.5-10 us"),
    "network_link_eff": Range(0.8, 1.05, "NCCL over InfiniBand reaches ~70-95% of line rate"),
    "comm_sharpness": Range(0.75, 2.0, "soft-minimum shape between 1.5 (gradual) and 4 (near hard)"),
    "act_attention": Range(0.85, 1.1, "attention's tensor-core activity ~0.75-1.0 of a GEMM's"),
    "act_memory": Range(0.7, 1.4, "streaming kernels' SM activity ~0.25-0.5 of a GEMM's"),
    "act_comm": Range(0.6, 1.5, "the comm kernel's SM activity ~0.2-0.45 of a GEMM's"),
    "link_pj_per_byte": Range(0.5, 2.0, "NVLink SerDes plus switch energy within a factor of two"),
    "v_min": Range(0.93, 1.1, "Ampere/Hopper V/f curves bottom out at ~0.65-0.77 of the top voltage"),
    "v_knee_mhz": Range(0.85, 1.1, "where voltage starts to rise: within ~15% of the stated clock"),
    "ambient_c": Range(0.85, 1.15, "data-center inlet air ~25-35 C"),
    "thermal_r_c_per_w": Range(0.8, 1.25, "a GPU at TDP runs ~60-80 C"),
    "thermal_tau_s": Range(0.6, 1.6, "heatsink time constants of 15-40 s"),
    "static_ref_c": Range(0.9, 1.1, "the static figure was read at ~50-60 C"),
    "static_temp_coeff": Range(0.6, 1.4, "leakage grows ~0.4-0.8% of the static figure per C"),
    "time_noise": Range(0.001, 0.003, "relative jitter of a reading's time, around the real table's repeat "
                        "spread (repeat_spread in runs/bench/sim_fidelity.json)", relative=False),
    "power_noise": Range(0.004, 0.016, "relative jitter of power: readings' energy spread from the real "
                         "table's 1200 MHz repeats to its 1410 MHz ones (repeat_spread in "
                         "runs/bench/sim_fidelity.json)", relative=False),
}
# Labelled assumed, yet a convention or a mode rather than a prior: kept at the shipped value.
FIXED: dict[str, str] = {
    "act_gemm": "the reference activity (1 by definition; p_sm_w, fitted, carries the scale)",
    "v_max": "only the ratio V(f)/V(f_max) matters",
    "comm_hbm_per_byte": "the ring algorithm's byte count",
    "comm_waits_for_dispatch": "a switch between two mechanisms, off as shipped",
}
NOT_VARIED = "not varied"  # what a FIXED parameter's YAML comment states in place of a range
FRACTIONS = ("eff_gemm", "eff_attention", "eff_memory", "memory_sat_frac", "network_link_eff")  # kept at most 1

_LINE = re.compile(r"^(\w+):[^#]*#\s*(.*)$")


def labelled(config: str | Path) -> dict[str, str]:
    """Key -> comment of every parameter a sim YAML (a path, or a name under conf/hardware) labels assumed."""
    path = Path(config) if Path(config).suffix else HARDWARE_DIR / f"{config}.yaml"
    out = {}
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if m and (m.group(2).lower().startswith("assumed") or m.group(2).startswith("A100 prior carried over")):
            out[m.group(1)] = m.group(2)
    return out


def draw(values: Mapping[str, Any], keys: Iterable[str], rng: random.Random) -> dict[str, Any]:
    """``values`` with each of ``keys`` (in sorted order) drawn uniformly within its range; a fraction
    stays at most 1 and ``v_knee_mhz`` an integer below the top clock."""
    out = dict(values)
    for key in sorted(keys):
        r = RANGES[key]
        value = out[key] * rng.uniform(r.low, r.high) if r.relative else rng.uniform(r.low, r.high)
        if key in FRACTIONS:
            value = min(value, 1.0)
        if key == "v_knee_mhz":
            value = min(int(round(value)), out["max_mhz"] - out["step_mhz"])
        out[key] = value
    return out
