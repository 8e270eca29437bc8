"""Launchers: run independent partition searches in process, on a process pool, or on Ray.

``LAUNCHERS.build(name, config=section).run(tasks) -> results`` (in task order). Every launcher runs
:func:`run_search_task`, so a seeded simulated run gives the same frontiers whichever runs it.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from kareus.config.bounds import out_of_bounds
from kareus.errors import KareusError
from kareus.launch.task import PartitionSearchTask, gpus_needed, is_real_gpu, run_search_task
from kareus.registry import LAUNCHERS
from kareus.search.base import SearchResult

Listener = Callable[[Any], None]


def _run_forwarding(task: PartitionSearchTask, queue: Any) -> Any:
    """Worker side: run the task and forward every event to the driver through ``queue``."""
    return run_search_task(task, listeners=[queue.put])


def _dispatch(queue: Any, listeners: Sequence[Listener], empty: type[BaseException], timeout: float) -> bool:
    """Driver side: hand one queued event to the driver's listeners; False when none came in ``timeout``."""
    try:
        event = queue.get(timeout=timeout) if timeout > 0 else queue.get_nowait()
    except empty:
        return False
    for listener in listeners:
        listener(event)
    return True


@dataclass
class LocalLauncherConfig:
    name: str = "local"


@LAUNCHERS.register("local", LocalLauncherConfig)
class LocalLauncher:
    """One search after another in this process (the default; no parallelism)."""

    def __init__(self, cfg: LocalLauncherConfig) -> None:
        self.cfg = cfg

    def check(self, tasks: Sequence[PartitionSearchTask]) -> None:
        """Nothing to check: this process runs every task."""

    def run(self, tasks: Sequence[PartitionSearchTask], listeners: Sequence[Listener] = ()) -> list[SearchResult]:
        return [run_search_task(t, listeners) for t in tasks]


@dataclass
class ProcessLauncherConfig:
    name: str = "process"
    workers: int = 0  # 0: one per task, at most the CPU count
    start_method: str = "spawn"  # spawn: no inherited threads or GPU handles

    def problems(self, ctx: Any = None) -> list[str]:
        out = out_of_bounds(self, nonnegative=("workers",))
        if self.start_method not in ("spawn", "forkserver", "fork"):
            out.append(f"start_method: invalid value {self.start_method!r}; allowed: spawn, forkserver, fork")
        if getattr(ctx, "real_gpu", False):
            # a worker would open this rank's GPU (its clock, its energy counter) and process group
            # beside the run's own backend and the other workers
            out.append("launcher: process runs partition searches in worker processes that would share this "
                       "rank's GPU and process group; with a real GPU use launcher=local")
        return out


class WorkerLost(KareusError):
    """A worker process (or Ray worker or node) running a partition search died: killed, out of
    memory, a lost node. What it measured is in the journal; the run can be resumed."""


@LAUNCHERS.register("process", ProcessLauncherConfig)
class ProcessLauncher:
    """A pool of worker processes on this machine; each task builds (and owns) its backend."""

    def __init__(self, cfg: ProcessLauncherConfig) -> None:
        self.cfg = cfg

    def check(self, tasks: Sequence[PartitionSearchTask]) -> None:
        """Nothing to check: any machine can start worker processes."""

    def run(self, tasks: Sequence[PartitionSearchTask], listeners: Sequence[Listener] = ()) -> list[SearchResult]:
        """Workers forward their events to ``listeners`` here, through a queue."""
        import multiprocessing as mp
        import queue as queue_mod
        from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

        if not tasks:
            return []
        n = self.cfg.workers or min(len(tasks), os.cpu_count() or 1)
        ctx = mp.get_context(self.cfg.start_method)
        pool = ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_worker_start, initargs=(os.getpid(),))
        try:
            if not listeners:
                futures = [pool.submit(run_search_task, t) for t in tasks]
                wait(futures, return_when=FIRST_EXCEPTION)  # a failed task stops the others, whichever it is
                _raise_first_failure(futures)
                return [f.result() for f in futures]
            from multiprocessing.managers import SyncManager

            manager = SyncManager(ctx=ctx)
            manager.start(_worker_start, (os.getpid(),))
            try:
                q = manager.Queue()
                futures = [pool.submit(_run_forwarding, t, q) for t in tasks]
                while not all(f.done() for f in futures):
                    _dispatch(q, listeners, queue_mod.Empty, 0.1)
                    _raise_first_failure(futures)
                while _dispatch(q, listeners, queue_mod.Empty, 0.0):
                    pass
                return [f.result() for f in futures]
            except BaseException:  # the workers go before the relay: an idle one taking a queued task would
                _terminate_workers(pool)  # dial the stopped relay and print that traceback
                raise
            finally:
                _stop_manager(manager)
        except BaseException as err:  # Ctrl-C, SIGTERM, a failed task: stop the others now, not after they finish
            _terminate_workers(pool)
            from concurrent.futures.process import BrokenProcessPool

            if isinstance(err, BrokenProcessPool):
                raise WorkerLost("launcher: a partition-search worker process died (killed, or out of memory?)") \
                    from None
            if isinstance(err, (EOFError, ConnectionError)):  # the manager process relaying the events
                raise WorkerLost("launcher: the process relaying the workers' events died (killed?)") from None
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def _python_signal_handlers_kept() -> Iterator[None]:
    """Put SIGTERM's and SIGINT's handlers back after the block: ``ray.init`` installs Ray's crash
    handler over them, which aborts (exit 134) where Kareus' own exits 143 with the resume line."""
    import signal

    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except SystemExit as err:  # a SIGTERM that Ray's Python handler, installed inside the block, took
        handler = kept[signal.SIGTERM]
        if err.code == signal.SIGTERM and callable(handler):
            handler(signal.SIGTERM, None)  # Kareus' own stop: exit 143 with the resume line
        raise
    finally:
        for signum, handler in kept.items():
            if handler is not None:  # None: a handler set outside Python, which Python cannot put back
                signal.signal(signum, handler)


