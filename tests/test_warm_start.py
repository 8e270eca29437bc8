"""``search.warm_start``: a related run's measurements as prior points. Warm-started MBO on a drifted
partition gets where a cold search gets with fewer profiles; prior points are never this run's
measurements (budget, journal, front); bad inputs are one line; ``search.only`` searches some partitions
and carries the rest; the command ``mode=check`` prints re-searches the drifted partitions and works."""
from __future__ import annotations

import json
import shlex
import sqlite3
from pathlib import Path

import numpy as np
import pytest

import kareus.search  # noqa: F401  (registers)
from kareus.search.base import SearchProblem
from kareus.search.config import MBOConfig, SurrogateConfig, initial_size
from kareus.search.mbo import MBOSearcher
from kareus.search.space import SpaceConfig, build_space
from kareus.search.synthetic import SYNTH_GPU, SyntheticGPU, synthetic_partition
from kareus.search.warm import Prior, design, fit_rows, from_rows, load_prior, to_rows, warm_start_problems
from kareus.types import Candidate, Measurement
from test_cli_errors import kareus, left_behind, refused
from test_search_mbo import hv_ratio

LAYOUT = ("+model=tiny", "parallel=pp1_tp2")
QUIET = ("tracking.enabled=false", "progress=false")


class Drifted(SyntheticGPU):
    """The synthetic GPU after a drift: every execution 5% slower at unchanged power."""

    def truth(self, c: Candidate) -> tuple[float, float, float]:
        t, e, d = super().truth(c)
        return t * 1.05, (d + self.gpu.static_power_w * t) * 1.05, d * 1.05


def _search(gpu: SyntheticGPU, space: list, budget: int, seed: int, prior: list | None = None):
    calls: list[Candidate] = []

    def evaluate(batch, notes):
        calls.extend(batch)
        return gpu.evaluate(batch, notes)

    cfg = MBOConfig(seed=seed, budget=budget, surrogate=SurrogateConfig(threads=1))
    problem = SearchProblem(gpu.partition, space, evaluate, budget, seed, SYNTH_GPU.static_power_w,
                            prior=list(prior or []))
    return MBOSearcher(cfg).run(problem), calls


def test_warm_mbo_on_a_drifted_partition_needs_fewer_profiles_and_never_reports_a_prior_point():
    part = synthetic_partition()
    space = build_space(part, SYNTH_GPU, SpaceConfig())
    old, _ = _search(SyntheticGPU(part, noise=0.01, seed=1), space, 60, 1)
    prior = [m for m in old.measurements if not m.failed]
    new = Drifted(part, noise=0.01, seed=2)
    cold, _ = _search(Drifted(part, noise=0.01, seed=2), space, 30, 0)
    long, _ = _search(Drifted(part, noise=0.01, seed=2), space, 80, 0)
    warm, calls = _search(Drifted(part, noise=0.01, seed=2), space, 30, 0, prior)
    assert hv_ratio(long, new, space) >= 0.98 > hv_ratio(cold, new, space)  # cold: more than 30 profiles to 0.98
    assert hv_ratio(warm, new, space) >= 0.98  # warm: 30 do
    assert len(calls) == len(warm.measurements) <= 30  # prior points cost no profile
    assert all("prior" not in m.flags for m in warm.measurements)
    prior_values = {(m.candidate, m.time_s) for m in prior}
    assert not any((p.payload.candidate, p.time_s) in prior_values for p in warm.frontier)  # fronts: own readings
    n = len(design(Prior.of({c: i for i, c in enumerate(space)}, prior), initial_size(MBOConfig(), 30)))
    assert n >= 3 and set(calls[:n]) <= {m.candidate for m in prior}  # the warm design: the prior's Pareto settings


def test_unset_warm_start_leaves_the_search_unchanged():
    part = synthetic_partition()
    space = build_space(part, SYNTH_GPU, SpaceConfig())
    a, calls_a = _search(SyntheticGPU(part, seed=3), space, 40, 3)
    b, calls_b = _search(SyntheticGPU(part, seed=3), space, 40, 3, prior=[])
    assert calls_a == calls_b and [p.time_s for p in a.frontier] == [p.time_s for p in b.frontier]


