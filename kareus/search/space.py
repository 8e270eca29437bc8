"""The candidate space of one partition (slot x comm SMs x clock) and its numeric encoding.

Defaults keep a typical partition near 720 candidates (about 9 slots x 8 SM counts x 10 clocks):
- SMs 2..16 in steps of 2: comm kernels saturate the link at roughly 6-10 SMs (real A100 table in
  ``shared/data/a100_attention_tp2``: 3.36 ms at 10 SMs vs 3.19 ms at 20), and every SM above that is
  taken from compute, so larger counts are dominated;
- clocks from the maximum down to 60% of it in steps of 60 MHz (a multiple of the GPU's step):
  below about 60% of the maximum the static energy of the longer run outweighs the saved dynamic
  energy, so those clocks are dominated in total energy; adjacent 15 MHz steps differ by ~1% in
  time and energy, below the measurement noise, so a coarser grid loses nothing measurable.
Any of it can be overridden from YAML (``search.space.sms=[3,6,9]``, ``search.space.freq_mhz.step=30``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kareus.hardware.base import GPUSpec
from kareus.types import SEQUENTIAL, Candidate, PartitionType

DEFAULT_SMS_MIN = 2
DEFAULT_SMS_MAX = 16
DEFAULT_SMS_STEP = 2
DEFAULT_FREQ_STEP = 60


@dataclass
class FreqRange:
    """Locked clocks to search. ``None`` means the GPU's own bound (min: ``min_frac`` x max)."""

    min: int | None = None
    max: int | None = None
    step: int | None = None  # None: the smallest multiple of the GPU's step that is >= 60 MHz
    min_frac: float = 0.6  # lower bound as a fraction of the maximum when ``min`` is None


@dataclass
class SpaceConfig:
    """What to search for every partition; ``None`` fields take the documented defaults."""

    sms: list[int] | None = None  # explicit SM counts; overrides sms_min/max/step
    sms_min: int | None = None  # default 2
    sms_max: int | None = None  # default min(16, gpu.max_comm_sms)
    sms_step: int | None = None  # default 2
    freq_mhz: FreqRange = field(default_factory=FreqRange)
    slots: list[str] | None = None  # slot labels to keep (``sequential`` included); None: all


def _sm_range(space: SpaceConfig, gpu: GPUSpec) -> tuple[int, int, int]:
    """(min, max, step) of the SM range, defaults filled in."""
    lo = space.sms_min if space.sms_min is not None else DEFAULT_SMS_MIN
    hi = space.sms_max if space.sms_max is not None else min(DEFAULT_SMS_MAX, gpu.max_comm_sms)
    step = space.sms_step if space.sms_step is not None else DEFAULT_SMS_STEP
    return lo, hi, step


def sm_counts(space: SpaceConfig, gpu: GPUSpec) -> list[int]:
    if space.sms is not None:
        return sorted(set(int(s) for s in space.sms))
    lo, hi, step = _sm_range(space, gpu)
    return list(range(lo, hi + 1, step))