def _raise_first_failure(futures: Sequence[Any]) -> None:
    """Raise the error of a task that failed, while the others still run: waiting for them all spent
    their GPU time on a run that fails anyway."""
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()


def _stop_manager(manager: Any) -> None:
    """Shut the process relaying the workers' events down with Ctrl-C and SIGTERM held, and kill it if
    it outlives that: a second Ctrl-C (``timeout -s INT`` signals the group twice) inside the shutdown
    handshake left it running, and the exit then waited on it for good."""
    from kareus.interrupts import signals_deferred

    with signals_deferred():
        try:
            manager.shutdown()
        finally:
            proc = getattr(manager, "_process", None)
            if proc is not None and proc.is_alive():
                proc.kill()


def _worker_start(main_pid: int) -> None:
    """Initializer of the workers and of the process relaying their events."""
    import signal

    # a forked worker inherits the CLI's SIGTERM handler, and each stopped worker then printed the run's
    # resume line itself; spawned ones start with the default, which a clock controller replaces as needed
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _leave_ctrl_c_to_the_parent()
    _die_with_the_parent(main_pid)


def _die_with_the_parent(main_pid: int) -> None:
    """SIGTERM this process when its parent dies (Linux): a main process killed outright (the OOM
    killer, a scheduler that signals the main process alone) left its workers measuring into the
    stopped run's journal, which a resume copies while it still grows. Under forkserver the parent is
    the fork server, which itself ends when the main process does."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: the worker outlives a killed parent, as before
        return
    if os.getppid() != parent or not _alive(main_pid):  # it died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leave_ctrl_c_to_the_parent() -> None:
    """A terminal's Ctrl-C reaches every process of the group: workers ignore it (no traceback from
    each) and the parent, which owns the run, stops them."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _terminate_workers(pool: Any) -> None:
    """SIGTERM each worker (a real GPU's clock controller resets its lock on it); the executor keeps
    its processes in ``_processes``, the one handle concurrent.futures gives to them."""
    for proc in list(getattr(pool, "_processes", {}).values()):
        if proc.is_alive():
            proc.terminate()


@dataclass
class RayLauncherConfig:
    name: str = "ray"
    address: Optional[str] = None  # a running cluster ("auto", "ray://HEAD:10001"); None: embedded Ray here
    num_cpus: Optional[int] = None  # resources of an embedded Ray (None: Ray detects them)
    num_gpus: Optional[int] = None
    gpus_per_task: Optional[float] = None  # None: the TP group on real GPUs, 0 on sim/replay
    cpus_per_task: float = 1.0
    shutdown: bool = True  # shut an embedded Ray down after the run
    max_retries: int = 3  # several nodes: how often a search that lost its worker or node is placed again
    local_dir: Optional[str] = None  # several nodes: each node's folder for its searches' own journals
    # (None: the node's temp folder; a folder that survives a reboot keeps unacknowledged rows through one)

    def problems(self, ctx: Any = None) -> list[str]:
        return out_of_bounds(self, nonnegative=("gpus_per_task", "cpus_per_task", "num_cpus", "num_gpus",
                                                "max_retries"))


