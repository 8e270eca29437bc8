"""What the real A100 table says about mechanisms the simulated GPU may lack (the N+P gap).

The simulated testbed puts nanobatching + Perseus (N+P: every comm kernel launched at its partition's
first slot with the comm library's default SMs) within a fraction of a percent of Kareus, where the
paper measured N+P clearly behind. Published Figure 3 names two mechanisms qualitatively: the
memory-bandwidth contention of an early launch and SM stealing at high comm SM counts. Before either is
added to the simulator, this script asks the only real table (shared/data/a100_attention_tp2) what it
supports, with the model fitted by ``sim_fidelity``'s protocol (7 parameters, two windows, 1410 MHz):

- ``residuals``: per clock, the model's log error of time and energy on every block-size-1024 row, its
  rank correlation with the knobs (comm SMs, launch op, join op) and its mean per launch group;
- ``early_launch``: the real and the simulated cost of launching the comm before op 0 (beside the
  memory-bound bias-dropout-add and layernorm) instead of before op 2 (the QKV GEMM), joined at the same
  op with the same SMs, against the table's own repeat spread;
- ``sm_stealing``: per window overlapped to the chain's end, the SM count of the fastest row and how
  much slower 20 SMs are than it, real and simulated;
- ``np_choice``: on the table's partition, N+P's row (launch before op 0, joined at the end, the
  default 16 SMs) against the fastest and the least-energy rows of the search space (launch slot or
  sequential, 2..16 SMs step 2), real and simulated (the recorded harness's mode);
- ``probes``: the same contrasts, refitted, with an existing parameter that carries one of the two
  mechanisms moved across its range (``memory_sat_frac``: how many SMs a memory-bound kernel needs, so
  how much comm SMs steal from it; ``contention_hbm``: how much a streaming kernel slows the comm);
- ``mission`` (simulated, shipped mode): per partition of the mission configuration (qwen1.7b pp2_tp8,
  micro-batch 8, sequence 4096) and of the paper's small workload (the same on pp2_cp2_tp4), the fastest
  candidate of the default search space at the top clock against N+P's candidate.

    python benchmarks/sim_residuals.py [--src ../shared/data/a100_attention_tp2] [--no-mission]
    python benchmarks/sim_fidelity.py --residuals     # the fidelity run, then this

Writes runs/bench/sim_residuals.json. All simulated numbers are labelled so; the real ones are the
table's medians of three repeats.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sim_fidelity as sf  # noqa: E402
from kareus.hardware.sim_config import SimConfig  # noqa: E402
from kareus.hardware.tables import repeat_spread  # noqa: E402

EARLY, GEMM = 0, 2  # launch before the bias-dropout-add (memory-bound) vs before linear_qkv (GEMM)
LAUNCH_GROUPS = {"sequential": (-1,), "early_memory": (0,), "gemm_and_after": (2, 3), "late": (5, 6)}
NP_SMS = 16  # the shipped A100's hardware.default_comm_sms, N+P's choice; ``contrasts`` passes the config's
LAST_OP = 6
HIGH_SMS = 8  # from here the comm is hidden in the real table's windows joined at op 5 or 6
LATE_JOIN = 5  # joined after attention or linear_proj: both launches leave the comm room to finish
PROBES: dict[str, tuple[float, ...]] = {"memory_sat_frac": (0.35, 0.65, 0.95), "contention_hbm": (0.0, 0.4)}


Row = dict[str, Any]
Table = Mapping[int, list[Row]]


def predicted(cfg: SimConfig, data: Table) -> dict[tuple[int, int, int, int], tuple[float, float]]:
    """(clock, start, end, sms) -> the simulated time and energy of every real row (harness mode)."""
    return {(mhz, r["start"], r["end"], r["sms"]): sf.predict(cfg, r, mhz) for mhz, rows in data.items() for r in rows}


def measured(data: Table) -> dict[tuple[int, int, int, int], tuple[float, float]]:
    """The same keys -> the real table's median time and energy."""
    return {(mhz, r["start"], r["end"], r["sms"]): (r["time_s"], r["energy_j"])
            for mhz, rows in data.items() for r in rows}