def test_prior_rows_are_offset_to_this_runs_level_and_only_where_this_run_has_not_measured():
    index = {Candidate("p", "sequential", s, 1410): s for s in range(6)}
    prior = Prior.of(index, [Measurement(c, 1.0 + i, 2.0 + i, 1.0, 1.0, 0.0, 1410.0, 1) for c, i in index.items()])
    own = np.array([[1.1 * (1.0 + i), 0.0, 1.1] for i in (0, 1, 2)])  # 10% slower, 10% more dynamic energy
    idx, y = fit_rows(prior, [0, 1, 2], own, np.zeros(6, dtype=int), 0.0)
    assert list(idx) == [3, 4, 5]
    partition = 3 / (3 + 1)  # three pairs, shrunk towards no offset by one pseudo-pair ...
    slot = (3 + partition) / (3 + 1)  # ... and the slot's towards the partition's
    assert np.allclose(y[:, 0], np.log([4.0, 5.0, 6.0]) + slot * np.log(1.1))
    assert np.allclose(y[:, 1], np.log(1.0) + slot * np.log(1.1))
    rows = to_rows([Measurement(Candidate("p", "s0", 4, 1410), 1.0, 2.0, 1.0, 1.0, 0.0, 1410.0, 1)])
    assert json.loads(json.dumps(rows)) == rows and from_rows("p", rows)[0].candidate == Candidate("p", "s0", 4, 1410)


def _journal(path: Path, partition: str, backend: str) -> None:
    from kareus.profiler.journal import Journal

    with Journal.open(path / "journal.sqlite", "somehash") as j:
        j.append(Measurement(Candidate(partition, "sequential", 4, 1410), 1.0, 2.0, 1.0, 1.0, 0.0, 1410.0, 1),
                 backend=backend, clock_mhz=1410, gpu_temperature_c=None)


def test_load_prior_matches_keys_and_hardware_and_says_why_nothing_matched(tmp_path):
    (tmp_path / "a").mkdir()
    _journal(tmp_path / "a", "fwd_attn", "sim:A100-SXM4-40GB")
    got = load_prior([tmp_path / "a"], "sim:A100-SXM4-40GB", ["fwd_attn", "fwd_mlp"])
    assert [m.candidate.partition for m in got["fwd_attn"]] == ["fwd_attn"] and got["fwd_mlp"] == []
    with pytest.raises(ValueError, match=r"^search.warm_start: nothing to start from: it was measured on "
                                         r"sim:A100-SXM4-40GB, this run measures on sim:H100"):
        load_prior([tmp_path / "a"], "sim:H100", ["fwd_attn"])
    with pytest.raises(ValueError, match=r"its partitions \(fwd_attn\) are none of this layout's \(bwd_mlp\)"):
        load_prior([tmp_path / "a"], "sim:A100-SXM4-40GB", ["bwd_mlp"])
    assert warm_start_problems(str(tmp_path / "a")) == []
    assert warm_start_problems(str(tmp_path)) == [f"search.warm_start: {tmp_path} has no journal.sqlite: not the "
                                                  f"directory of a run that measured anything"]