def clock_bounds(space: SpaceConfig, gpu: GPUSpec) -> tuple[int, int, int]:
    """(lowest, highest, step) of the clock range: ``min`` (else ``min_frac`` x the GPU's maximum) to
    ``max`` (else the GPU's maximum), within the GPU's range."""
    fr = space.freq_mhz
    step = fr.step if fr.step is not None else gpu.step_mhz * -(-DEFAULT_FREQ_STEP // gpu.step_mhz)
    hi = gpu.max_mhz if fr.max is None else min(fr.max, gpu.max_mhz)
    if fr.min is not None:
        lo = max(fr.min, gpu.min_mhz)
    else:
        lo = max(gpu.min_mhz, int(np.ceil(fr.min_frac * gpu.max_mhz)))
    return lo, hi, step


def clocks(space: SpaceConfig, gpu: GPUSpec) -> list[int]:
    """Ascending clocks on the GPU's grid, counted down from the maximum."""
    lo, hi, step = clock_bounds(space, gpu)
    return [f for f in range(hi, lo - 1, -step)][::-1]


def space_problems(space: SpaceConfig, gpu: GPUSpec, recorded: bool = False) -> list[str]:
    """Cross-field problems of a space against a GPU (validate() collects these through the searcher
    config). A ``recorded`` space (replay) is filtered by the explicit fields alone, so a range that
    is empty only through a default (``sms_min=18`` under the default ``sms_max`` of 16) is no problem
    there; what the filter keeps of the table is checked once the table is read (``space_sizes``)."""
    out: list[str] = []
    ranged = [n for n in ("sms_min", "sms_max", "sms_step") if getattr(space, n) is not None]
    if space.sms is not None and ranged:  # the list would win over the range in silence
        out.append(f"search.space.sms: an explicit list replaces the range, but {', '.join(ranged)} is set too; "
                   f"give the list or the range")
    if space.sms_step is not None and space.sms_step <= 0:
        out.append(f"search.space.sms_step: must be > 0, got {space.sms_step}")
    else:
        sms = sm_counts(space, gpu)
        explicit = space.sms is not None or (space.sms_min is not None and space.sms_max is not None)
        if not sms and (explicit or not recorded):
            lo, hi, _step = _sm_range(space, gpu)
            out.append(f"search.space: sms_min {lo} > sms_max {hi}" if space.sms is None and lo > hi
                       else "search.space: no SM counts (check sms / sms_min / sms_max / sms_step)")
        # a comm library caps the CTAs a communicator runs (NCCL: 32 channels), so a count above
        # hardware.max_comm_sms would run the capped kernel under another name; a table holds what it holds
        top, where = (gpu.sms - 1, "") if recorded else (gpu.max_comm_sms, " (hardware.max_comm_sms)")
        bad = [s for s in sms if s < 1 or s > top]
        if bad and space.sms is not None:
            out.append(f"search.space.sms: {bad} outside 1..{top} for {gpu.name}{where}")
        elif bad:  # from the range: name the end that is out, not the counts it makes
            for name, v in (("sms_min", min(sms)), ("sms_max", max(sms))):
                if not 1 <= v <= top:
                    out.append(f"search.space.{name}: must be within 1..{top} for {gpu.name}{where}, "
                               f"got {getattr(space, name) if getattr(space, name) is not None else v}")
    fr = space.freq_mhz
    if fr.step is not None and (fr.step <= 0 or fr.step % gpu.step_mhz):
        out.append(f"search.space.freq_mhz.step: must be a positive multiple of {gpu.name}'s {gpu.step_mhz} MHz step, "
                   f"got {fr.step}")
    if fr.min is not None and not gpu.min_mhz <= fr.min <= gpu.max_mhz:  # a bound: any value in range will do
        out.append(f"search.space.freq_mhz.min: must be within {gpu.name}'s {gpu.min_mhz}..{gpu.max_mhz} MHz, got {fr.min}")
    if fr.max is not None and gpu.clock_problem(fr.max):  # the clocks are counted down from it: it must lock
        out.append(f"search.space.freq_mhz.max: {gpu.clock_problem(fr.max)}")
    if fr.min is not None and fr.max is not None and fr.min > fr.max:
        out.append(f"search.space.freq_mhz: min {fr.min} > max {fr.max}")
    if not 0 < fr.min_frac <= 1:
        out.append(f"search.space.freq_mhz.min_frac: must be in (0, 1], got {fr.min_frac}")
    elif recorded and fr.min_frac != FreqRange.min_frac:  # the default never thins a table; another value would be ignored
        out.append(f"search.space.freq_mhz.min_frac: a replayed table's clocks are thinned by explicit bounds "
                   f"only; set search.space.freq_mhz.min (MHz) instead, got min_frac={fr.min_frac}")
    if not out and not clocks(space, gpu) and not recorded:
        lo, hi, step = clock_bounds(space, gpu)
        low = "min" if fr.min is not None else f"min_frac {fr.min_frac} x {gpu.max_mhz}"
        out.append(f"search.space.freq_mhz: no clock from {lo} MHz ({low}) up to {hi} MHz (max) in {step} MHz "
                   f"steps; lower search.space.freq_mhz.min (>= {gpu.min_mhz}) or raise its max")
    return out


def _explicitly_kept(c: Candidate, space: SpaceConfig, fixed: list[Candidate]) -> bool:
    """Whether the explicitly set SM and clock fields of ``space`` keep ``c`` of a backend's fixed
    space; steps count from the lowest SM count and down from the highest clock that remain."""
    fr = space.freq_mhz
    if space.sms is not None and c.sms not in space.sms:
        return False
    if (space.sms_min is not None and c.sms < space.sms_min) or (space.sms_max is not None and c.sms > space.sms_max):
        return False
    if (fr.min is not None and c.freq_mhz < fr.min) or (fr.max is not None and c.freq_mhz > fr.max):
        return False
    if space.sms_step is not None and space.sms is None:
        lo = min(x.sms for x in fixed if space.sms_min is None or x.sms >= space.sms_min)
        if (c.sms - lo) % space.sms_step:
            return False
    if fr.step is not None:
        top = max(x.freq_mhz for x in fixed if fr.max is None or x.freq_mhz <= fr.max)
        if (top - c.freq_mhz) % fr.step:
            return False
    return True


FIRST_SLOT = "first"


def resolve_slot_alias(partition: PartitionType, label: str) -> str:
    """``first`` names a partition's first launch slot whatever its label (``sequential`` if it has none)."""
    if label != FIRST_SLOT:
        return label
    return partition.slots[0].label if partition.slots else SEQUENTIAL


def slot_problems(partitions: Sequence[PartitionType], space: SpaceConfig) -> list[str]:
    """Slot labels in ``search.space.slots`` that no partition has (a typo, not a narrowing), else the
    partitions it would leave with no slot at all, every one of them in one line."""
    if space.slots is None:
        return []
    if not space.slots:
        return ["search.space.slots: an empty list keeps no slot; name the slots to keep, or null for all"]
    known = {resolve_slot_alias(p, s) for p in partitions for s in (*p.slot_labels, FIRST_SLOT)}
    unknown = [s for s in space.slots if s != FIRST_SLOT and s not in known]
    if unknown:
        labels = sorted({s for p in partitions for s in p.slot_labels})
        return [f"search.space.slots: no partition has {', '.join(unknown)}; allowed: first, {', '.join(labels)}"]
    empty = [p for p in partitions if not _wanted(p, space) & set(p.slot_labels)]
    if not empty:
        return []
    which = "; ".join(f"{p.key} ({', '.join(p.slot_labels)})" for p in empty)
    return [f"search.space.slots: {len(empty)} partition(s) have none of {', '.join(space.slots)}, so nothing "
            f"to search; add one of their slots: {which}"]


def _wanted(partition: PartitionType, space: SpaceConfig) -> set[str]:
    """``search.space.slots`` as this partition's labels (``first`` resolved); each keeps those it has."""
    return {resolve_slot_alias(partition, s) for s in space.slots or ()}


def kept_slots(partition: PartitionType, space: SpaceConfig) -> list[str]:
    """The partition's slot labels that ``search.space.slots`` keeps (all of them when unset)."""
    labels = list(partition.slot_labels)
    if space.slots is None:
        return labels
    wanted = _wanted(partition, space)
    if not wanted & set(labels):
        raise ValueError(f"search.space.slots: partition {partition.key!r} has none of "
                         f"{', '.join(sorted(wanted))}; its slots: {', '.join(labels)}")
    return [s for s in labels if s in wanted]


def build_space(partition: PartitionType, gpu: GPUSpec, space: SpaceConfig,
                fixed: list[Candidate] | None = None) -> list[Candidate]:
    """All candidates of one partition, sorted. With ``fixed`` (a backend's exact space, e.g. replay)
    only the explicitly set fields of ``space`` filter it; defaults do not thin a recorded table."""
    labels = kept_slots(partition, space)
    if fixed is not None:
        return sorted(set(c for c in fixed if c.slot in set(labels) and _explicitly_kept(c, space, fixed)))
    sms, fs = sm_counts(space, gpu), clocks(space, gpu)
    return sorted(Candidate(partition.key, s, n, f) for s in labels for n in sms for f in fs)


FEATURES = ("freq_mhz", "sms", "sequential", "slot_pos", "slot_memory", "slot_gemm", "slot_attention", "slot_rank",
            "flops_before", "bytes_before", "flops_overlap", "bytes_overlap")


def _work_fractions(partition: PartitionType) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative FLOPs and HBM bytes of the chain before each op, as fractions of the chain's total."""
    out = []
    for attr in ("flops", "bytes"):
        w = np.array([max(float(getattr(op, attr, 0.0) or 0.0), 0.0) for op in partition.compute])
        tot = w.sum()
        cum = np.concatenate(([0.0], np.cumsum(w))) / tot if tot > 0 else np.linspace(0, 1, len(w) + 1)
        out.append(cum)
    return out[0], out[1]


def encode(partition: PartitionType, candidates: Sequence[Candidate]) -> np.ndarray:
    """Numeric features, not indices: clock, SM count, overlap flag, where in the chain the comm starts
    (fraction of compute ops before it), the kind of op it starts beside, the slot's rank, and the
    physical position of the slot: the chain's FLOPs and bytes before it and between it and the join
    (the compute that can hide the comm kernel, and that its SMs slow down)."""
    n_ops = max(len(partition.compute), 1)
    rank = {label: i for i, label in enumerate(partition.slot_labels)}
    cf, cb = _work_fractions(partition)
    end = n_ops if partition.join is None else min(partition.join + 1, n_ops)
    X = np.zeros((len(candidates), len(FEATURES)))
    for i, c in enumerate(candidates):
        X[i, 0] = c.freq_mhz
        X[i, 1] = c.sms
        X[i, 7] = rank.get(c.slot, len(rank))
        if c.slot == SEQUENTIAL:
            X[i, 2] = 1.0
            X[i, 3] = -0.1
            X[i, 8:10] = -0.1
            continue
        try:
            slot = partition.slot(c.slot)
        except KeyError:  # a recorded label the partition does not know: position from its rank only
            X[i, 3] = X[i, 7] / max(len(rank), 1)
            X[i, 8:10] = X[i, 3]
            continue
        X[i, 3] = slot.start / n_ops
        kind = {"memory": 4, "gemm": 5, "attention": 6}.get(slot.kind)
        if kind is not None:
            X[i, kind] = 1.0
        a, b = min(slot.start, len(cf) - 1), max(min(end, len(cf) - 1), min(slot.start, len(cf) - 1))
        X[i, 8], X[i, 9] = cf[a], cb[a]
        X[i, 10], X[i, 11] = cf[b] - cf[a], cb[b] - cb[a]
    return X
