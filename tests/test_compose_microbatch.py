"""Microbatch composition: Minkowski sums with pruning equal brute force; clocks, counts, residual work."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose.microbatch import compose_instruction, minkowski_pareto, pareto_indices
from kareus.types import Candidate, Direction, InstructionWork, Measurement

point = st.tuples(st.integers(1, 40), st.integers(1, 40))  # integers: exact sums, no float ties
frontier = st.lists(point, min_size=1, max_size=6)


def _pareto(pts):
    t = [p[0] for p in pts]
    e = [p[1] for p in pts]
    return sorted({(t[i], e[i]) for i in pareto_indices(t, e)})


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(frontier, min_size=1, max_size=4))
def test_iterated_minkowski_equals_brute_force(sets):
    sets = [_pareto(s) for s in sets]
    t, e = np.array([0.0]), np.array([0.0])
    for s in sets:
        t, e, _, _ = minkowski_pareto(t, e, np.array([p[0] for p in s], float), np.array([p[1] for p in s], float))
    brute = _pareto([(sum(p[0] for p in combo), sum(p[1] for p in combo)) for combo in itertools.product(*sets)])
    assert sorted(zip(t.tolist(), e.tolist())) == [(float(a), float(b)) for a, b in brute]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(frontier, frontier)
def test_minkowski_indices_point_at_the_summands(a, b):
    a, b = _pareto(a), _pareto(b)
    at, ae = np.array([p[0] for p in a], float), np.array([p[1] for p in a], float)
    bt, be = np.array([p[0] for p in b], float), np.array([p[1] for p in b], float)
    t, e, ia, ib = minkowski_pareto(at, ae, bt, be)
    assert np.allclose(t, at[ia] + bt[ib]) and np.allclose(e, ae[ia] + be[ib])
    assert np.all(np.diff(t) > 0) and np.all(np.diff(e) < 0)


def _m(key, slot, sms, f, t, e, failed=False):
    c = Candidate(key, slot, sms, f)
    if failed:
        return Measurement.failure(c, "oom")
    return Measurement(c, t, e + 50 * t, e, 50.0, 60.0, f, 3)


def _measurements():
    return {
        "a": [_m("a", "sequential", 8, 1000, 2.0, 10.0), _m("a", "s1", 8, 1000, 1.5, 12.0),
              _m("a", "s1", 16, 1000, 1.0, 20.0), _m("a", "sequential", 8, 1400, 1.2, 14.0),
              _m("a", "s2", 8, 1400, 0.1, 1.0, failed=True), _m("a", "s1", 8, 1200, 1.1, 11.0)],
        "b": [_m("b", "sequential", 4, 1000, 3.0, 5.0), _m("b", "s1", 4, 1000, 2.5, 6.0),
              _m("b", "sequential", 4, 1400, 2.0, 7.0)],
    }


def test_compose_instruction_matches_enumeration_per_clock():
    work = InstructionWork(0, Direction.FWD, (("a", 3), ("b", 2)))
    ms = _measurements()
    residual = {1000: (0.5, 1.0), 1400: (0.4, 1.5), 1200: (0.45, 1.2)}
    opts = compose_instruction(work, ms, residual)
    # brute force: one config per type per clock, all occurrences share it
    brute = []
    for f in (1000, 1400):  # 1200 has no "b" measurement: skipped
        for ma in [m for m in ms["a"] if m.candidate.freq_mhz == f and not m.failed]:
            for mb in [m for m in ms["b"] if m.candidate.freq_mhz == f]:
                brute.append((3 * ma.time_s + 2 * mb.time_s + residual[f][0],
                              3 * ma.dynamic_energy_j + 2 * mb.dynamic_energy_j + residual[f][1], f, ma, mb))
    keep = pareto_indices([b[0] for b in brute], [b[1] for b in brute])
    expect = [brute[i] for i in keep]
    assert [o.freq_mhz for o in opts] == [b[2] for b in expect]
    assert [o.time_s for o in opts] == pytest.approx([b[0] for b in expect])
    assert [o.dynamic_energy_j for o in opts] == pytest.approx([b[1] for b in expect])
    for o, b in zip(opts, expect):
        assert o.choices == {"a": b[3].candidate, "b": b[4].candidate}
        assert all(c.freq_mhz == o.freq_mhz for c in o.choices.values())
    assert 1200 not in {o.freq_mhz for o in opts}


def test_per_clock_options_keep_each_clocks_front():
    """With clock switches priced, an option beaten at another clock can still win (its stage stays at
    one clock): the composer gets every clock's Pareto options."""
    work = InstructionWork(0, Direction.FWD, (("a", 3), ("b", 2)))
    ms = _measurements()
    residual = {1000: (0.5, 1.0), 1400: (0.4, 1.5)}
    opts = compose_instruction(work, ms, residual, per_clock=True)
    assert [o.time_s for o in opts] == sorted(o.time_s for o in opts)
    for f in (1000, 1400):
        brute = [(3 * ma.time_s + 2 * mb.time_s + residual[f][0], 3 * ma.dynamic_energy_j + 2 * mb.dynamic_energy_j
                  + residual[f][1]) for ma in ms["a"] if ma.candidate.freq_mhz == f and not ma.failed
                 for mb in ms["b"] if mb.candidate.freq_mhz == f]
        got = sorted((o.time_s, o.dynamic_energy_j) for o in opts if o.freq_mhz == f)
        assert np.allclose(got, _pareto(brute))
    merged = compose_instruction(work, ms, residual)
    assert len(merged) < len(opts)
    assert {(o.time_s, o.freq_mhz) for o in merged} < {(o.time_s, o.freq_mhz) for o in opts}


def test_clock_without_residual_measurement_is_skipped_when_residual_work_exists():
    from kareus.types import Op, OpKind

    ms = _measurements()
    work = InstructionWork(0, Direction.FWD, (("a", 1), ("b", 1)), residual=(Op("emb", OpKind.GEMM, 1.0),))
    opts = compose_instruction(work, ms, {1000: (0.1, 0.1)})
    assert {o.freq_mhz for o in opts} == {1000}
    plain = InstructionWork(0, Direction.FWD, (("a", 1), ("b", 1)))
    assert {o.freq_mhz for o in compose_instruction(plain, ms, {})} == {1000, 1400}


def test_no_common_clock_is_a_clear_error():
    ms = {"a": [_m("a", "sequential", 8, 1000, 1.0, 1.0)], "b": [_m("b", "sequential", 8, 1400, 1.0, 1.0)]}
    with pytest.raises(ValueError, match="no clock"):
        compose_instruction(InstructionWork(1, Direction.BWD, (("a", 1), ("b", 1))), ms, {})
