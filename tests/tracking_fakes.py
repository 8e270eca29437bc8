"""Synthetic search events for the tracking, plot and progress tests (no searcher needed)."""
from __future__ import annotations

from kareus.events import BatchFinished, CandidateMeasured, SearchFinished, SearchStarted
from kareus.frontier import Frontier, hypervolume_2d
from kareus.types import Candidate, FrontierPoint, Measurement

SLOTS = ("sequential", "norm_0", "attn_0")
CLOCKS = (1410, 1200, 1005, 810)


def measurement(partition: str, i: int) -> Measurement:
    """A plausible candidate: lower clocks are slower and use less dynamic energy."""
    slot, freq, sms = SLOTS[i % 3], CLOCKS[(i // 3) % 4], 8 + 4 * (i % 5)
    time_s = 1e-3 * (1.0 + 0.4 * (1410 - freq) / 1410 + 0.05 * (i % 3) + 0.002 * sms)
    dynamic = 0.25 * (freq / 1410) ** 2 + 0.001 * sms
    static_w = 60.0
    return Measurement(Candidate(partition, slot, sms, freq), time_s, dynamic + static_w * time_s, dynamic,
                       static_w, 55.0 + i % 4, float(freq), 3)


def search_events(partition: str, n: int = 12, batch: int = 4, failed_at: int | None = 5, budget: int | None = None,
                  ref: tuple[float, float] = (3e-3, 0.6)):
    """SearchStarted, n CandidateMeasured (one failed), BatchFinished every ``batch``, SearchFinished."""
    events = [SearchStarted(partition, space_size=240, budget=budget or n, searcher="mbo")]
    ok: list[Measurement] = []
    hv = 0.0
    for i in range(n):
        m = measurement(partition, i)
        if i == failed_at:
            m = Measurement.failure(m.candidate, "timeout")
        else:
            ok.append(m)
        predicted = {"time_s": m.time_s * 1.02, "energy_j": m.energy_j * 0.98} if i >= batch else None
        events.append(CandidateMeasured(partition, i, m, predicted=predicted,
                                        pass_name="initial" if i < batch else ("total", "dynamic")[i % 2],
                                        gpu_seconds=0.25 * (i + 1)))
        if (i + 1) % batch == 0:
            hv = hypervolume_2d([x.time_s for x in ok], [x.energy_j for x in ok], ref)
            events.append(BatchFinished(partition, (i + 1) // batch, i + 1, hv, predicted_gain=0.1, reference=ref))
    frontier = Frontier.from_points(FrontierPoint(m.time_s, m.energy_j, m) for m in ok)
    events.append(SearchFinished(partition, frontier, n, 1 if failed_at is not None and failed_at < n else 0,
                                 0.25 * n, hv, reference=ref))
    return events


_TEMPLATE: list = []


def empty_store(dest_dir) -> str:
    """A ready (migrated) empty SQLite MLflow store copied into ``dest_dir``; returns its URI.

    Creating a store runs every schema migration (seconds), so tests copy one made once per MLflow
    version and kept in the system temp folder.
    """
    import os
    import shutil
    import tempfile
    from importlib.metadata import version
    from pathlib import Path

    if not _TEMPLATE:
        cached = Path(tempfile.gettempdir()) / f"kareus-mlflow-template-{version('mlflow')}.db"
        if not cached.is_file():
            from kareus.tracking.store import client_for

            tmp = Path(tempfile.mkdtemp(prefix="kareus-mlflow-template-"))
            client_for(f"sqlite:///{tmp}/mlflow.db")
            os.replace(tmp / "mlflow.db", cached)  # atomic: concurrent sessions never see half a file
            shutil.rmtree(tmp, ignore_errors=True)
        _TEMPLATE.append(cached)
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(_TEMPLATE[0], dest / "mlflow.db")
    return f"sqlite:///{dest}/mlflow.db"
