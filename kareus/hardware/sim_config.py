"""The simulated GPU's parameters: datasheet fields (GPUConfig) plus what datasheets leave open.

Every default is the A100-SXM4-40GB (as conf/hardware/a100_sim.yaml, which gives each value's
source). Seven are fitted by benchmarks/sim_fidelity.py to the real A100 table: host_scale,
comm_sm_gbps, comm_link_eff, contention_sm, contention_hbm, p_sm_w, and the recorded harness's
per-call idle host_gap_s, which Kareus' own profiler and runtime do not have (``host_ahead``). The
assumed ones' plausible ranges are kareus/hardware/assumed.py's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kareus.config.bounds import out_of_bounds
from kareus.hardware.spec import GPUConfig


@dataclass
class SimConfig(GPUConfig):
    """Schema of ``hardware=*_sim``: a calibrated, deterministic simulated GPU."""

    name: str = "sim"
    # kernels: fraction of the roofline a kernel kind reaches on the whole GPU at the top clock
    eff_gemm: float = 0.75
    eff_attention: float = 0.55
    eff_memory: float = 0.5  # fraction of HBM bandwidth a streaming kernel reaches
    vector_tflops: float = 19.5  # CUDA-core rate used by non-tensor kernels (their FLOPs are small)
    gemm_tile_flops: float = 6.7e7  # FLOPs of one GEMM tile (128x128 outputs, K=2048): wave quantization
    memory_sat_frac: float = 0.5  # fraction of SMs a streaming kernel needs to saturate HBM
    # host: time the framework's Python code takes to issue one op, by kind (kernels start once issued)
    host_gemm_s: float = 8.0e-5  # a Transformer Engine linear (module code + cuBLASLt launch)
    host_attention_s: float = 1.5e-4  # Transformer Engine dot-product attention (backend selection + launch)
    host_norm_s: float = 6.0e-5  # a fused layernorm / RMSNorm op
    host_elementwise_s: float = 8.0e-5  # a few eager PyTorch elementwise / reshape ops
    host_rope_s: float = 3.0e-4  # unfused rotary embedding: ~16-20 eager PyTorch ops on q and k
    host_comm_s: float = 3.0e-5  # launching the comm kernel on its stream
    host_tail_s: float = 3.0e-4  # per-call host work after the last op is issued (overlaps GPU work)
    host_scale: float = 0.9572  # common factor on the host times above (the host CPU's speed)
    launch_latency_s: float = 5.0e-6  # from issue to the kernel running on an idle GPU
    # Kareus' profiler and runtime issue calls back to back without a sync, so the host of a GPU-bound
    # call runs ahead of it; the recorded table's harness synced each call and then idled host_gap_s
    host_ahead: bool = True
    host_gap_s: float = 0.0  # GPU idle per call after a per-call sync (the recorded harness: 9.909e-4)
    comm_gated: bool = True  # the comm waits on the GPU for op start-1 (else it starts when the host issues it)
    comm_waits_for_dispatch: bool = False  # a comm launched beside a multi-wave kernel starts at its last wave
    # collectives
    comm_sm_gbps: float = 6.542  # link throughput one comm SM drives at the top clock
    comm_clock_exp: float = 0.8  # per-SM comm throughput ~ clock^exp (issue-bound part vs fixed latency)
    comm_latency_s: float = 5.0e-6  # per ring step
    comm_link_eff: float = 0.1916  # fraction of the NVLink bandwidth a collective reaches
    network_link_eff: float = 0.9  # fraction of the network (InfiniBand) bandwidth a collective reaches
    comm_sharpness: float = 2.0  # how sharply bandwidth saturates (soft minimum exponent)
    comm_hbm_per_byte: float = 2.0  # HBM bytes per link byte (read local, write result)
    # overlap contention
    contention_sm: float = 0.14  # comm slowdown beside any kernel (shared issue slots, L2)
    contention_hbm: float = 0.95  # extra comm slowdown beside a kernel that saturates HBM (queueing)
    # power
    p_sm_w: float = 564.0  # dynamic power of all SMs fully active at the top clock and voltage
    act_gemm: float = 1.0
    act_attention: float = 0.9
    act_memory: float = 0.35
    act_comm: float = 0.3
    hbm_pj_per_byte: float = 31.0
    link_pj_per_byte: float = 10.0
    v_min: float = 0.70
    v_max: float = 1.00
    v_knee_mhz: int = 1005
    # thermal
    ambient_c: float = 30.0
    thermal_r_c_per_w: float = 0.09
    thermal_tau_s: float = 25.0
    static_ref_c: float = 55.0  # temperature at which static power equals static_power_w
    static_temp_coeff: float = 0.006  # relative static-power rise per degree C
    # heat physics of another form than the cooldown policies assume (kareus/hardware/heat.py): all off
    # here; benchmarks/cooldown.py turns them on, with the values it states and where they come from
    thermal_fast_frac: float = 0.0  # share of thermal_r_c_per_w in a fast die-to-heatsink stage (0: one stage)
    thermal_fast_tau_s: float = 2.0  # that stage's time constant; thermal_tau_s is then the heatsink-to-air one
    static_temp_curvature: float = 0.0  # per C: leakage grows as exp(this x (T - static_ref_c)) (0: linear)
    fan_r_scale: float = 1.0  # heatsink-to-air resistance with the fans high, relative to low (1: no fan step)
    fan_on_c: float = 48.0  # the fans go high above this die temperature ...
    fan_hysteresis_c: float = 3.0  # ... and back low below fan_on_c minus this
    # measurement
    counter_period_s: float = 0.1  # NVML energy counter update period
    time_noise: float = 0.002  # relative run-to-run jitter of execution time
    power_noise: float = 0.004  # relative run-to-run jitter of power
    fail_rate: float = 0.0  # probability that a reading fails (tests inject failures with it)
    # drift since a run was measured (mode=check's tests and benchmark create it): every execution takes
    # (1 + drift) x its time at unchanged power, as an efficiency loss would (firmware, a degraded link)
    drift: float = 0.0

    def problems(self, ctx: object = None) -> list[str]:
        """Config-time checks (run by validate()): physical ranges of the simulator's parameters. A
        sign the other way turns a response around (comm faster at a lower clock, a GPU cooled below
        ambient by its own heat) or divides by zero mid-search."""
        out = []
        for k in ("eff_gemm", "eff_attention", "eff_memory", "comm_link_eff", "network_link_eff", "memory_sat_frac"):
            if not 0 < getattr(self, k) <= 1:
                out.append(f"hardware.{k}: must be in (0, 1], got {getattr(self, k)}")
        for k in ("contention_sm", "contention_hbm", "fail_rate"):
            if not 0 <= getattr(self, k) <= 1:
                out.append(f"hardware.{k}: must be in [0, 1], got {getattr(self, k)}")
        for k in ("ambient_c", "static_ref_c"):  # any finite temperature will do; nan made every reading nan
            if not math.isfinite(getattr(self, k)):
                out.append(f"hardware.{k}: must be a finite temperature in C, got {getattr(self, k)}")
        for k in ("time_noise", "power_noise"):  # Gaussian relative jitter: wider, a reading may go negative
            if not 0 <= getattr(self, k) <= MAX_NOISE:
                out.append(f"hardware.{k}: must be in [0, {MAX_NOISE}], got {getattr(self, k)}")
        out += out_of_bounds(self, "hardware.", nonnegative=(
            "host_gemm_s", "host_attention_s", "host_norm_s", "host_elementwise_s", "host_rope_s", "host_comm_s",
            "host_tail_s", "host_gap_s", "launch_latency_s", "comm_latency_s", "comm_hbm_per_byte", "act_gemm",
            "act_attention", "act_memory", "act_comm", "hbm_pj_per_byte", "link_pj_per_byte", "static_temp_coeff",
            "comm_clock_exp", "thermal_r_c_per_w", "v_knee_mhz",  # 0: no clock dependence, no self-heating
        ), positive=(
            "vector_tflops", "gemm_tile_flops", "comm_sm_gbps", "p_sm_w", "v_max", "v_min",
            "thermal_tau_s", "counter_period_s", "host_scale",
        ))
        if not (math.isfinite(self.drift) and -0.5 < self.drift <= 1.0):  # a GPU at most twice as slow, or half
            out.append(f"hardware.drift: must be in (-0.5, 1], got {self.drift}")
        if self.v_min > self.v_max:
            out.append(f"hardware.v_min: {self.v_min} exceeds v_max {self.v_max}")
        if self.v_knee_mhz >= self.max_mhz:  # V(f)/V(f_max) is 1 at the top clock by definition
            out.append(f"hardware.v_knee_mhz: must be below max_mhz={self.max_mhz} (the voltage rises from the "
                       f"knee to the top clock), got {self.v_knee_mhz}; to search lower clocks only, set "
                       f"search.space.freq_mhz.max")
        if not 1 <= self.comm_sharpness <= MAX_SHARPNESS:  # a soft minimum of the SMs' and the link's rates
            out.append(f"hardware.comm_sharpness: must be in [1, {MAX_SHARPNESS}], got {self.comm_sharpness}")
        if math.isfinite(self.ambient_c) and self.ambient_c <= ABSOLUTE_ZERO_C:
            out.append(f"hardware.ambient_c: must be above absolute zero ({ABSOLUTE_ZERO_C} C), got {self.ambient_c}")
        elif math.isfinite(self.ambient_c + self.static_ref_c) and self.static_scale_at(self.ambient_c) <= 0:
            # the GPU is never cooler than the air: static power would sit at its 0 W floor, where the
            # settling temperature's linear loop no longer holds (a loaded GPU read below ambient)
            out.append(f"hardware.static_ref_c/static_temp_coeff: static power would fall to 0 W at the ambient "
                       f"{self.ambient_c} C (1 + static_temp_coeff x (ambient_c - static_ref_c) = "
                       f"{self.static_scale_at(self.ambient_c):.3g}); it must stay above 0")
        out += self._heat_option_problems()
        if self.thermal_loop_gain >= 1:  # each watt of static power heats the GPU into a watt more: no steady state
            out.append(f"hardware.thermal_r_c_per_w x static_power_w x static_temp_coeff: must be below 1 "
                       f"(thermal runaway), got {self.thermal_loop_gain:.3g}")
        return out

    def static_scale_at(self, temp_c: float) -> float:
        """Static power at ``temp_c`` relative to ``static_power_w`` (at full voltage), before its 0 W floor.

        With ``static_temp_curvature`` b > 0 the leakage part grows exponentially: ``1 + c/b (exp(b dT) - 1)``
        has the linear law's slope ``c`` at ``static_ref_c`` and rises faster than it above."""
        b = self.static_temp_curvature
        if b > 0:
            return 1.0 + self.static_temp_coeff / b * math.expm1(b * (temp_c - self.static_ref_c))
        return 1.0 + self.static_temp_coeff * (temp_c - self.static_ref_c)

    @property
    def heat_options_on(self) -> bool:
        """Whether any heat physics of kareus/hardware/heat.py is on (else the shipped model, solved exactly)."""
        return self.thermal_fast_frac > 0 or self.static_temp_curvature > 0 or self.fan_r_scale != 1.0

    def _heat_option_problems(self) -> list[str]:
        """Ranges of the heat options: a share of the resistance, fans that cool better when high, and
        fans that are low at idle (idle_temperature assumes so)."""
        out = out_of_bounds(self, "hardware.", nonnegative=("static_temp_curvature", "fan_hysteresis_c"),
                            positive=("thermal_fast_tau_s",))
        if not 0 <= self.thermal_fast_frac < 1:
            out.append(f"hardware.thermal_fast_frac: must be in [0, 1), got {self.thermal_fast_frac}")
        if not 0 < self.fan_r_scale <= 1:
            out.append(f"hardware.fan_r_scale: must be in (0, 1], got {self.fan_r_scale}")
        idle_c = self.ambient_c + self.thermal_r_c_per_w * self.idle_power_w
        if self.fan_r_scale < 1 and not self.fan_on_c - self.fan_hysteresis_c > idle_c:
            out.append(f"hardware.fan_on_c: fan_on_c - fan_hysteresis_c must be above the idle temperature "
                       f"{idle_c:.3g} C, got {self.fan_on_c} - {self.fan_hysteresis_c}")
        hot_c = self.ambient_c + self.thermal_r_c_per_w * self.tdp_w  # leakage's loop gain grows with heat
        if self.static_temp_curvature > 0 and math.isfinite(hot_c - self.static_ref_c):
            rise = min(50.0, self.static_temp_curvature * (hot_c - self.static_ref_c))
            gain = self.thermal_loop_gain * math.exp(rise)
            if gain >= 1:
                out.append(f"hardware.static_temp_curvature: thermal runaway at the temperature the TDP heats the "
                           f"GPU to ({hot_c:.3g} C): loop gain {gain:.3g}, must be below 1")
        return out

    @property
    def thermal_loop_gain(self) -> float:
        """Watts of static power that one more watt of static power adds through the heat it makes, at
        full voltage (lower clocks scale it by their static power's voltage factor)."""
        return self.thermal_r_c_per_w * self.static_power_w * self.static_temp_coeff


MAX_NOISE = 0.1  # ten standard deviations from a negative time or power
MAX_SHARPNESS = 16.0  # past it the soft minimum is the hard one; a larger power underflows
ABSOLUTE_ZERO_C = -273.15
