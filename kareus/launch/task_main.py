"""Run one partition search from a JSON task file in a fresh process.

    python -m kareus.launch.task_main TASK.json [--out RESULT.json] [--pace SECONDS]

Re-running the same task resumes from its journal (candidates already measured are not measured
again). ``--pace`` sleeps after each new measurement (real seconds), for watching a simulated search
or interrupting it deliberately. The result file lists the measured candidates and both frontiers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kareus.events import CandidateMeasured
from kareus.launch.task import run_search_task, task_from_dict
from kareus.search.base import SearchResult


def result_to_dict(result: SearchResult) -> dict[str, Any]:
    def key(payload: Any) -> list[Any] | None:
        payload = getattr(payload, "candidate", payload)  # a Measurement or a Candidate
        return list(payload.key) if hasattr(payload, "key") else None

    def front(f: Any) -> list[list[Any]]:
        return [[p.time_s, p.energy_j, key(p.payload)] for p in f]

    return {
        "partition": result.partition,
        "measured": [list(m.candidate.key) for m in result.measurements],
        "failed": [list(m.candidate.key) for m in result.measurements if m.failed],
        "frontier": front(result.frontier),
        "dynamic_frontier": front(result.dynamic_frontier),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kareus.launch.task_main", description=__doc__.split("\n")[0])
    ap.add_argument("task")
    ap.add_argument("--out")
    ap.add_argument("--pace", type=float, default=0.0)
    args = ap.parse_args(argv)
    with open(args.task) as f:
        task = task_from_dict(json.load(f))

    def pace(event: Any) -> None:
        if args.pace > 0 and isinstance(event, CandidateMeasured) and not event.cached:
            time.sleep(args.pace)

    result = run_search_task(task, listeners=[pace])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result_to_dict(result), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
