"""The simulated GPU's physics: kernel rooflines, ring collectives, the overlap of two streams, power.

Pure functions of (config, partition, knobs), so the backend can cache them and the fidelity
benchmark can fit them. One partition execution is an event simulation of three actors: the host
issuing ops in order (each op kind costs the framework some CPU time; a kernel cannot start before it
is issued, so host-bound stretches leave the GPU idle), the compute stream, and the comm stream.
Calls run back to back as Kareus issues them (``host_ahead``): a GPU-bound call's ops are issued
before the GPU reaches them; a host-bound call's kernels start as the host issues them, and its last
kernels run on while the host issues the next call.
The comm kernel starts when the host issues it or, with ``comm_gated``, once the compute stream has
finished the ops before its slot; it runs alone while the compute stream idles. While it runs beside a
compute kernel, it holds ``sms`` SMs that the compute kernel loses (with wave quantization for GEMMs),
both draw on HBM, and the comm kernel is slowed by the co-running kernel: by ``contention_sm`` beside
any kernel, plus ``contention_hbm`` times the kernel's HBM load on the SMs left to it (a streaming
kernel queues the comm kernel's latency-bound memory accesses; on few SMs it draws less bandwidth).
Energy per execution: SM energy follows each kernel's work (activity x f V(f)^2), the comm kernel's
SMs draw power while it runs, plus HBM and link traffic;
static energy (static power x time, scaled by voltage and, in the backend, temperature) is added by
the caller.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kareus.types import Collective, Link, Op, OpKind, PartitionType

TENSOR_KINDS = (OpKind.GEMM, OpKind.ATTENTION)


@dataclass(frozen=True)
class Outcome:
    """One execution: time, dynamic energy (SMs, HBM, links) and the static-power voltage factor."""

    time_s: float
    dynamic_j: float
    static_scale: float  # static power = static_power_w x this x temperature factor
    freq_mhz: int
    overlap_s: float = 0.0  # time both streams ran together
    exposed_comm_s: float = 0.0  # time the comm ran with the compute stream idle or waiting


def voltage_ratio(cfg, mhz: float) -> float:
    """V(f)/V(f_max): flat at low clocks, rising linearly from the knee to the top clock."""
    if mhz <= cfg.v_knee_mhz or cfg.max_mhz <= cfg.v_knee_mhz:
        v = cfg.v_min
    else:
        v = cfg.v_min + (cfg.v_max - cfg.v_min) * (min(mhz, cfg.max_mhz) - cfg.v_knee_mhz) / (cfg.max_mhz - cfg.v_knee_mhz)
    return v / cfg.v_max


def sm_power_scale(cfg, mhz: float) -> float:
    """Dynamic SM power relative to the top clock: f V(f)^2."""
    return (mhz / cfg.max_mhz) * voltage_ratio(cfg, mhz) ** 2


def op_times(cfg, op: Op, mhz: float, sms: int, hbm_mult: float = 1.0) -> tuple[float, float]:
    """(compute time, memory time) of one kernel on ``sms`` SMs; its time is the larger (roofline)."""
    fr = mhz / cfg.max_mhz
    total = cfg.sms
    if op.kind in TENSOR_KINDS:
        eff = cfg.eff_gemm if op.kind is OpKind.GEMM else cfg.eff_attention
        ideal = op.flops / (cfg.peak_tflops * 1e12 * eff * fr) if op.flops else 0.0
        tiles = max(1.0, math.ceil(op.flops / cfg.gemm_tile_flops))
        t_cmp = ideal * _wave_ratio(tiles, max(sms, 1), total)
        full = (math.ceil(tiles / total) - 1) * total  # the largest GEMM one whole-GPU wave smaller
        if full >= 1 and sms < total:  # never faster than that smaller GEMM on as many SMs
            t_cmp = max(t_cmp, ideal * full / tiles * _wave_ratio(full, max(sms, 1), total))
    else:
        t_cmp = op.flops / (cfg.vector_tflops * 1e12 * fr) * total / max(sms, 1) if op.flops else 0.0
    need = max(1.0, cfg.memory_sat_frac * total)
    bw = cfg.hbm_gbps * 1e9 * cfg.eff_memory * min(1.0, sms / need)
    t_mem = op.bytes / bw * hbm_mult if op.bytes else 0.0
    return t_cmp, t_mem


def _wave_ratio(tiles: float, sms: int, total: int) -> float:
    """Waves of ``tiles`` GEMM tiles on the SMs left, relative to the (already quantized) waves on the
    whole GPU. Alone it is not monotone in the tiles: one tile past a whole-GPU wave doubles the
    whole-GPU waves but may add no wave on fewer SMs, which ``op_times`` bounds from below."""
    return math.ceil(tiles / sms) / math.ceil(tiles / total)


def comm_traffic(op: Op) -> tuple[float, int]:
    """(bytes each GPU sends, ring steps) of a collective under the ring algorithm.

    ``message_bytes`` follows NCCL's count convention (kareus.workload.ops): the full tensor for an
    all-reduce, one GPU's shard for an all-gather or reduce-scatter, so a reduce-scatter plus an
    all-gather of a shard move exactly what the all-reduce of the whole tensor moves.
    """
    n = max(op.group_size, 1)
    m = op.message_bytes or op.bytes
    if n == 1:
        return 0.0, 0
    if op.collective is Collective.ALL_REDUCE or op.collective is None:
        return 2.0 * (n - 1) / n * m, 2 * (n - 1)
    if op.collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return (n - 1) * m, n - 1
    return m, 1  # send/recv


def link_gbps(cfg, op: Op) -> float:
    """One-direction bandwidth of the link the collective crosses."""
    if op.link is Link.NETWORK:
        return cfg.network_gbps
    return cfg.nvlink_gbps / 2.0


def link_efficiency(cfg, op: Op) -> float:
    """Fraction of that bandwidth the collective reaches: fitted for NVLink (the recorded table's
    all-reduces), assumed for the network, where NCCL's transfers run close to line rate."""
    return cfg.network_link_eff if op.link is Link.NETWORK else cfg.comm_link_eff


