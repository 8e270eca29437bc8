"""plan.select=cost: money and carbon per iteration or over a job, from constants or hourly profiles; the
price decides between fast and frugal plans; bad prices, gaps and uncovered jobs are one line each."""
from __future__ import annotations

import pytest

from kareus.plan import PlanConfig, SelectRule, select_plan
from kareus.plan.cost import CarbonConfig, PriceConfig, ProfileError, cost_problems, load_profile, plan_cost
from test_plan import frontier, plans  # noqa: F401  (module fixtures: a composed frontier's plans)


def _cfg(**kw) -> PlanConfig:
    return PlanConfig(select=SelectRule.cost, **kw)


def test_cheap_energy_buys_the_fastest_plan_and_dear_energy_the_frugal_one(plans):  # noqa: F811
    fastest = min(plans, key=lambda p: p.predicted_time_s)
    frugal = min(plans, key=lambda p: p.predicted_energy_j)
    assert fastest is not frugal
    gpus = fastest.num_stages * fastest.gpus_per_stage
    cheap = _cfg(price=PriceConfig(energy_per_kwh=0.01, gpu_hour=3.0))
    dear = _cfg(price=PriceConfig(energy_per_kwh=1e6, gpu_hour=3.0))
    assert select_plan(plans, cheap) is fastest
    assert select_plan(plans, dear) is frugal
    between = select_plan(plans, _cfg(price=PriceConfig(energy_per_kwh=50.0, gpu_hour=3.0)))
    costs = {id(p): plan_cost(p.predicted_time_s, p.predicted_energy_j, gpus, _cfg(
        price=PriceConfig(energy_per_kwh=50.0, gpu_hour=3.0))).total for p in plans}
    assert costs[id(between)] == min(costs.values())  # the least cost, whichever plan that is
    # carbon priced in the cost weighs like energy
    carbon = _cfg(price=PriceConfig(gpu_hour=3.0), carbon=CarbonConfig(g_per_kwh=400.0, price_per_kg=1e9))
    assert select_plan(plans, carbon) is frugal


def test_the_cost_adds_energy_gpu_time_and_carbon():
    cfg = _cfg(price=PriceConfig(energy_per_kwh=0.2, gpu_hour=2.0), carbon=CarbonConfig(g_per_kwh=300, price_per_kg=0.1),
               iterations=1000)
    c = plan_cost(3.6, 7.2e6, 8, cfg)  # 2 kWh and 3.6 s per iteration
    assert c.energy_kwh == pytest.approx(2000.0) and c.gpu_hours == pytest.approx(8 * 1000 * 3.6 / 3600)
    assert c.energy_cost == pytest.approx(400.0) and c.gpu_cost == pytest.approx(16.0)
    assert c.carbon_g == pytest.approx(600_000.0) and c.carbon_cost == pytest.approx(60.0)
    assert c.total == pytest.approx(476.0)


def _profile(path, rows, column="g_per_kwh"):
    path.write_text("hour," + column + "\n" + "".join(f"{h},{v}\n" for h, v in rows))
    return str(path)


def test_an_hourly_profile_is_integrated_over_the_hours_the_job_spans(tmp_path):
    path = _profile(tmp_path / "grid.csv", [("2026-12-08T09:00", 100), ("2026-12-08T10:00", 300),
                                            ("2026-12-08T11:00", 500)])
    # 1 kWh per 1800 s iteration, 3 iterations from 09:30: half an hour at 100, one hour at 300
    cfg = _cfg(carbon=CarbonConfig(profile=path), iterations=3, start="2026-12-08T09:30")
    c = plan_cost(1800.0, 3.6e6, 1, cfg)
    assert c.carbon_g == pytest.approx(3.0 * (0.5 * 100 + 1.0 * 300) / 1.5)
    late = _cfg(carbon=CarbonConfig(profile=path), iterations=3, start="2026-12-08T11:00")
    with pytest.raises(ProfileError, match="covers 2026-12-08T09:00:00 to 2026-12-08T12:00:00, the job runs "
                                           "2026-12-08T11:00:00 to 2026-12-08T12:30:00"):
        plan_cost(1800.0, 3.6e6, 1, late)


def test_bad_prices_gaps_and_missing_job_facts_are_one_line_each(tmp_path):
    gap = _profile(tmp_path / "gap.csv", [("2026-12-08T09:00", 100), ("2026-12-08T11:00", 300)])
    cfg = _cfg(price=PriceConfig(energy_per_kwh=-1.0), carbon=CarbonConfig(profile=gap))
    assert cost_problems(cfg) == [
        "plan.price.energy_per_kwh: must be a price or intensity >= 0, got -1.0",
        "plan.iterations: plan.carbon.profile prices hours, so the job's length is needed: set plan.iterations",
        "plan.start: plan.carbon.profile is hourly, so the job's start is needed (ISO 8601, e.g. "
        "plan.start=2026-12-08T09:00)",
        f"plan.carbon.profile: {gap} has a gap: no value for 2026-12-08T10:00:00 (one row per hour)"]
    wrong = _profile(tmp_path / "cols.csv", [("2026-12-08T09:00", 1)], column="price")
    with pytest.raises(ProfileError, match="needs the columns hour and g_per_kwh"):
        load_profile(wrong, "g_per_kwh", "plan.carbon.profile")
    assert cost_problems(_cfg(iterations=0, start="tomorrow")) == [
        "plan.iterations: must be >= 1, got 0", "plan.start: not an ISO 8601 time (Invalid isoformat string: "
        "'tomorrow')"]
