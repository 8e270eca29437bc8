"""``mode=check``: a planning run's settings re-measured; no drift exits 0, a simulated drift exits 3 naming
the drifted partitions; the check journals its windows and leaves the checked run untouched; bad input is
one line. The drift test's statistics are checked on their own against known noise."""
from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

import pytest

from kareus.check.drift import Sample, verdicts
from kareus.check.samples import choose, front
from kareus.types import Candidate, Measurement
from test_cli_errors import kareus, left_behind, refused

LAYOUT = ("+model=tiny", "parallel=pp1_tp2")
QUIET = ("tracking.enabled=false", "progress=false")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("check")
    res = kareus(cwd, *LAYOUT, "search.budget_frac=0.1", *QUIET, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return next((cwd / "runs").glob("20*/*"))


@pytest.mark.slow
def test_no_drift_exits_0_and_a_drift_exits_3_naming_the_partitions(planned, tmp_path):
    before = _digest(planned / "journal.sqlite")
    ok = kareus(tmp_path, *LAYOUT, *QUIET, "mode=check", f"check.run={planned}", timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "no partition drifted" in ok.stdout
    [check_dir] = [p for p in (tmp_path / "runs").glob("20*/*")]
    summary = json.loads((check_dir / "check_summary.json").read_text())
    assert summary["drifted"] == [] and summary["exit_code"] == 0 and summary["checked_run"] == str(planned)
    assert all(p["samples"] for p in summary["partitions"].values())
    assert (check_dir / "journal.sqlite").is_file()  # every fresh window journaled in the check's own folder
    assert _digest(planned / "journal.sqlite") == before  # the checked run is only read

    bad = kareus(tmp_path, *LAYOUT, *QUIET, "mode=check", f"check.run={planned}", "hardware.drift=0.05", timeout=300)
    assert bad.returncode == 3, bad.stderr[-2000:]
    [drifted] = [p for p in (tmp_path / "runs").glob("20*/*") if p != check_dir]
    summary = json.loads((drifted / "check_summary.json").read_text())
    assert summary["drifted"] == sorted(summary["partitions"])  # every partition runs 5% slower
    assert all(p["time_shift"] == pytest.approx(0.05, abs=0.01) for p in summary["partitions"].values())
    assert "drifted: " in bad.stdout and "(exit 3)" in bad.stdout


@pytest.mark.slow
def test_a_check_of_another_layout_or_of_no_run_is_one_line(planned, tmp_path):
    lines = refused(tmp_path, "+model=tiny", "parallel=pp2_tp2", *QUIET, "mode=check", f"check.run={planned}")
    assert len(lines) == 1 and lines[0].startswith("error: check.run: the run was made for parallel."), lines
    assert lines[0].endswith("give the run's own model and layout")
    empty = tmp_path / "empty"
    empty.mkdir()
    lines = refused(tmp_path, *LAYOUT, *QUIET, "mode=check", f"check.run={empty}", "check.repeats=1")
    assert lines == ["error: check.repeats: must be >= 2 (their spread is the noise the test uses), got 1",
                     f"error: check.run: {empty} has no journal.sqlite: not the directory of a run that measured "
                     "anything"]
    assert left_behind(tmp_path) == []


def _samples(rng: random.Random, shift: float, noise: float, n: int = 4, repeats: int = 3) -> list[Sample]:
    out = []
    for _ in range(n):
        old = 1.0 + rng.random()
        old_read = old * math.exp(rng.gauss(0, noise))
        new = [old * (1 + shift) * math.exp(rng.gauss(0, noise)) for _ in range(repeats)]
        out.append(Sample({"time": old_read, "energy": old_read}, 1, {"time": new, "energy": new},
                          {"time": sum(new) / repeats, "energy": sum(new) / repeats}))
    return out


def test_the_false_alarm_rate_stays_under_alpha_and_a_drift_beyond_noise_is_found():
    rng = random.Random(0)
    trials, alarms = 400, 0
    for _ in range(trials):  # six partitions, no drift, 0.5% noise, no practical floor: the test alone
        parts = {f"p{i}": _samples(rng, 0.0, 0.005) for i in range(6)}
        alarms += any(s.drifted for shifts in verdicts(parts, 0.05, 0.0).values() for s in shifts)
    assert alarms / trials <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    parts = {f"p{i}": _samples(rng, 0.0, 0.005) for i in range(5)} | {"moved": _samples(rng, 0.03, 0.005)}
    flagged = {k for k, shifts in verdicts(parts, 0.01, 0.01).items() if any(s.drifted for s in shifts)}
    assert flagged == {"moved"}
    parts = {"small": _samples(rng, 0.004, 0.0005)}  # beyond noise but under the 1% floor: not worth a re-search
    assert not any(s.drifted for s in verdicts(parts, 0.01, 0.01)["small"])


def _m(slot: str, sms: int, t: float, e: float, mhz: int = 1410) -> Measurement:
    return Measurement(Candidate("p", slot, sms, mhz), t, e, e * 0.6, 100.0, 50.0, mhz, 1)


def test_samples_start_where_the_plan_runs_and_spread_along_the_front():
    from collections import Counter

    ms = [_m("a", 4, 1.0, 9.0), _m("a", 8, 1.1, 8.0), _m("b", 4, 1.2, 7.0), _m("b", 8, 1.3, 6.0),
          _m("c", 4, 1.4, 5.0), _m("c", 8, 2.0, 9.5)]  # the last is dominated
    assert [m.candidate.slot for m in front(ms)] == ["a", "a", "b", "b", "c"]
    used = Counter({Candidate("p", "b", 8, 1410): 5, Candidate("p", "c", 8, 1410): 1, Candidate("q", "a", 4, 1410): 9})
    chosen = choose("p", ms, used, 3)
    assert chosen[:2] == [ms[3], ms[5]]  # the plan's, most used first (a dominated one too: the plan runs it)
    assert chosen[2] in front(ms) and len(set(id(m) for m in chosen)) == 3
    assert choose("p", ms, Counter(), 10) == front(ms)  # no plan: the whole front, at most n
