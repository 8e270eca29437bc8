"""Which settings a drift check re-measures: where the selected plan runs, then along the front.

A drift that matters moves the settings the plan uses, so those come first (most used first: the
instructions that run them most); the rest of a partition's share comes from its measured Pareto front,
spread along it, so a shift elsewhere on the front (which a re-search would pick from) is seen too.
Only settings the run measured successfully are sampled: the check compares with their readings.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from kareus.types import Candidate, Measurement


def plan_usage(plan: Any) -> Counter:
    """How many instruction-partitions of ``plan`` run each candidate (partition, slot, SMs, clock)."""
    used: Counter = Counter()
    for stage in plan.stages:
        for ins in stage.instructions:
            for s in ins.partitions:
                used[Candidate(s.partition, s.slot, int(s.sms), int(ins.freq_mhz))] += max(1, int(s.count))
    return used


def front(measured: Sequence[Measurement]) -> list[Measurement]:
    """The (time, energy) Pareto front of successful measurements, fastest first."""
    ok = sorted((m for m in measured if not m.failed), key=lambda m: (m.time_s, m.energy_j))
    out: list[Measurement] = []
    for m in ok:
        if not out or m.energy_j < out[-1].energy_j:
            out.append(m)
    return out


def choose(key: str, measured: Sequence[Measurement], used: Counter, n: int) -> list[Measurement]:
    """Up to ``n`` of partition ``key``'s measurements: the plan's settings, then spread along the front."""
    by_cand = {m.candidate: m for m in measured if not m.failed}
    mine = sorted(((c, k) for c, k in used.items() if c.partition == key and c in by_cand),
                  key=lambda ck: (-ck[1], ck[0].slot, ck[0].sms, ck[0].freq_mhz))
    chosen = [by_cand[c] for c, _ in mine[:n]]
    rest = [m for m in front(measured) if m not in chosen]
    while len(chosen) < n and rest:
        step = max(1, len(rest) // (n - len(chosen) + 1))
        pick = rest[min(len(rest) - 1, step - 1)]
        chosen.append(pick)
        rest.remove(pick)
    return chosen