def comm_time(cfg, op: Op, sms: int, mhz: float) -> float:
    """Time of a collective alone: per-SM throughput saturating at the link.

    A comm SM's throughput follows the clock only in part (``comm_clock_exp``): its issue work
    scales with the clock, the link and remote-memory latency it waits on do not.
    """
    traffic, steps = comm_traffic(op)
    if traffic <= 0:
        return 0.0
    per_sm = cfg.comm_sm_gbps * 1e9 * (mhz / cfg.max_mhz) ** cfg.comm_clock_exp * max(sms, 1)
    link = link_gbps(cfg, op) * 1e9 * link_efficiency(cfg, op)
    p = cfg.comm_sharpness
    bw = (per_sm ** -p + link ** -p) ** (-1.0 / p)
    return steps * cfg.comm_latency_s + traffic / bw


def _activity(cfg, op: Op) -> float:
    if op.kind is OpKind.GEMM:
        return cfg.act_gemm
    if op.kind is OpKind.ATTENTION:
        return cfg.act_attention
    return cfg.act_memory


def host_cost(cfg, op: Op) -> float:
    """Host (CPU) time to issue one op: the framework's Python code plus its kernel launches."""
    k = op.kind
    if k is OpKind.GEMM:
        h = cfg.host_gemm_s
    elif k is OpKind.ATTENTION:
        h = cfg.host_attention_s
    elif k is OpKind.NORM:
        h = cfg.host_norm_s
    elif k is OpKind.ROPE:
        h = cfg.host_rope_s
    elif k is OpKind.COMM:
        h = cfg.host_comm_s
    else:
        h = cfg.host_elementwise_s
    return h * cfg.host_scale


def simulate(
    cfg, compute: Sequence[Op], comm: Op | None, mhz: int, sms: int, start: int | None, join: int | None,
    host_gap: bool = True, ideal: bool = False,
) -> Outcome:
    """One execution of ``compute`` with ``comm`` launched before op ``start`` and joined after ``join``
    (see ``_execute``). Back to back (``cfg.host_ahead``) the host stays ahead of a GPU-bound call; a
    call whose host work outlasts its GPU work is host-bound, its kernels start as the host issues them."""
    if cfg.host_ahead:
        out, host_bound = _execute(cfg, compute, comm, mhz, sms, start, join, host_gap, ideal, ahead=True)
        if not host_bound:
            return out
    return _execute(cfg, compute, comm, mhz, sms, start, join, host_gap, ideal, ahead=False,
                    hide_tail=cfg.host_ahead)[0]


