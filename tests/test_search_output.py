"""mode=search outputs: per-partition frontier CSVs and the summary with its stated reference."""
import csv
import json

import pytest

import kareus.search  # noqa: F401
from kareus.events import BatchFinished
from kareus.registry import SEARCHERS
from kareus.search.base import SearchProblem
from kareus.search.output import FRONTIER_COLUMNS, write_search_outputs
from kareus.search.space import SpaceConfig, build_space
from kareus.search.synthetic import SYNTH_GPU, SyntheticGPU, synthetic_partition


def test_write_search_outputs(tmp_path):
    part = synthetic_partition("fwd_x")
    space = build_space(part, SYNTH_GPU, SpaceConfig(sms=[4, 8, 12]))
    fail = {space[0], space[5]}
    gpu = SyntheticGPU(part, fail=fail)
    events = []
    prob = SearchProblem(part, space, gpu.evaluate, 40, 0, SYNTH_GPU.static_power_w, [space[0], space[5], space[9]],
                         emit=events.append)
    res = SEARCHERS.build("random", config={"seed": 0}).run(prob)
    summary = write_search_outputs(tmp_path, [res], {"fwd_x": len(space)})

    rows = list(csv.DictReader(open(tmp_path / "frontiers" / "partition_fwd_x.csv")))
    assert tuple(rows[0]) == FRONTIER_COLUMNS
    assert len(rows) == len(res.frontier) >= 1
    times = [float(r["time_s"]) for r in rows]
    energies = [float(r["energy_j"]) for r in rows]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)
    for r in rows:  # measured values of a profiled candidate
        m = next(m for m in res.measurements if (m.candidate.slot, m.candidate.sms, m.candidate.freq_mhz)
                 == (r["slot"], int(r["sms"]), int(r["freq_mhz"])))
        assert float(r["time_s"]) == m.time_s and float(r["dynamic_energy_j"]) == m.dynamic_energy_j

    doc = json.loads((tmp_path / "search_summary.json").read_text())
    assert doc == json.loads(json.dumps(summary))
    e = doc["fwd_x"]
    assert (e["space"], e["profiled"], e["failed"]) == (len(space), 40, 2)
    # one reference for the whole search: fixed by its first batch with numbers (the initial design,
    # whose one non-failed profile is space[9]); the live values and this summary both use it
    first = next(m for m in res.measurements if m.candidate == space[9])
    assert e["reference"] == [1.1 * first.time_s, 1.1 * first.energy_j] == list(res.reference)
    assert e["hypervolume"] > 0
    assert e["hypervolume_ratio"] == pytest.approx(e["hypervolume"] / (e["reference"][0] * e["reference"][1]))
    batches = [ev for ev in events if isinstance(ev, BatchFinished)]
    assert all(ev.reference == res.reference for ev in batches)
    assert batches[-1].hypervolume_ratio == pytest.approx(e["hypervolume_ratio"])  # live ends where final is