def _rho(a: Sequence[float], b: Sequence[float]) -> float | None:
    from scipy.stats import spearmanr

    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(spearmanr(a, b)[0])


def residuals(real: Mapping, sim: Mapping) -> dict[str, Any]:
    """Per clock: the model's log errors (sim / real) against the knobs, so a missing mechanism shows as
    a residual that follows one of them. Rank correlations are over the overlapped rows."""
    out: dict[str, Any] = {}
    for mhz in sorted({k[0] for k in real}):
        keys = [k for k in real if k[0] == mhz]
        rt = {k: float(np.log(sim[k][0] / real[k][0])) for k in keys}
        re_ = {k: float(np.log(sim[k][1] / real[k][1])) for k in keys}
        ov = [k for k in keys if k[1] >= 0]
        by_group = {}
        for name, starts in LAUNCH_GROUPS.items():
            ks = [k for k in keys if k[1] in starts]
            if ks:
                by_group[name] = {"rows": len(ks), "time_mean": float(np.mean([rt[k] for k in ks])),
                                  "energy_mean": float(np.mean([re_[k] for k in ks]))}
        out[str(mhz)] = {
            "rows": len(keys),
            "time_median_abs": float(np.median(np.abs(list(rt.values())))),
            "energy_median_abs": float(np.median(np.abs(list(re_.values())))),
            "time_rho": {knob: _rho([k[i] for k in ov], [rt[k] for k in ov]) for knob, i in
                         (("sms", 3), ("start", 1), ("end", 2))},
            "energy_rho": {knob: _rho([k[i] for k in ov], [re_[k] for k in ov]) for knob, i in
                           (("sms", 3), ("start", 1), ("end", 2))},
            "by_launch": by_group,
        }
    return out


def early_launch(real: Mapping, sim: Mapping, mhz: int = sf.FIT_CLOCK) -> dict[str, Any]:
    """log(time launched before op 0 / time launched before op 2), joined after the same op with the same
    SMs: the published 'early launch beside memory-bound ops' contention, where the table has both."""
    pairs = sorted((k[2], k[3]) for k in real if k[0] == mhz and k[1] == EARLY and k[2] >= GEMM
                   and (mhz, GEMM, k[2], k[3]) in real)

    def d(src: Mapping, end: int, sms: int, i: int) -> float:
        return float(np.log(src[(mhz, EARLY, end, sms)][i] / src[(mhz, GEMM, end, sms)][i]))

    rows = [{"end": e, "sms": s, "real_time": d(real, e, s, 0), "sim_time": d(sim, e, s, 0),
             "real_energy": d(real, e, s, 1), "sim_energy": d(sim, e, s, 1)} for e, s in pairs]
    # Joined before op LATE_JOIN, the earlier launch also lengthens the overlap itself, so only the late
    # joins (the comm fits in either window) isolate what the ops beside an early launch cost.
    summary = {}
    for band, keep in (("late_join_low_sms", lambda r: r["end"] >= LATE_JOIN and r["sms"] < HIGH_SMS),
                       ("late_join_high_sms", lambda r: r["end"] >= LATE_JOIN and r["sms"] >= HIGH_SMS),
                       ("early_join", lambda r: r["end"] < LATE_JOIN)):
        sel = [r for r in rows if keep(r)]
        if sel:
            summary[band] = {k: float(np.mean([r[k] for r in sel])) for k in
                             ("real_time", "sim_time", "real_energy", "sim_energy")} | {"pairs": len(sel)}
    return {"clock": mhz, "pairs": rows, "summary": summary}