def _broken_amdsmi_shim() -> str | None:
    """A folder that shadows a broken ``amdsmi`` for Ray's processes, or None when it is fine.

    Ray probes for AMD GPUs through ``amdsmi`` in the driver and in its own agent processes. Zeus (the
    runtime extra) depends on amdsmi, whose wheel fails on import with a KeyError when the ROCm
    library is absent (every NVIDIA-only machine), and that takes Ray down. Shadowing it with a module
    that raises ImportError makes Ray skip AMD detection as it does when amdsmi is not installed.
    """
    import sys
    import tempfile

    if "amdsmi" in sys.modules and sys.modules["amdsmi"] is None and _SHIM:
        return _SHIM[0]  # hidden already
    try:
        import amdsmi  # noqa: F401
        return None
    except ImportError:
        return None
    except Exception:
        sys.modules["amdsmi"] = None  # type: ignore[assignment]  (this process: import raises ImportError)
    shim = Path(tempfile.gettempdir()) / "kareus-amdsmi-shim"
    (shim / "amdsmi").mkdir(parents=True, exist_ok=True)
    (shim / "amdsmi" / "__init__.py").write_text(
        'raise ImportError("amdsmi is installed without its ROCm library; hidden from Ray by kareus")\n')
    _SHIM[:] = [str(shim)]
    return str(shim)


_SHIM: list[str] = []


