"""What ``mode=search`` leaves in the run directory: per-partition frontiers and a summary.

``search_summary.json`` states its hypervolume reference per partition (``"reference": [time_s,
energy_j]``): the one the search fixed with its first batch of measurements, 1.1 x that batch's
largest time and total energy, so the final value continues the live one. ``hypervolume_ratio`` is
the share of the rectangle (0 s, 0 J)-reference that the frontier dominates (0..1);
``hypervolume`` keeps the raw value in seconds x joules.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from kareus.frontier import hypervolume_ratio
from kareus.search.base import SearchResult
from kareus.search.common import result_reference
from kareus.search.hv import hypervolume

FRONTIER_COLUMNS = ("slot", "sms", "freq_mhz", "time_s", "energy_j", "dynamic_energy_j")


def write_search_outputs(run_dir: Path, results: list[SearchResult], space_sizes: dict[str, int],
                         failed: dict[str, int] | None = None) -> dict[str, dict]:
    """Write ``frontiers/partition_<key>.csv`` (measured values of the total-energy frontier points)
    and ``search_summary.json``; return the summary."""
    run_dir = Path(run_dir)
    (run_dir / "frontiers").mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict] = {}
    for r in results:
        with open(run_dir / "frontiers" / f"partition_{r.partition}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(FRONTIER_COLUMNS)
            for p in r.frontier:
                m = p.payload
                c = m.candidate
                w.writerow([c.slot, int(c.sms), int(c.freq_mhz), repr(float(m.time_s)), repr(float(m.energy_j)),
                            repr(float(m.dynamic_energy_j))])
        ok = [m for m in r.measurements if not m.failed]
        n_failed = failed.get(r.partition) if failed and r.partition in failed else len(r.measurements) - len(ok)
        entry = {"space": int(space_sizes.get(r.partition, len(r.measurements))), "profiled": len(r.measurements),
                 "failed": int(n_failed), "hypervolume_ratio": 0.0, "hypervolume": 0.0, "reference": None,
                 "frontier_points": len(r.frontier)}
        ref = result_reference(r)
        if ok and ref is not None:
            entry["hypervolume"] = hypervolume([[p.time_s, p.energy_j] for p in r.frontier], ref)
            entry["hypervolume_ratio"] = hypervolume_ratio(entry["hypervolume"], ref) or 0.0
            entry["reference"] = [float(x) for x in ref]
        summary[r.partition] = entry
    (run_dir / "search_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