def sm_stealing(real: Mapping, sim: Mapping, mhz: int = sf.FIT_CLOCK) -> dict[str, Any]:
    """Per window overlapped to the chain's end: the fastest SM count and the slowdown from it to the
    most SMs the table holds, real and simulated (SM stealing past the point the comm is hidden)."""
    out = {}
    for start in sorted({k[1] for k in real if k[0] == mhz and k[1] >= 0 and k[2] == LAST_OP}):
        ks = sorted((k for k in real if k[0] == mhz and k[1] == start and k[2] == LAST_OP), key=lambda k: k[3])
        top = ks[-1]
        row = {}
        for name, src in (("real", real), ("sim", sim)):
            best = min(ks, key=lambda k: src[k][0])
            row[name] = {"fastest_sms": best[3], "rise_to_top": float(np.log(src[top][0] / src[best][0]))}
        row["top_sms"] = top[3]
        out[f"{start},{LAST_OP}"] = row
    return out


def space_sms(cfg: SimConfig | None = None) -> tuple[int, ...]:
    """The default search space's SM counts on the (shipped) A100 (kareus.search.space)."""
    from kareus.search.space import SpaceConfig, sm_counts

    return tuple(sm_counts(SpaceConfig(), (cfg or sf.base_config()).gpu_spec()))


def np_choice(real: Mapping, sim: Mapping, mhz: int = sf.FIT_CLOCK, np_sms: int = NP_SMS,
              sms_space: Sequence[int] | None = None) -> dict[str, Any]:
    """N+P's row on the table's partition (launch before op 0, joined at the end, the default SMs) against
    the search space's fastest and least-energy rows (windows joined at the end or sequential)."""
    sms_space = space_sms() if sms_space is None else sms_space
    space = [k for k in real if k[0] == mhz and k[3] in sms_space and (k[2] == LAST_OP or k[1] < 0)]
    np_key = (mhz, EARLY, LAST_OP, np_sms)
    out: dict[str, Any] = {"clock": mhz, "space_rows": len(space), "np_sms": np_sms, "sms_space": list(sms_space)}
    if np_key not in real:
        return out | {"missing": "the table has no N+P row at this clock"}
    for name, src in (("real", real), ("sim", sim)):
        fast = min(space, key=lambda k: src[k][0])
        low = min(space, key=lambda k: src[k][1])
        out[name] = {
            "fastest": {"window": [fast[1], fast[2]], "sms": fast[3]},
            "least_energy": {"window": [low[1], low[2]], "sms": low[3]},
            "np_time_over_fastest": float(src[np_key][0] / src[fast][0] - 1.0),
            "np_energy_over_least": float(src[np_key][1] / src[low][1] - 1.0),
        }
    return out


def contrasts(cfg: SimConfig, data: Table) -> dict[str, Any]:
    """Every table-only contrast of one fitted config."""
    real, sim = measured(data), predicted(cfg, data)
    return {"residuals": residuals(real, sim), "early_launch": early_launch(real, sim),
            "sm_stealing": sm_stealing(real, sim),
            "np_choice": np_choice(real, sim, np_sms=cfg.default_comm_sms, sms_space=space_sms(cfg))}


def probes(data: Table, fit_rows: list[Row], test: Mapping[int, list[Row]],
           settings: Mapping[str, Iterable[float]] = PROBES) -> list[dict[str, Any]]:
    """Refit the 7 parameters with one mechanism's existing parameter moved (held fixed, out of the fit
    when it is a fitted one), and score the contrasts and held-out fidelity of each."""
    out = []
    for name, values in settings.items():
        for v in values:
            base = dataclasses.replace(sf.base_config(), **{name: float(v)})
            names = [k for k in sf.FIT if k != name]
            cfg, rms = sf.fit(fit_rows, names, ideal=False, base=base)
            c = contrasts(cfg, data)
            s = sf.scores(cfg, test, False)
            out.append({"parameter": name, "value": float(v), "fit_rms": rms,
                        "early_launch": c["early_launch"]["summary"], "sm_stealing": c["sm_stealing"],
                        "np_choice": {k: c["np_choice"][k] for k in ("real", "sim") if k in c["np_choice"]},
                        "scores": {k: s[k] for k in ("time_median_ape", "energy_median_ape", "time_spearman",
                                                     "energy_spearman")},
                        "fitted": {k: float(getattr(cfg, k)) for k in names}})
    return out


