"""Ray nodes benchmark: wall time of one simulated search run on 1, 2 and 3 nodes of a local Ray cluster.

Runs ``python -m kareus +model=tiny parallel=pp1_tp2 mode=search`` (6 partition searches) with
``launcher=local`` and with ``launcher=ray`` against a ``ray.cluster_utils.Cluster`` on this machine:
a head without CPUs (the driver's relay) and 1, 2, then 3 worker nodes of one CPU each, so each node
runs one search at a time. Every run must give the local run's frontiers (checked). The speed-up is
against the one-node cluster; on a machine with fewer cores than nodes it is bounded by the cores, and
the nodes' own Ray processes (raylet, agents, one worker per search) take their share of them. On the
one-node cluster it also times the relay itself (``relay``): its fixed cost per run and per candidate.

    python benchmarks/ray_nodes.py                    # 1, 2, 3 nodes; budget_frac 0.1
    python benchmarks/ray_nodes.py --nodes 1 2 --budget-frac 0.3 --override search.surrogate.threads=1

Writes runs/bench/ray_nodes.json (``--out``). Wall times are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ["+model=tiny", "parallel=pp1_tp2", "mode=search", "progress=false", "tracking.enabled=false"]


def _env() -> dict[str, str]:
    """The runs' environment: the driver takes 127.0.0.1 for its own address, as the cluster's nodes do."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONWARNINGS="ignore")
    return env


def run(cwd: Path, name: str, budget_frac: float, *extra: str) -> tuple[float, dict[str, Any]]:
    """(wall seconds, the search's outputs) of one run in ``cwd/runs/<name>``."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kareus", *WORKLOAD, f"search.budget_frac={budget_frac}",
                           f"hydra.run.dir=runs/{name}", *extra], cwd=cwd, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    out = cwd / "runs" / name
    files = [out / "search_summary.json", *sorted((out / "frontiers").glob("*.csv"))]
    summary = json.loads((out / "summary.json").read_text())
    return wall, {"outputs": {p.name: p.read_text() for p in files}, "nodes": summary.get("nodes", {})}


def relay_cost(address: str, folder: Path) -> dict[str, float]:
    """The relay's own cost on one node, timed in this process: fixed (a Ray job's workers starting, the
    mailbox actor) and per candidate (a second SQLite commit and two actor calls), from one random search
    of 10 and one of 210 candidates under launcher=local and launcher=ray (each the second of two runs)."""
    from kareus.config.hashing import stable_hash
    from kareus.hardware.tables import window_partition
    from kareus.launch import PartitionSearchTask
    from kareus.registry import LAUNCHERS

    profiler = {"cooldown": {"name": "fixed", "seconds": 1.0}, "frequency": {"name": "sim"}}

    def timed(name: str, cfg: dict[str, Any], budget: int, i: int) -> float:
        search = {"name": "random", "budget": budget}
        task = PartitionSearchTask(partition=window_partition(-1), hardware={"name": "sim"}, search=search,
                                   profiler=profiler, seed=3, journal_path=str(folder / f"{name}{budget}.{i}.sqlite"),
                                   config_hash=stable_hash([search, profiler]))
        t0 = time.perf_counter()
        LAUNCHERS.build(name, config=cfg).run([task])
        return time.perf_counter() - t0

    extra = {}
    for budget in (10, 210):
        local = [timed("local", {}, budget, i) for i in range(2)][-1]
        ray = [timed("ray", {"address": address, "local_dir": str(folder / "nodes")}, budget, i) for i in range(2)][-1]
        extra[budget] = ray - local
    per = (extra[210] - extra[10]) / 200
    return {"fixed_s": round(extra[10] - 10 * per, 2), "per_candidate_ms": round(per * 1000, 1)}


def on_nodes(cwd: Path, args: argparse.Namespace, local: dict[str, Any]) -> tuple[list[dict], dict[str, float]]:
    """One row per node count (the frontiers checked against launcher=local's) and the relay's cost."""
    from ray.cluster_utils import Cluster

    rows, cost = [], {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    try:
        for n in sorted(args.nodes):
            while len(cluster.worker_nodes) < n:
                cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            wall, got = run(cwd, f"ray{n}", args.budget_frac, *args.override, "launcher=ray",
                            f"launcher.address={cluster.address}", f"launcher.local_dir={cwd / 'nodes'}")
            if got["outputs"] != local["outputs"]:
                raise SystemExit(f"{n} node(s): the frontiers differ from launcher=local's")
            rows.append({"launcher": "ray", "nodes": n, "wall_s": round(wall, 1),
                         "searches_per_node": sorted(v["searches"] for v in got["nodes"].values())})
            if n == 1:
                cost = relay_cost(cluster.address, cwd / "relay")
    finally:
        cluster.shutdown()
    return rows, cost


def report(rows: list[dict], cost: dict[str, float], out: Path, command: str) -> None:
    one = next((r["wall_s"] for r in rows if r["nodes"] == 1), None)
    for r in rows:
        r["speedup_vs_1_node"] = round(one / r["wall_s"], 2) if one else None
    result = {"command": command, "cores": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 1),
              "rows": rows, "relay": cost}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'launcher':<8} {'nodes':>5} {'wall s':>7} {'vs 1 node':>9}  searches per node")
    for r in rows:
        print(f"{r['launcher']:<8} {r['nodes'] or '-':>5} {r['wall_s']:>7.1f} {r['speedup_vs_1_node'] or 0:>9.2f}  "
              f"{r.get('searches_per_node', '')}")
    if cost:
        print(f"relay on one node: {cost['fixed_s']:.1f} s per run, {cost['per_candidate_ms']:.1f} ms per candidate")
    print(f"({os.cpu_count()} cores, load average {result['load_average_1min']}; frontiers equal launcher=local's "
          f"in every run) -> {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--budget-frac", type=float, default=0.1)
    ap.add_argument("--override", nargs="*", default=[], help="more overrides for every run (launcher=local's too)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "ray_nodes.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from kareus.launch.launchers import _broken_amdsmi_shim

    _broken_amdsmi_shim()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: nodes and driver on 127.0.0.1
    own = tempfile.mkdtemp(prefix="kr")  # short (socket paths): a plain ray.init() elsewhere must not find it
    os.environ["RAY_TMPDIR"] = own
    cwd = Path(tempfile.mkdtemp(prefix="kareus-ray-nodes-"))
    try:
        local_s, local = run(cwd, "local", args.budget_frac, *args.override)
        rows, cost = on_nodes(cwd, args, local)
    finally:
        shutil.rmtree(own, ignore_errors=True)
        shutil.rmtree(cwd, ignore_errors=True)
    command = " ".join(["python -m kareus", *WORKLOAD, f"search.budget_frac={args.budget_frac}", *args.override])
    report([{"launcher": "local", "nodes": 0, "wall_s": round(local_s, 1)}, *rows], cost, Path(args.out), command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