@LAUNCHERS.register("ray", RayLauncherConfig)
class RayLauncher:
    """One Ray task per partition search, reserving the GPUs one measurement occupies.

    Ray is an optional extra (``pip install kareus[ray]``). On one node every search appends to the
    run's journal itself (SQLite in WAL mode, whose writers must share a host). On a cluster of several
    nodes, or one reached through ``ray://``, each search is placed where its group fits and relays
    every row to the driver, the journal's one writer (:mod:`kareus.launch.cluster`).
    """

    def __init__(self, cfg: RayLauncherConfig) -> None:
        self.cfg = cfg
        self._ray: Any = None
        self._started = False  # this launcher started an embedded Ray (shut down after the run)
        self._relayed = False  # several nodes (or ray://): searches relay their rows to the driver
        self.cluster: Any = None  # the ClusterRun of a relayed run (its placements, per-node summary)

    def _gpus(self, task: PartitionSearchTask) -> float:
        return float(self.cfg.gpus_per_task) if self.cfg.gpus_per_task is not None else float(gpus_needed(task))

    def _need(self, task: PartitionSearchTask) -> tuple[int, float, float]:
        """(ranks, GPUs, CPUs) one search's group holds on one node: a rank per GPU of the comm group
        on real GPUs, one rank on sim/replay."""
        ranks = gpus_needed(task) if is_real_gpu(task.hardware) else 1
        return ranks, self._gpus(task), float(self.cfg.cpus_per_task)

    def summary(self) -> dict[str, Any]:
        """What the run's summary.json adds: per node, its searches, measurements and GPU-hours (several
        nodes only)."""
        return dict(self.cluster.summary) if self.cluster is not None else {}

    def check(self, tasks: Sequence[PartitionSearchTask]) -> None:
        """Start (or join) Ray and refuse a cluster that cannot run ``tasks``: called before the run is
        recorded anywhere, so a refusal writes nothing."""
        if not tasks:
            return
        ray = self._init()
        try:
            nodes = [node for node in ray.nodes() if node.get("Alive")]
            self._relayed = len(nodes) > 1 or str(self.cfg.address or "").startswith("ray://")
            if self._relayed:
                self._check_fit(tasks, nodes)
                return
            have = ray.cluster_resources()
            need = max(self._gpus(t) for t in tasks)
            if need > float(have.get("GPU", 0.0)):
                raise KareusError(f"launcher: a partition search needs {need:g} GPU(s) but the Ray cluster has "
                                  f"{float(have.get('GPU', 0.0)):g}; set launcher.gpus_per_task or add GPU nodes")
            if self.cfg.cpus_per_task > float(have.get("CPU", 0.0)):  # no task could ever be scheduled: a hang
                raise KareusError(f"launcher.cpus_per_task: {self.cfg.cpus_per_task:g} CPUs per search, but the Ray "
                                  f"cluster has {float(have.get('CPU', 0.0)):g}; allowed: up to that (or raise "
                                  f"launcher.num_cpus)")
        except BaseException:
            self._shutdown()
            raise

    def _check_fit(self, tasks: Sequence[PartitionSearchTask], nodes: Sequence[dict]) -> None:
        """Refuse a cluster with a search whose group no node holds (the largest first): it would wait forever."""
        from kareus.launch.cluster import fits, group_words, largest

        for need in sorted({self._need(t) for t in tasks}, key=lambda n: (-n[1], -n[2], -n[0])):
            if any(fits(node, need) for node in nodes):
                continue
            gpus, cpus = largest(nodes)
            raise KareusError(f"launcher: a partition search needs {group_words(need)}, but the largest node of the "
                              f"Ray cluster has {gpus:g} GPU(s) and {cpus:g} CPU(s); add a node that fits, or lower "
                              f"launcher.cpus_per_task or launcher.gpus_per_task")

    def _init(self) -> Any:
        """Ray, initialised: an embedded one (or ``launcher.address``'s cluster) started here if needed."""
        if self._ray is not None:
            return self._ray
        shim = _broken_amdsmi_shim()
        try:
            import ray
        except ImportError:  # pragma: no cover - depends on the environment
            raise KareusError("launcher: launcher=ray needs Ray: pip install 'kareus[ray]'") from None
        if not ray.is_initialized():
            root = str(Path(__file__).resolve().parents[2])
            old = os.environ.get("PYTHONPATH")
            path = os.pathsep.join(p for p in (shim, root, old) if p)
            env = {"env_vars": {"PYTHONPATH": path}}
            os.environ["PYTHONPATH"] = path  # Ray's own processes (raylet agents) inherit it
            self._started = True  # from here on: shut down on the way out, whatever init left running
            try:
                with _python_signal_handlers_kept():
                    if self.cfg.address:
                        ray.init(address=self.cfg.address, runtime_env=env, log_to_driver=False)
                    else:
                        ray.init(num_cpus=self.cfg.num_cpus, num_gpus=self.cfg.num_gpus, include_dashboard=False,
                                 runtime_env=env, log_to_driver=False)
            except ConnectionError as err:  # no cluster at that address
                self._ray = ray
                self._shutdown()
                raise KareusError(f"launcher.address: {self.cfg.address}: {str(err).splitlines()[0]}; start the "
                                  f"cluster (ray start --head), or leave launcher.address unset for an embedded "
                                  f"Ray") from None
            except BaseException:
                self._ray = ray
                self._shutdown()
                raise
            finally:
                if old is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = old
        self._ray = ray
        return ray

    def _shutdown(self) -> None:
        if self._ray is not None and self._started and self.cfg.shutdown:
            with _python_signal_handlers_kept():  # its shutdown resets them to the default too
                self._ray.shutdown()
        self._ray, self._started = None, False

    def run(self, tasks: Sequence[PartitionSearchTask], listeners: Sequence[Listener] = ()) -> list[SearchResult]:
        """Ray tasks forward their events to ``listeners`` here through a Ray queue."""
        if not tasks:
            return []
        self.check(tasks)
        ray = self._ray
        try:
            if self._relayed:
                from kareus.launch.cluster import ClusterRun

                self.cluster = ClusterRun(ray, self.cfg, self._need, listeners)
                return self.cluster.run(tasks)
            opts = lambda t: {"num_gpus": self._gpus(t), "num_cpus": self.cfg.cpus_per_task,  # noqa: E731
                              "max_retries": 0}
            lost = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError,
                    ray.exceptions.LocalRayletDiedError)
            try:
                return self._run_on_ray(ray, tasks, listeners, opts)
            except lost as err:
                raise WorkerLost(f"launcher: a partition search's Ray worker died ({type(err).__name__})") from None
        finally:
            self._shutdown()

    @staticmethod
    def _run_on_ray(ray: Any, tasks: Sequence[PartitionSearchTask], listeners: Sequence[Listener],
                    opts: Callable[[PartitionSearchTask], dict]) -> list[SearchResult]:
        q = None
        if listeners:
            from ray.util.queue import Empty, Queue

            q = Queue(actor_options={"num_cpus": 0})
            remote = ray.remote(_run_forwarding)
            refs = [remote.options(**opts(t)).remote(t, q) for t in tasks]
        else:
            remote = ray.remote(run_search_task)
            refs = [remote.options(**opts(t)).remote(t) for t in tasks]
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0 if q is not None else 0.1)
                for ref in done:  # a failed task stops the others, as with launcher=process
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayTaskError as err:
                        cause = getattr(err, "cause", None)
                        raise (cause if isinstance(cause, BaseException) else err) from None
                if pending and q is not None:
                    _dispatch(q, listeners, Empty, 0.1)
        except BaseException:  # a failure, Ctrl-C or SIGTERM: the others stop now, on any cluster
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        if q is not None:
            while _dispatch(q, listeners, Empty, 0.0):
                pass
            q.shutdown()
        return list(ray.get(refs))