MISSIONS = {  # the mission configuration (Table 8's) and the paper's small workload
    "qwen1.7b tp8 mb8 s4096": ("+model=qwen1.7b", "parallel=pp2_tp8", "parallel.micro_batch_size=8",
                               "parallel.seq_len=4096"),
    "qwen1.7b cp2tp4 mb8 s4096": ("+model=qwen1.7b", "parallel=pp2_cp2_tp4", "parallel.micro_batch_size=8",
                                  "parallel.seq_len=4096"),
}


def mission(overrides: Sequence[str] = MISSIONS["qwen1.7b tp8 mb8 s4096"]) -> list[dict[str, Any]]:
    """Simulated, shipped mode: per partition with a comm, the fastest candidate of the default search
    space at the top clock beside N+P's (first slot, default SMs): why N+P ties Kareus there."""
    import tempfile

    import paper
    from omegaconf import OmegaConf

    from kareus.config.validate import validate
    from kareus.hardware.model import simulate_partition
    from kareus.pipeline.context import build_context
    from kareus.registry import to_dataclass
    from kareus.search.space import sm_counts
    from kareus.types import SEQUENTIAL

    cfg = paper.composed(list(overrides))
    hw = to_dataclass(SimConfig, OmegaConf.to_container(cfg.hardware, resolve=True))
    with tempfile.TemporaryDirectory() as tmp:
        ctx = build_context(cfg, validate(cfg), Path(tmp))
    sms_space = sm_counts(ctx.typed["search"].space, hw.gpu_spec())
    out = []
    for p in ctx.partitioning.types:
        if p.comm is None or not p.slots:
            continue
        cands = [(s, n) for s in (SEQUENTIAL, *(x.label for x in p.slots)) for n in sms_space]
        t = {c: simulate_partition(hw, p, c[0], c[1], hw.max_mhz).time_s for c in cands}
        npc = (p.slots[0].label, hw.default_comm_sms)
        fast = min(cands, key=lambda c: (t[c], c != npc))  # a tie goes to N+P's candidate
        o_np = simulate_partition(hw, p, npc[0], npc[1], hw.max_mhz)
        # beyond the space: every SM count the hardware allows, at N+P's slot
        wide = min(range(1, hw.max_comm_sms + 1),
                   key=lambda n: (simulate_partition(hw, p, npc[0], n, hw.max_mhz).time_s, n != npc[1]))
        t_wide = simulate_partition(hw, p, npc[0], wide, hw.max_mhz).time_s
        out.append({"partition": p.key, "slots": [x.label for x in p.slots], "sms_space": list(sms_space),
                    "fastest": {"slot": fast[0], "sms": fast[1]}, "np": {"slot": npc[0], "sms": npc[1]},
                    "np_time_over_fastest": float(o_np.time_s / t[fast] - 1.0),
                    # the comm outlasting the compute stream at N+P's candidate: a comm-bound partition,
                    # where what the ops beside the launch cost is off the critical path
                    "np_exposed_comm_share": float(o_np.exposed_comm_s / o_np.time_s),
                    "fastest_any_sms": wide, "np_time_over_fastest_any_sms": float(o_np.time_s / t_wide - 1.0)})
    return out


def analyse(src: Path, with_mission: bool = True, with_probes: bool = True) -> dict[str, Any]:
    """The whole analysis: the shipped fit's contrasts, the probes and (simulated) the mission's partitions."""
    data, fit_rows, test = sf.split(src)
    cfg, rms = sf.fit(fit_rows, list(sf.FIT), ideal=False)
    spread = repeat_spread(data)
    out: dict[str, Any] = {
        "description": "the simulated A100's residuals against the real A100 table and the contrasts that test "
                       "the published N+P mechanisms (early-launch HBM contention, SM stealing); real numbers are "
                       "the table's, sim numbers are simulated; log ratios unless named otherwise",
        "fit_rms": rms, "fitted": {k: float(getattr(cfg, k)) for k in sf.FIT},
        "repeat_spread_time": {k: v["time_range"] for k, v in spread.items()},
        **contrasts(cfg, data),
    }
    if with_probes:
        out["probes"] = probes(data, fit_rows, test)
    if with_mission:
        out["mission"] = {name: mission(ov) for name, ov in MISSIONS.items()}
    return out