# --- the command line --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("warm")
    res = kareus(cwd, *LAYOUT, "search.budget_frac=0.1", *QUIET, "hydra.run.dir=runs/old", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return cwd / "runs" / "old"


@pytest.mark.slow
def test_bad_warm_starts_and_partition_lists_are_one_line_and_write_nothing(planned, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refused(tmp_path, *LAYOUT, *QUIET, f"search.warm_start={empty}") == [
        f"error: search.warm_start: {empty} has no journal.sqlite: not the directory of a run that measured anything"]
    assert refused(tmp_path, *LAYOUT, *QUIET, f"search.warm_start={tmp_path}/gone") == [
        f"error: search.warm_start: {tmp_path}/gone is not a directory; give the run directory of a finished search"]
    other = tmp_path / "other"
    other.mkdir()
    _journal(other, "fwd_synth", "sim:A100-SXM4-40GB")
    [line] = refused(tmp_path, *LAYOUT, *QUIET, f"search.warm_start={other}")
    assert line.startswith("error: search.warm_start: nothing to start from: its partitions (fwd_synth) are none")
    [line] = refused(tmp_path, *LAYOUT, *QUIET, f"search.warm_start={planned}", "search.only=[fwd_atn]")
    assert line.startswith("error: search.only: fwd_atn is not a partition of this layout; allowed: fwd_attn")
    [line] = refused(tmp_path, *LAYOUT, *QUIET, "search.only=[fwd_attn]")
    assert line.startswith("error: search.only: mode=run composes every partition")
    [line] = refused(tmp_path, *LAYOUT, *QUIET, "search=random", f"search.warm_start={planned}")
    assert line == ("error: search.warm_start: search=random has no surrogate to offer prior points to; use "
                    "search=mbo, or leave warm_start unset")
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_check_prints_a_warm_re_search_of_the_drifted_partitions_that_runs(planned, tmp_path):
    before = (planned / "journal.sqlite").read_bytes()
    res = kareus(tmp_path, *LAYOUT, *QUIET, "mode=check", f"check.run={planned}", "hardware.drift=0.05",
                 "hydra.run.dir=runs/check", timeout=300)
    assert res.returncode == 3, res.stderr[-2000:]
    [line] = [ln.strip() for ln in res.stdout.splitlines() if ln.strip().startswith("python -m kareus")]
    summary = json.loads((tmp_path / "runs" / "check" / "check_summary.json").read_text())
    assert summary["research_command"] == line
    args = shlex.split(line)[3:]
    assert f"search.warm_start={planned}" in args and "hardware.drift=0.05" in args
    assert f"search.only=[{','.join(summary['drifted'])}]" in args
    again = kareus(tmp_path, *args, "hydra.run.dir=runs/re", timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    out = json.loads((tmp_path / "runs" / "re" / "summary.json").read_text())
    assert (tmp_path / "runs" / "re" / "plan_selected.yaml").is_file()
    old_rows = _rows(planned / "journal.sqlite")
    new_rows = _rows(tmp_path / "runs" / "re" / "journal.sqlite")
    for key in summary["drifted"]:  # this run's own profiles only: as many as it reports, none of the old run's
        searched = [r for r in new_rows[key] if r[:3] != ("sequential", 16, 1410)]  # the plan stage reads Megatron's
        assert len(searched) <= out["search"][key]["profiled"] <= len(new_rows[key]) <= out["search"][key]["space"] + 1
        assert not set(new_rows[key]) & set(old_rows[key])
    assert (planned / "journal.sqlite").read_bytes() == before  # the warm-start run is only read


@pytest.mark.slow
def test_only_searches_some_partitions_and_carries_the_rest_from_the_warm_start(planned, tmp_path):
    res = kareus(tmp_path, *LAYOUT, *QUIET, "search.budget_frac=0.1", f"search.warm_start={planned}",
                 "search.only=[fwd_mlp]", "hydra.run.dir=runs/only", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads((tmp_path / "runs" / "only" / "summary.json").read_text())
    assert "fwd_mlp" not in out["carried"] and set(out["carried"]) == set(out["search"]) - {"fwd_mlp"}
    assert out["profiled"] == out["search"]["fwd_mlp"]["profiled"]
    old = json.loads((planned / "search_summary.json").read_text())
    for key in out["carried"]:
        assert out["search"][key]["carried"] and out["search"][key]["frontier_points"] == old[key]["frontier_points"]


def _rows(path: Path) -> dict[str, list[tuple]]:
    conn = sqlite3.connect(path)
    try:
        out: dict[str, list[tuple]] = {}
        for part, slot, sms, mhz, t, wall in conn.execute(
                "SELECT partition, slot, sms, freq_mhz, time_s, wall_time FROM measurements"):
            out.setdefault(part, []).append((slot, sms, mhz, t, wall))
        return out
    finally:
        conn.close()


def test_the_benchmark_counts_profiles_from_which_the_ratio_stays_at_the_target():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from warm_start import profiles_to

    assert profiles_to([0.5, 0.99, 0.97, 0.985, 0.99]) == (4, True)  # a lucky early reading does not count
    assert profiles_to([0.5, 0.9, 0.97]) == (3, False)
