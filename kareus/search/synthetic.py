"""An analytic stand-in for a partition on a GPU: searchers are tested against it without hardware.

Time: the compute chain slows with lower clocks (compute-bound ops fully, memory-bound ops little)
and with SMs lent to the comm kernel; the comm kernel saturates its link beyond a few SMs; an
overlapped comm starts beside op ``slot.start`` and the partition ends when both are done.
Energy: dynamic power grows with clock squared and activity; static power x time on top.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kareus.hardware.base import GPUSpec
from kareus.types import SEQUENTIAL, Candidate, Collective, Direction, Link, Measurement, Op, OpKind, PartitionType, Slot

SYNTH_GPU = GPUSpec(name="synthetic-a100", sms=108, min_mhz=210, max_mhz=1410, step_mhz=15, static_power_w=90.0,
                    tdp_w=400.0, idle_power_w=55.0, memory_gb=40.0, hbm_gbps=1555.0, nvlink_gbps=300.0,
                    network_gbps=25.0, peak_tflops=312.0)


def synthetic_partition(key: str = "fwd_synth", n_ops: int = 8) -> PartitionType:
    kinds = [OpKind.NORM, OpKind.GEMM, OpKind.ELEMENTWISE, OpKind.ROPE, OpKind.ATTENTION, OpKind.GEMM,
             OpKind.ELEMENTWISE, OpKind.GEMM, OpKind.NORM, OpKind.GEMM]
    ops = tuple(Op(f"op{i}", kinds[i % len(kinds)], flops=2e11 if kinds[i % len(kinds)] in (OpKind.GEMM, OpKind.ATTENTION)
                   else 0.0, bytes=4e7) for i in range(n_ops))
    slot_kind = {OpKind.GEMM: "gemm", OpKind.ATTENTION: "attention"}
    slots = tuple(Slot(f"s{i}", (i,), slot_kind.get(op.kind, "memory")) for i, op in enumerate(ops))
    comm = Op("allreduce", OpKind.COMM, collective=Collective.ALL_REDUCE, message_bytes=3.2e7, group_size=8,
              link=Link.NVLINK)
    return PartitionType(key, Direction.FWD, ops, comm, slots)


class SyntheticGPU:
    """Deterministic (or seeded-noisy) time and energy of a candidate."""

    def __init__(self, partition: PartitionType, gpu: GPUSpec = SYNTH_GPU, noise: float = 0.0, seed: int = 0,
                 fail: set[Candidate] | None = None) -> None:
        self.partition, self.gpu, self.noise = partition, gpu, noise
        self.rng = np.random.default_rng(seed)
        self.fail = fail or set()
        self.calls = 0

    def truth(self, c: Candidate) -> tuple[float, float, float]:
        """(time_s, energy_j, dynamic_energy_j)."""
        g, p = self.gpu, self.partition
        fr = c.freq_mhz / g.max_mhz
        share = (g.sms - c.sms) / g.sms
        durs = []
        for op in p.compute:
            compute_bound = op.kind in (OpKind.GEMM, OpKind.ATTENTION)
            base = 1.2e-4 if compute_bound else 4e-5
            scale = 1.0 / fr if compute_bound else 1.0 / (0.25 + 0.75 * fr) ** 0.3
            durs.append(base * scale)
        durs = np.array(durs)
        t_comm = 2.0e-4 + 1.6e-3 / c.sms + 1.0e-5 * c.sms
        if c.slot == SEQUENTIAL:
            t_comp = durs.sum()
            t = t_comp + t_comm
            overlap = 0.0
        else:
            s = p.slot(c.slot).start
            prefix = durs[:s].sum()
            slowed = durs[s:] / share ** (1.6 if p.compute[s].kind is OpKind.GEMM else 1.2)
            t_comp = prefix + slowed.sum()
            t = max(t_comp, prefix + t_comm * 1.08) + 1.5e-5
            overlap = min(t_comm, slowed.sum())
        p_dyn = 260.0 * fr ** 2.2
        dyn = p_dyn * t_comp + 2.0 * c.sms * t_comm + 40.0 * overlap * fr
        return t, dyn + g.static_power_w * t, dyn

    def evaluate(self, batch: Sequence[Candidate], annotations: Sequence[dict[str, Any]] | None = None) -> list[Measurement]:
        out = []
        for c in batch:
            self.calls += 1
            if c in self.fail:
                out.append(Measurement.failure(c, "synthetic failure"))
                continue
            t, e, d = self.truth(c)
            if self.noise:
                t *= 1 + self.noise * self.rng.standard_normal()
                d *= 1 + self.noise * self.rng.standard_normal()
                e = d + self.gpu.static_power_w * t
            out.append(Measurement(c, t, e, d, self.gpu.static_power_w, 60.0, float(c.freq_mhz), 3))
        return out