def _pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:+.1f}%"


def report(res: Mapping[str, Any]) -> None:
    """Print the analysis for a reader who has not opened the JSON."""
    print("Residuals of the fitted model (log sim/real; simulated vs the real table):")
    for mhz, r in res["residuals"].items():
        g = ", ".join(f"{k} {_pct(v['time_mean'])} t / {_pct(v['energy_mean'])} e ({v['rows']})"
                      for k, v in r["by_launch"].items())
        rho = ", ".join(f"{k} {v:+.2f}" if v is not None else f"{k} n/a" for k, v in r["time_rho"].items())
        print(f"  {mhz} MHz ({r['rows']} rows): mean by launch: {g}")
        print(f"           time residual's rank correlation over overlapped rows with {rho}")
    el = res["early_launch"]["summary"]
    print(f"Early launch (before op 0, beside memory-bound ops) vs before op 2 (GEMM), same join and SMs "
          f"(table's median time repeat spread {100 * res['repeat_spread_time']['1410']:.2f}%):")
    for band, v in el.items():
        print(f"  {band:>18} ({v['pairs']} pairs): real time {_pct(v['real_time'])}, sim {_pct(v['sim_time'])}; "
              f"real energy {_pct(v['real_energy'])}, sim {_pct(v['sim_energy'])}")
    print("SM stealing, windows overlapped to the end: fastest SMs and the slowdown to the top SM count:")
    for w, v in res["sm_stealing"].items():
        print(f"  ({w}): real {v['real']['fastest_sms']:>2} SMs, {_pct(v['real']['rise_to_top'])}; "
              f"sim {v['sim']['fastest_sms']:>2} SMs, {_pct(v['sim']['rise_to_top'])}")
    npc = res["np_choice"]
    if "real" in npc:
        for k in ("real", "sim"):
            v = npc[k]
            print(f"N+P's row on the table ({k}): {_pct(v['np_time_over_fastest'])} time over the fastest "
                  f"{v['fastest']['window']}@{v['fastest']['sms']}, {_pct(v['np_energy_over_least'])} energy over "
                  f"the least {v['least_energy']['window']}@{v['least_energy']['sms']}")
    for p in res.get("probes", []):
        el = p["early_launch"].get("late_join_high_sms", {})
        s = p["scores"]
        print(f"probe {p['parameter']}={p['value']:g}: early launch (join >= op {LATE_JOIN}, >= {HIGH_SMS} SMs) "
              f"sim {_pct(el.get('sim_time'))}"
              f" (real {_pct(el.get('real_time'))}); held-out time {100 * s['time_median_ape']:.1f}%, energy "
              f"{100 * s['energy_median_ape']:.1f}%, rho {s['time_spearman']:.2f}/{s['energy_spearman']:.2f}")
    for name, parts in res.get("mission", {}).items():
        print(f"{name} (simulated, shipped mode, top clock):")
        for m in parts:
            print(f"  {m['partition']:>10}: space's fastest {m['fastest']['slot']}@{m['fastest']['sms']}, "
                  f"N+P {m['np']['slot']}@{m['np']['sms']}: {_pct(m['np_time_over_fastest'])} (comm exposed "
                  f"{100 * m['np_exposed_comm_share']:.0f}% of its time); its slot at any SMs: "
                  f"{m['fastest_any_sms']} SMs, "
                  f"{_pct(m['np_time_over_fastest_any_sms'])}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=str(ROOT.parent / "shared/data/a100_attention_tp2"))
    ap.add_argument("--out", default=str(ROOT / "runs/bench/sim_residuals.json"))
    ap.add_argument("--no-mission", action="store_true", help="skip the simulated mission configuration")
    ap.add_argument("--no-probes", action="store_true", help="skip the refits with a mechanism's parameter moved")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = analyse(Path(args.src), with_mission=not args.no_mission, with_probes=not args.no_probes)
    res["wall_s"] = time.perf_counter() - t0
    report(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out} ({res['wall_s']:.1f} s)")
    return res


if __name__ == "__main__":
    main()
