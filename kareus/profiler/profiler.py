"""The profiler: measures candidates by the configured protocol and never loses or repeats one.

Protocol per candidate (every step a ``profiler:`` value): cool down (policy), lock the clock
(frequency controller), settle, warm up, time a few calibration runs to size the window to about
``target_window_s`` of back-to-back executions, read energy over ``repeats`` windows, drop MAD
outliers, aggregate. Each result is committed to the journal before the search sees it; candidates
already in the journal are answered from it at no cost (``CandidateMeasured(cached=True)``). A search
may ask for a candidate's k-th re-measurement (annotation ``{"reading": k}``, k >= 1): a new reading,
journaled with the flag ``reading:<k>`` and charged like any profile, or on resume that row.
A cooldown policy that corrects the heat instead of waiting for it may probe once, run anchor
windows before a candidate's window, observe every window and subtract residual-heat energy (see
cooldown.py); the measurement then carries the corrected value and a ``thermal:`` flag, its
readings stay raw.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from typing import Any, Callable, Sequence

from kareus.errors import KareusError
from kareus.events import CandidateMeasured
from kareus.hardware.base import HardwareBackend
from kareus.interrupts import signals_deferred
from kareus.profiler.config import ProfilerConfig, section
from kareus.profiler.cooldown import group_all, group_max, group_mean
from kareus.profiler.journal import Journal
from kareus.profiler.stats import mad_outliers, median
from kareus.registry import COOLDOWNS, FREQUENCY_CONTROLLERS
from kareus.search.base import Evaluate
from kareus.types import REREAD, SEQUENTIAL, Candidate, Measurement, Op, PartitionType, Reading


class ReadError(RuntimeError):
    """A transient failure to read time or energy (NVML error, counter glitch): worth retrying.

    Backends raise it (or return ``Reading(ok=False)``); any other exception from a backend means the
    kernel itself failed, and the candidate is recorded as failed without retries, except a
    ``KareusError`` (a configuration error, e.g. no usable process group): it stops the search at
    once, since every candidate would fail the same way.
    """


class _Crash(Exception):
    pass


class Profiler:
    """Measures candidates on one backend; one instance per worker (it owns the GPU's clock)."""

    def __init__(self, cfg: ProfilerConfig, backend: HardwareBackend, journal: Journal | None = None,
                 emit: Callable[[Any], None] | None = None, *, frequency: Any = None, cooldown: Any = None,
                 device_id: str = "") -> None:
        """``device_id`` names the GPU whose thermal state a learning cooldown keeps in the journal
        (default: the backend's ``device_id``, else its name); searches that share it share the state."""
        self.cfg = cfg
        self.backend = backend
        self.journal = journal
        self.emit = emit or (lambda event: None)
        if frequency is None:
            fsec = section(cfg.frequency)
            frequency = FREQUENCY_CONTROLLERS.build(fsec["name"], backend, config=fsec)
        if cooldown is None:
            csec = section(cfg.cooldown)
            cooldown = COOLDOWNS.build(csec["name"], config=csec)
        self.frequency = frequency
        self.cooldown = cooldown
        # (candidate key, reading) -> (measurement, GPU-seconds): reading 0 the first, k the k-th re-measurement
        self._known: dict[tuple[tuple[str, str, int, int], int], tuple[Measurement, float]] = (
            journal.load_readings() if journal else {})
        self._charged: set[tuple[tuple[str, str, int, int], int]] = set()  # readings charged to their partition
        self._spent: dict[str, float] = {}
        self._costs: dict[tuple, float] = {}
        self._index: dict[str, int] = {}
        self.measured = 0  # candidates actually measured by this instance (not answered from the journal)
        self._now: dict[str, tuple[int, float]] = {}  # per partition: (candidates, GPU-seconds) measured now
        self._anchor_state_loaded = False
        device = device_id or getattr(backend, "device_id", "") or backend.name
        self._thermal_key = f"thermal:{device}:{type(cooldown).__name__}"

    # -- the searcher's view ---------------------------------------------------------------------
    def evaluator(self, partition: PartitionType) -> Evaluate:
        """``evaluate(batch, annotations)`` for a searcher working on ``partition``."""

        def evaluate(batch: Sequence[Candidate], annotations: Sequence[dict[str, Any]] | None = None) -> list[Measurement]:
            out = []
            for i, cand in enumerate(batch):
                ann = annotations[i] if annotations is not None and i < len(annotations) else None
                out.append(self.measure(partition, cand, ann))
            return out

        return evaluate

    def gpu_seconds(self, partition: str) -> float:
        """Profiling GPU-time charged to ``partition`` so far (journaled costs included)."""
        return self._spent.get(partition, 0.0)

    def measured_now(self, partition: str) -> tuple[int, float]:
        """(candidates, GPU-seconds) of ``partition`` this profiler measured itself, not from the journal."""
        return self._now.get(partition, (0, 0.0))

    def costs(self) -> dict[tuple, float]:
        """GPU-seconds of each distinct candidate (partition or residual ops) this profiler measured or
        answered from the journal, keyed by ``Candidate.key``: what a resumed run still accounts for."""
        return dict(self._costs)

    def measure(self, partition: PartitionType, cand: Candidate, annotation: dict[str, Any] | None = None) -> Measurement:
        """The candidate's measurement: from the journal if known, else profiled and journaled now.
        ``annotation["reading"] = k`` (k >= 1) asks for its k-th re-measurement instead: a reading of
        its own, journaled apart (a resumed run is answered with that row)."""
        reading = int((annotation or {}).get("reading", 0))
        hit = self._cached(cand, reading)
        cached = hit is not None
        if hit is not None:
            m, cost = hit
        else:
            start = self.backend.now()
            m = self._profile(partition, cand)
            cost = self.backend.now() - start
            if reading:
                m = replace(m, flags=m.flags + (f"{REREAD}{reading}",))
        # a Ctrl-C or SIGTERM waits until the measurement is journaled *and* reported, or the run's
        # MLflow record would stop one candidate short of the journal
        with signals_deferred():
            if hit is None:
                self._record(m, cost, reading)
                self.measured += 1
                n, spent = self._now.get(cand.partition, (0, 0.0))
                self._now[cand.partition] = (n + 1, spent + cost)
            if (cand.key, reading) not in self._charged:  # asked again: answered from the journal without charge
                self._charged.add((cand.key, reading))
                self._spent[cand.partition] = self._spent.get(cand.partition, 0.0) + cost
                self._costs[cand.key] = self._costs.get(cand.key, 0.0) + cost
            index = self._index.get(cand.partition, 0)
            self._index[cand.partition] = index + 1
            ann = annotation or {}
            self.emit(CandidateMeasured(
                partition=cand.partition, index=index, measurement=m, predicted=ann.get("predicted"),
                pass_name=ann.get("pass"), gpu_seconds=self._spent[cand.partition], cached=cached))
        return m

    def remeasure(self, partition: PartitionType, cand: Candidate,
                  annotation: dict[str, Any] | None = None) -> Measurement:
        """A fresh measurement of ``cand`` though it is known (a drift check reading a setting again):
        profiled, charged and journaled as one more row; later asks are answered with the newest."""
        self._known.pop((cand.key, 0), None)
        self._charged.discard((cand.key, 0))
        self._costs.pop(cand.key, None)
        return self.measure(partition, cand, annotation)

    def profile_ops(self, ops: Sequence[Op], freq_mhz: int) -> Measurement:
        """Time and energy of a plain op sequence (residual, non-partition work) at ``freq_mhz``.

        Journaled under a pseudo-candidate ``ops:<digest>`` so a resumed run does not re-measure it.
        """
        digest = hashlib.sha1(repr(tuple(ops)).encode()).hexdigest()[:16]
        cand = Candidate(f"ops:{digest}", SEQUENTIAL, 0, int(freq_mhz))
        hit = self._cached(cand)
        if hit is not None:
            self._costs.setdefault(cand.key, hit[1])
            return hit[0]
        start = self.backend.now()
        self.cooldown.cool(self.backend)
        try:
            self._lock(cand.freq_mhz)
            # a correcting cooldown policy fits (or loads) its thermal model and anchors here as before
            # a partition's window: it waits for no heat to leave, so uncorrected back-to-back residual
            # windows would carry it all
            self._thermal_probe(lambda mhz, w: self.backend.measure_ops(ops, w), cand.freq_mhz)
            self._anchor(cand)
            m = self._windows(cand, lambda w: self.backend.measure_ops(ops, w), self.cfg.target_window_s)
        except _Crash as e:
            m = Measurement.failure(cand, str(e))
        cost = self.backend.now() - start
        self._record(m, cost)
        self._costs.setdefault(cand.key, cost)
        return m

    def _cached(self, cand: Candidate, reading: int = 0) -> tuple[Measurement, float] | None:
        """The journal's measurement of ``cand`` (its ``reading``: 0 the first, k the k-th re-measurement)
        if every rank of the group has it, else None.

        Each rank of a tensor-parallel group keeps its own journal; after a crash they can differ by
        the last candidates. A rank that answered from its journal while a peer measured would leave
        the peer waiting in collectives, so the group measures again unless all ranks hold it.
        """
        hit = self._known.get((cand.key, reading))
        return hit if group_all(self.backend, hit is not None) else None

    def close(self) -> None:
        """Give the clocks back (the frequency controller resets them)."""
        self.__exit__(None, None, None)

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.frequency.__exit__(*exc)  # it knows whether an error is already on its way out

    # -- the protocol ----------------------------------------------------------------------------
    def _together(self, step: Callable[[], Any], what: str) -> Any:
        """``step()`` on this rank, its outcome agreed with the group's ranks before any goes on.

        A step that failed on one rank alone (a clock lock refused, an error the backend raises before
        its first collective) would leave that rank recording a failure while its peers issue the
        candidate's collectives: the group would hang or abort. So the worst outcome holds on every
        rank: a configuration error (``KareusError``) stops the search everywhere, a crash fails the
        candidate everywhere. A rank that fails while its peers wait inside a collective of the step
        cannot be rescued here: the comm library's timeout ends the group, and a resume continues.
        """
        out, err, level = None, None, 0
        try:
            out = step()
        except KareusError as e:
            err, level = e, 2
        except Exception as e:
            err, level = e, 1
        worst = group_max(self.backend, float(level))
        if worst >= 2:
            raise err if isinstance(err, KareusError) else KareusError(
                f"profiler: another rank of the group stopped on a configuration error ({what}); its log says why")
        if worst >= 1:
            why = f"{type(err).__name__}: {err}" if err is not None else "another rank of the group failed here"
            raise _Crash(f"{what}: {why}") from err
        return out

    def _lock(self, mhz: int) -> None:
        self._together(lambda: self.frequency.set(int(mhz)), "clock")
        if self.cfg.settle_s > 0:
            self.backend.idle(self.cfg.settle_s)

    def _profile(self, partition: PartitionType, cand: Candidate) -> Measurement:
        cfg, backend = self.cfg, self.backend
        self.cooldown.cool(backend)
        try:
            self._lock(cand.freq_mhz)

            def calibrate() -> list[float]:
                for _ in range(cfg.warmup_runs):
                    backend.run_once(partition, cand)
                return [float(backend.run_once(partition, cand)) for _ in range(cfg.calibration_runs)]

            times = self._together(calibrate, "crash")
            per = median(times)
            if not math.isfinite(per) or per <= 0:
                return Measurement.failure(cand, f"calibration: execution time {per!r}")
            self._thermal_probe(lambda mhz, w: backend.measure(partition, replace(cand, freq_mhz=mhz), w),
                                cand.freq_mhz)
            self._anchor(cand)
            n = min(max(1, math.ceil(cfg.target_window_s / per)), cfg.max_executions)
            window = max(n * per, cfg.min_window_s)
            return self._windows(cand, lambda w: backend.measure(partition, cand, w), window)
        except _Crash as e:
            return Measurement.failure(cand, str(e))

    def _thermal_probe(self, measure_at: Callable[[int, float], Reading], clock: int) -> None:
        """Let a compensating cooldown policy fit its thermal model once (on the first measurement),
        running ``measure_at(mhz, window_s)`` (the work about to be measured: a GPU's leakage slope does
        not depend on it); the clock is locked at ``clock`` again afterwards."""
        probe = getattr(self.cooldown, "calibrate", None)
        if probe is None or getattr(self.cooldown, "calibrated", True):
            return
        key = self._thermal_key
        saved = self.journal.get_meta(key) if self.journal is not None else None
        # probed earlier in the run (or before a resume) on every GPU of the group: else all probe again
        if group_all(self.backend, saved is not None):
            self.cooldown.load_state(json.loads(saved))
            return

        def read_at(mhz: int, window_s: float) -> Reading:
            self._together(lambda: self.frequency.set(int(mhz)), "clock")
            return measure_at(int(mhz), window_s)

        try:
            probe(self.backend, read_at)
        finally:
            self._lock(clock)
        if self.journal is not None:
            self.journal.set_meta(key, json.dumps(self.cooldown.state()))

    def _anchor(self, cand: Candidate) -> None:
        """Let a cooldown policy that learns in the stream run its anchor windows before this window.

        ``before_window(backend, read_ops_at, mhz)`` returns how many it ran; the candidate's clock is
        then locked again (with the settle time). Its state is kept in the journal after each change.
        """
        hook = getattr(self.cooldown, "before_window", None)
        if hook is None:
            return
        key = self._thermal_key
        if self.journal is not None and not self._anchor_state_loaded:
            self._anchor_state_loaded = True
            saved = self.journal.get_meta(key)
            if saved is not None:  # anchors taken before a resume (or by an earlier search on this GPU)
                self.cooldown.load_state(json.loads(saved))

        def read_ops_at(mhz: int, ops: Sequence[Op], window_s: float) -> Reading:
            self._together(lambda: self.frequency.set(int(mhz)), "clock")  # a lock one rank missed skips it on all
            return self.backend.measure_ops(ops, window_s)

        taken = 0
        try:
            taken = hook(self.backend, read_ops_at, int(cand.freq_mhz))
        finally:  # locked again on every rank or on none (the lock is a group step); the controller's own
            # record too, since a lock that failed partway leaves some devices at the anchor's clock
            mhz = int(cand.freq_mhz)
            if not group_all(self.backend, not taken and self.backend.clock() == mhz and self.frequency.locked == mhz):
                self._lock(cand.freq_mhz)
        if taken and self.journal is not None:
            self.journal.set_meta(key, json.dumps(self.cooldown.state()))

    def _windows(self, cand: Candidate, read: Callable[[float], Reading], window: float) -> Measurement:
        cfg = self.cfg
        good: list[Reading] = []
        seen: list[Reading] = []
        excess: list[float] = []
        retried = 0
        correct = getattr(self.cooldown, "excess_energy", None)
        observe = getattr(self.cooldown, "observe", None)
        for r in range(cfg.repeats):
            if r > 0 and cfg.cooldown_between_repeats:
                self.cooldown.cool(self.backend)
            reading, tries, start_c = self._read(read, window, seen)
            retried += tries - 1
            if reading is None:
                why = seen[-1].error if seen and seen[-1].error else "invalid reading"
                return Measurement.failure(cand, f"read failed after {cfg.retries + 1} tries: {why}", tuple(seen))
            good.append(reading)
            if observe is not None:
                observe(reading, start_c, self.backend.temperature(), self.backend.idle_temperature())
            # each GPU's extra heat, recorded as the group's mean (the reading's energy is the group's mean)
            excess.append(group_mean(self.backend, correct(reading, start_c, self.backend.idle_temperature()))
                          if correct else 0.0)
        return self._aggregate(cand, good, retried, excess)

    def _read(self, read: Callable[[float], Reading], window: float,
              seen: list[Reading]) -> tuple[Reading | None, int, float]:
        """One window, retried up to ``retries`` times; a window too short is lengthened on retry.
        Returns the reading, the tries it took and the GPU's temperature when its window started: a
        failed window that ran heated the GPU, and the heat correction must start from there."""
        start_c = math.nan
        for attempt in range(self.cfg.retries + 1):
            start_c = self.backend.temperature()
            try:
                reading = read(window)
            except ReadError as e:
                seen.append(Reading(math.nan, math.nan, math.nan, math.nan, window, 0, False, f"read error: {e}"))
                continue
            except KareusError:
                raise
            except Exception as e:
                raise _Crash(f"crash: {type(e).__name__}: {e}") from e
            problem = self._invalid(reading)
            if problem is None:
                return reading, attempt + 1, start_c
            if reading.ok:
                reading = Reading(reading.time_s, reading.energy_j, reading.temperature_c, reading.freq_mhz,
                                  reading.window_s, reading.executions, False, problem)
            seen.append(reading)
            if "window" in problem:
                window = max(window, self.cfg.min_window_s) * 2
        return None, self.cfg.retries + 1, start_c

    def _invalid(self, r: Reading) -> str | None:
        if not r.ok:
            return r.error or "backend reported a failed read"
        if not (math.isfinite(r.time_s) and r.time_s > 0):
            return f"bad time {r.time_s!r}"
        if not (math.isfinite(r.energy_j) and r.energy_j > 0):
            return f"bad energy {r.energy_j!r} (counter wrap or reset?)"
        if r.window_s < self.cfg.min_window_s * (1 - 1e-9):
            return f"window {r.window_s:.3g}s shorter than the counter needs ({self.cfg.min_window_s}s)"
        return None

    def _aggregate(self, cand: Candidate, readings: list[Reading], retried: int,
                   excess: list[float] | None = None) -> Measurement:
        """Mean of the repeats that are not MAD outliers; ``excess`` is residual-heat energy to remove."""
        thr = self.cfg.mad_threshold
        excess = excess or [0.0] * len(readings)
        energies = [r.energy_j - x for r, x in zip(readings, excess)]
        t_out = mad_outliers([r.time_s for r in readings], thr)
        e_out = mad_outliers(energies, thr)
        out = [a or b for a, b in zip(t_out, e_out)]
        keep = [i for i, o in enumerate(out) if not o] or list(range(len(readings)))
        kept = [readings[i] for i in keep]
        flags = [f"outlier:{i}" for i, o in enumerate(out) if o]
        if retried:
            flags.append(f"retried:{retried}")
        k = len(kept)
        t = sum(r.time_s for r in kept) / k
        e = sum(energies[i] for i in keep) / k
        raw = sum(r.energy_j for r in kept) / k
        if e != raw:
            flags.append(f"thermal:{(e / raw - 1) * 100:+.3f}%")
        static = float(self.backend.gpu.static_power_w)
        return Measurement(
            candidate=cand, time_s=t, energy_j=e, dynamic_energy_j=e - static * t, static_power_w=static,
            temperature_c=sum(r.temperature_c for r in kept) / k, freq_mhz=sum(r.freq_mhz for r in kept) / k,
            repeats=k, failed=False, flags=tuple(flags), readings=tuple(readings))

    def _record(self, m: Measurement, cost: float, reading: int = 0) -> None:
        self._known[(m.candidate.key, reading)] = (m, cost)
        if self.journal is None:
            return
        try:
            temp: float | None = float(self.backend.temperature())
        except Exception:
            temp = None
        clock = getattr(self.frequency, "locked", None)
        # a controller that holds no clock failed to set this candidate's (a failed candidate), or locks
        # GPUs and failed: the clock is unknown, and the backend's would be the previous candidate's
        if clock is None and not m.failed and not getattr(self.frequency, "locks_gpu", False):
            try:
                clock = int(self.backend.clock())
            except Exception:
                clock = None
        self.journal.append(m, backend=self.backend.name, clock_mhz=clock, gpu_temperature_c=temp, gpu_seconds=cost)