def _execute(
    cfg, compute: Sequence[Op], comm: Op | None, mhz: int, sms: int, start: int | None, join: int | None,
    host_gap: bool, ideal: bool, ahead: bool, hide_tail: bool = False,
) -> tuple[Outcome, bool]:
    """One execution of ``compute`` with ``comm`` launched before op ``start`` and joined after ``join``.

    ``start=None`` runs the comm alone before the chain (sequential); ``comm=None`` runs the chain only.
    ``ideal=True`` is the contention-free baseline: overlapped streams neither share SMs nor HBM.

    Three actors: the host issues ops in order (``host_cost`` each) and never blocks inside a call; a
    kernel starts once it is issued and its stream is free, so host-bound stretches leave the GPU idle.
    The comm kernel starts when the host issues it (``comm_gated``: only after op ``start - 1`` ends on
    the GPU), runs alone while the compute stream idles, and the op after ``join`` waits for it.

    ``ahead``: every op is issued before the GPU reaches it (the host of a GPU-bound call issued back to
    back, as Kareus' profiler and runtime do); an ungated comm then starts with the call, whatever its
    slot. Else each op starts no earlier than the host issues it, from a host that starts with the call
    (a host-bound call back to back, or the recorded harness, which synced each call). The call then
    idles ``host_gap_s`` (0 but for the harness, ``benchmarks/sim_fidelity.py``). Returns the outcome and
    whether the host's work outlasted the GPU's (host-bound).

    ``hide_tail``: a host-bound call issued back to back. Its last compute kernels, and a comm joined at
    the chain's end that outlasts the host's work, run on while the host issues the next call, whose
    kernels start only as issued, so calls follow one another at the host's pace unless a stream itself
    takes longer per call (the compute stream's busy time, or the comm's own run, start to end). Synced
    (the harness), the call ends with its last kernel.
    """
    n = len(compute)
    psm = cfg.p_sm_w * sm_power_scale(cfg, mhz)  # W of all SMs at activity 1
    total_sms = cfg.sms
    lat = cfg.launch_latency_s
    c_alone = comm_time(cfg, comm, sms, mhz) if comm is not None else 0.0
    has_comm = c_alone > 0
    traffic = comm_traffic(comm)[0] if comm is not None else 0.0
    comm_hbm_rate = traffic * cfg.comm_hbm_per_byte / c_alone if has_comm else 0.0
    hbm_eff = cfg.hbm_gbps * 1e9 * cfg.eff_memory
    comm_w = psm * cfg.act_comm * sms / total_sms  # W of the comm kernel's SMs
    seq = has_comm and (start is None or n == 0)
    if join is not None and join >= n - 1:
        join = None  # joined at the chain's end: the comm may outlast the chain (and run through a gap)
    # when each kernel can start, as far as the host is concerned: its issue plus the launch latency
    # (the host never blocks inside a call); ahead, already issued when the GPU gets there
    host = 0.0
    comm_issue = 0.0
    issue = []
    h_comm = cfg.host_comm_s * cfg.host_scale
    if seq:
        host += h_comm
        comm_issue = 0.0 if ahead else host + lat
    for k, op in enumerate(compute):
        if has_comm and not seq and k == start:
            host += h_comm
            comm_issue = 0.0 if ahead else host + lat
        host += host_cost(cfg, op)
        issue.append(0.0 if ahead else host + lat)
    host_end = host + cfg.host_tail_s * cfg.host_scale
    ready = comm_issue if (seq or (has_comm and not cfg.comm_gated)) else math.inf
    rem = c_alone  # comm work left, in seconds of running alone
    comm_end = 0.0
    dyn = 0.0
    hbm_bytes = traffic * cfg.comm_hbm_per_byte
    overlap = exposed = 0.0
    chain_traffic = 0.0  # bytes sent by collectives inside the chain
    t = 0.0  # the compute stream is free from t
    host_wait = 0.0  # time the compute stream idles for the host's issue alone (an op's, or a comm's it waits on)

    def run_alone(t0: float, t1: float) -> None:
        """The compute stream idles in [t0, t1): the comm, if started, runs alone."""
        nonlocal rem, exposed, dyn, comm_end
        a = max(t0, ready)
        if rem > 0.0 and t1 > a:
            d = min(rem, t1 - a)
            rem -= d
            exposed += d
            dyn += comm_w * d
            if rem <= 0.0:
                rem = 0.0
                comm_end = a + d

    for k, op in enumerate(compute):
        if has_comm and not seq and k == start and cfg.comm_gated:
            ready = max(comm_issue, t)
        if has_comm and ((seq and k == 0) or (join is not None and k == join + 1)):
            run_alone(t, math.inf)  # the op after the join waits for the comm
            free = max(t, comm_end)
            host_wait += max(0.0, min(ready, free) - t)  # while the host had not yet issued the comm
            begin = max(free, issue[k])
        else:
            free = t
            begin = max(free, issue[k])
            run_alone(t, begin)
        host_wait += begin - free
        if op.is_comm:
            # a collective in the chain itself (residual work: pipeline send/recv, the embedding's and
            # the loss's collectives) runs alone on the stream at the comm library's default SMs
            tc, tm = comm_time(cfg, op, cfg.default_comm_sms, mhz), 0.0
            chain_traffic += comm_traffic(op)[0]
            act = cfg.act_comm * cfg.default_comm_sms / total_sms
        else:
            act = _activity(cfg, op)
            hbm_bytes += op.bytes
            tc, tm = op_times(cfg, op, mhz, total_sms)
        t_full = max(tc, tm)
        # SM energy follows the work, not the occupancy: SMs idle in a partial wave draw little
        dyn += psm * act * t_full
        now = begin
        work = 1.0
        if rem > 0.0 and ready > now:  # the comm starts during this op (or later)
            d = min(ready - now, t_full)
            work -= d / t_full
            now += d
        if rem > 0.0 and work > 1e-12:
            if k == start and cfg.comm_waits_for_dispatch and op.kind in TENSOR_KINDS and not ideal:
                # launched beside a kernel that fills every SM, the comm's blocks wait for its last wave
                waves = math.ceil(max(1.0, math.ceil(op.flops / cfg.gemm_tile_flops)) / total_sms)
                if waves > 1:
                    pre = (waves - 1) / waves * work
                    now += pre * t_full
                    work -= pre
            if ideal:
                kappa, tc2, tm2 = 0.0, tc, tm
            else:
                # the comm kernel is latency-bound: it slows with the co-running kernel's HBM load, the
                # share of HBM bandwidth that kernel draws on the SMs the comm leaves it (on fewer SMs it
                # spreads its bytes over a longer time): its bytes at full bandwidth over its duration there
                hbm_load = tm / max(op_times(cfg, op, mhz, total_sms - sms)) if tm > 0 else 0.0
                kappa = min(0.95, cfg.contention_sm + cfg.contention_hbm * hbm_load)
                tc2, tm2 = op_times(cfg, op, mhz, total_sms - sms, 1.0 + comm_hbm_rate * (1.0 - kappa) / hbm_eff)
            crate = max(1e-6, 1.0 - kappa)  # comm progress per second, relative to running alone
            t_cont = max(tc2, tm2) * work
            t_left = rem / crate
            if t_left >= t_cont:
                rem -= t_cont * crate
                now += t_cont
                overlap += t_cont
                dyn += comm_w * t_cont
                if rem <= 1e-15:
                    rem = 0.0
                    comm_end = now
            else:
                now += t_left
                overlap += t_left
                dyn += comm_w * t_left
                rem = 0.0
                comm_end = now
                now += (1.0 - t_left / t_cont) * t_full * work
        else:
            now += t_full * work
        t = now
    # After a synced call the GPU idles for the harness's per-call host work (``host_gap_s``; 0 back to
    # back); a comm joined at the chain's end keeps running through it.
    gap = cfg.host_gap_s if host_gap else 0.0
    # Back to back, a host-bound call's compute tail runs while the host issues the next call: calls
    # follow at the host's pace unless the compute stream's own busy time per call is longer.
    end = max(t - host_wait, host_end) if hide_tail else max(t, host_end)
    if rem > 0.0:
        run_alone(t, math.inf)
        exposed -= max(0.0, min(comm_end, end + gap) - max(end, ready))  # hidden in the gap
    total = max(end + gap, comm_end)
    if hide_tail and comm_end > end + gap:
        total = max(end + gap, comm_end - ready)  # the comm stream's own time per call: from its start
        exposed -= comm_end - total  # the tail the next call's issue hides
    hbm_bytes += chain_traffic * cfg.comm_hbm_per_byte
    dyn += hbm_bytes * cfg.hbm_pj_per_byte * 1e-12 + (traffic + chain_traffic) * cfg.link_pj_per_byte * 1e-12
    return Outcome(total, dyn, voltage_ratio(cfg, mhz), int(mhz), overlap, exposed), host_end > max(t, comm_end)


def simulate_partition(cfg, partition: PartitionType, slot: str, sms: int, mhz: int) -> Outcome:
    """``simulate`` for a PartitionType and a slot label (``sequential`` or one of its slots)."""
    s = partition.slot(slot)
    start = None if s is None else s.start
    return simulate(cfg, partition.compute, partition.comm, mhz, sms, start, partition.join)
