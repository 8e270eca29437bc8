"""Net savings: a journal row's energy (windows as read, the rest at idle power, on every GPU it
occupied), the iterations a per-iteration saving takes to pay it back, and Megatron + Perseus' energy
at a plan's time."""
from __future__ import annotations

import pytest

from kareus.plan.payback import measurement_energy_j, payback_iterations, perseus_energy_at, row_energy_j
from kareus.types import Candidate, Measurement, Reading


def _row(partition: str, windows: list[tuple[float, float, int]]) -> Measurement:
    readings = tuple(Reading(t, e, 50.0, 1410.0, t * n, n) for t, e, n in windows)
    return Measurement(Candidate(partition, "sequential", 4, 1410), 0.0, 0.0, 0.0, 80.0, 50.0, 1410.0, len(readings),
                       readings=readings)


def test_a_rows_energy_is_its_windows_and_idle_time_on_every_gpu_it_occupied():
    m = _row("fwd_attn", [(0.01, 2.0, 500), (0.01, 2.2, 500)])  # two 5 s windows: 1000 J and 1100 J
    assert row_energy_j(m, 16.0, 8, 60.0) == pytest.approx(8 * (2100.0 + 60.0 * 6.0))
    failed = Measurement.failure(Candidate("fwd_attn", "x", 4, 1410), "no read")
    assert row_energy_j(failed, 3.0, 2, 60.0) == pytest.approx(2 * 180.0)  # its time still ran the GPUs
    rows = [(m, 16.0), (_row("ops:ab", [(0.1, 30.0, 10)]), 2.0)]  # residual ops: one GPU
    assert measurement_energy_j(rows, {"fwd_attn": 8}, 60.0) == pytest.approx(8 * 2460.0 + 300.0 + 60.0)


def test_payback_is_the_cost_over_the_saving_rounded_up_and_never_without_a_saving():
    assert payback_iterations(1000.0, 3.0) == 334
    assert payback_iterations(1.0, 5.0) == 1
    assert payback_iterations(1000.0, 0.0) is None and payback_iterations(1000.0, -2.0) is None
    assert payback_iterations(1000.0, None) is None


def test_megatron_plus_perseus_at_a_plans_time():
    points = [(6.0, 100.0), (6.5, 90.0), (7.0, 85.0)]
    assert perseus_energy_at(6.6, points) == 90.0  # the least energy within the plan's time
    assert perseus_energy_at(7.5, points) == 85.0
    assert perseus_energy_at(5.0, points) == 100.0  # faster than every point: the fastest one
    assert perseus_energy_at(6.0, []) is None
