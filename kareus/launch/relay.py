"""Partition searches on the nodes of a Ray cluster, every measurement relayed to the run's journal.

SQLite keeps a journal whole only for writers on one host, so on a cluster of several nodes the run's
journal has one writer: the driver. A remote search records each measurement in a journal of its own
on its node (node-local, SQLite like the run's) and then hands the row to the run's :class:`Mailbox`
actor, waiting until the driver has appended it (WAL, ``synchronous=FULL``) or found its candidate
there already. Delivery is at least once, deduplicated by candidate key (a search's deliberate
re-measurement of a candidate, ``reading:<k>``, is a row of its own):

- a row is acknowledged only once it is committed in the run's journal; the search goes on after that;
- a node-local journal is deleted only when every row in it is acknowledged; one left behind by a
  search whose worker or node died (its lock released) is sent again by the next search of the run
  that starts on that node (the task or the node returning), and by a sweep of every live node at the
  end of a run that lost a search or resumed one;
- the driver appends a row only if its candidate has none yet, so a row sent twice is kept once; rows
  of a partition whose search runs on another node wait in their node-local journal until it ends, so
  a search never measures a candidate whose row the run's journal then takes from elsewhere.

A retried search starts from the run's rows of its partition (the journal's resume logic answers
them) after its node re-sent what it had left, so it measures again only what never reached the run.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import sqlite3
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from kareus.launch.task import PartitionSearchTask, run_search_task
from kareus.profiler.journal import Journal, JournalError, reread, row_reading
from kareus.search.base import SearchResult

RELAY_DIR = "kareus-relay"  # under the node's temp folder, unless launcher.local_dir names another
LINEAGE_KEY = "relay_lineage"  # journal meta: names a run's node-local folders; a resume copies it
APPENDED, DUPLICATE, KEEP = "appended", "duplicate", "keep"  # what the driver did with one relayed row
_DEFER = object()  # an answer given later (a rank's seed, once rank 0 has re-sent what its node held)


class RelayError(RuntimeError):
    """The driver refused a relayed message: the search was given up (retried elsewhere) meanwhile."""


@dataclass(frozen=True)
class RelaySpec:
    """What one attempt of a remote search needs to reach the run's journal."""

    mailbox: Any  # the run's Mailbox actor handle
    run_key: str  # names the run's node-local folder (config hash and the journal's lineage)
    partition: str
    attempt: int
    rank: int = 0
    local_dir: str | None = None  # None: <the node's temp folder>/kareus-relay


# -- the mailbox: an actor between remote searches and the driver -------------------------------------
class Mailbox:
    """Messages from remote searches wait here until the driver takes them; a message that needs an
    answer (a row appended, the run's rows) waits here until the driver gives it. An actor, so that
    a driver outside the cluster (``ray://``) is reached the same way."""

    def __init__(self) -> None:
        self._inbox: list[tuple[int, str, Any]] = []
        self._answers: dict[int, asyncio.Future] = {}
        self._arrived: asyncio.Event | None = None
        self._next = 0

    def _event(self) -> asyncio.Event:
        if self._arrived is None:  # made inside the actor's event loop
            self._arrived = asyncio.Event()
        return self._arrived

    def _put(self, kind: str, payload: Any) -> int:
        self._next += 1
        self._inbox.append((self._next, kind, payload))
        self._event().set()
        return self._next

    async def ask(self, kind: str, payload: Any) -> Any:
        """Leave a message and wait for the driver's answer."""
        future = asyncio.get_running_loop().create_future()
        self._answers[self._put(kind, payload)] = future
        return await future

    async def tell(self, kind: str, payload: Any) -> None:
        """Leave a message that needs no answer (an event)."""
        self._put(kind, payload)

    async def take(self, seen: int, wait_s: float) -> list[tuple[int, str, Any]]:
        """The driver's side: every message after token ``seen`` (those up to it are handled and
        dropped), after at most ``wait_s`` for the first. Asked again, it answers the same: a call
        retried after a lost reply loses nothing."""
        self._inbox = [m for m in self._inbox if m[0] > seen]
        if not self._inbox:
            self._event().clear()
            try:
                await asyncio.wait_for(self._event().wait(), timeout=wait_s)
            except asyncio.TimeoutError:
                pass
        return list(self._inbox)

    async def answer(self, answers: list[tuple[int, Any]]) -> None:
        for token, value in answers:
            future = self._answers.pop(token, None)
            if future is not None and not future.done():
                future.set_result(value)


# -- the driver's side ---------------------------------------------------------------------------------
@dataclass
class NodeShare:
    """What one node measured for the run: searches placed there, rows appended, their GPU-seconds."""

    searches: int = 0
    measured: int = 0
    gpu_seconds: float = 0.0


@dataclass
class RelayHub:
    """The driver's end of the relay: the only writer of the run's journal on a cluster of nodes."""

    ray: Any
    journal: Journal
    mailbox: Any
    current: dict[str, int] = field(default_factory=dict)  # partition -> its running attempt
    # partition -> (candidate key, reading) -> GPU-seconds, of the rows appended in this run
    fresh: dict[str, dict[tuple, float]] = field(default_factory=dict)
    nodes: dict[str, NodeShare] = field(default_factory=dict)
    placed: dict[str, str] = field(default_factory=dict)  # partition -> node id of its running attempt
    _seeds: dict[tuple[str, int], Any] = field(default_factory=dict)
    _waiting: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    _seen: int = 0  # the last message handled

    def serve(self, wait_s: float) -> list[tuple[str, int, Any]]:
        """Handle what arrived (appending rows, answering), after at most ``wait_s`` for the first
        message; the search events that came, as (partition, attempt, event)."""
        events, answers = [], []
        seen = self._seen
        for token, kind, payload in calling(self.ray, lambda: self.mailbox.take.remote(seen, wait_s)):
            self._seen = max(self._seen, token)
            if kind == "event":
                events.append(payload)
                continue
            value = self._handle(token, kind, payload)
            if value is not _DEFER:
                answers.append((token, value))
            answers += self._released(kind, payload)
        if answers:
            calling(self.ray, lambda: self.mailbox.answer.remote(answers))
        return events

    def _handle(self, token: int, kind: str, p: dict[str, Any]) -> Any:
        if kind == "rows":
            return self._rows(p)
        if kind == "meta":
            if self._live(p) or p.get("resend"):
                self.journal.set_meta(p["key"], p["value"])
            return ("ok", None)
        if kind == "seed":
            return self._seed(token, p)
        return ("error", f"unknown relay message {kind!r}")

    def _live(self, p: dict[str, Any]) -> bool:
        return p.get("partition") is not None and self.current.get(p["partition"]) == p.get("attempt")

    def _rows(self, p: dict[str, Any]) -> tuple[str, Any]:
        """Append what is new; a given-up attempt's rows are refused (they stay on its node)."""
        if not p.get("resend") and not self._live(p):
            return ("error", f"partition {p.get('partition')}'s search attempt {p.get('attempt')} was given up")
        out = []
        for row in p["rows"]:
            searching = self.current.get(row["partition"])
            if p.get("resend") and searching is not None and not (row["partition"] == p["partition"] and
                                                                  searching == p["attempt"]):
                out.append(KEEP)  # its search runs elsewhere: it may measure this candidate itself
                continue
            if self.journal.add_row(row):
                key = ((row["partition"], row["slot"], row["sms"], row["freq_mhz"]), row_reading(row["flags"]))
                self.fresh.setdefault(row["partition"], {})[key] = float(row["gpu_seconds"])
                share = self.nodes.setdefault(p["node"], NodeShare())
                share.measured += 1
                share.gpu_seconds += float(row["gpu_seconds"])
                out.append(APPENDED)
            else:
                out.append(DUPLICATE)
        return ("ok", out)

    def _seed(self, token: int, p: dict[str, Any]) -> Any:
        """The run's rows of the partition for its attempt: taken when rank 0 asks (after its node
        re-sent what it held), so every rank of the group starts from the same rows."""
        at = (p["partition"], p["attempt"])
        if not self._live(p):
            return ("error", f"partition {p['partition']}'s search attempt {p['attempt']} was given up")
        if p["rank"] == 0 and at not in self._seeds:
            self._seeds[at] = (self.journal.raw_rows(p["partition"]),
                               {k: v for k, v in self.journal.meta_items().items() if k != LINEAGE_KEY})
            self.placed[p["partition"]] = p.get("node_id", p["node"])
            self.nodes.setdefault(p["node"], NodeShare()).searches += 1
        if at not in self._seeds:
            self._waiting.setdefault(at, []).append(token)
            return _DEFER
        return ("ok", self._seeds[at])

    def _released(self, kind: str, p: dict[str, Any]) -> list[tuple[int, Any]]:
        """Answers held for ranks that asked before rank 0 did."""
        if kind != "seed":
            return []
        at = (p["partition"], p["attempt"])
        if at not in self._seeds or at not in self._waiting:
            return []
        return [(token, ("ok", self._seeds[at])) for token in self._waiting.pop(at)]

    def begin(self, partition: str, attempt: int) -> None:
        self.current[partition] = attempt

    def end(self, partition: str) -> None:
        """The partition's search finished or was given up: its later messages are stale."""
        self.current.pop(partition, None)
        self.placed.pop(partition, None)
        for at in [at for at in self._seeds if at[0] == partition]:
            self._seeds.pop(at)
            self._waiting.pop(at, None)

    def measured_now(self, result: SearchResult) -> tuple[int, float]:
        """(candidates, GPU-seconds) of ``result`` whose rows reached the run's journal in this run."""
        fresh = self.fresh.get(result.partition, {})
        keys = {(m.candidate.key, reread(m)) for m in result.measurements} & set(fresh)
        return len(keys), sum(fresh[k] for k in keys)

    def measured_here(self, partition: str, m: Any) -> bool:
        """Whether this run's relay appended ``m``'s row (a lost attempt measured it)."""
        return (m.candidate.key, reread(m)) in self.fresh.get(partition, {})


def run_key(journal: Journal) -> str:
    """Names the run's node-local folders: its config and its journal's lineage (kept by a resume,
    which copies the journal, so a resumed run collects what its predecessor's nodes still hold)."""
    lineage = journal.get_meta(LINEAGE_KEY)
    if lineage is None:
        lineage = uuid.uuid4().hex[:16]
        journal.set_meta(LINEAGE_KEY, lineage)
    return f"{journal.config_hash[:16]}-{lineage}"


# -- the node's side -----------------------------------------------------------------------------------
def node_folder(spec: RelaySpec) -> Path:
    root = Path(spec.local_dir) if spec.local_dir else Path(tempfile.gettempdir()) / RELAY_DIR
    folder = root / spec.run_key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


UNAVAILABLE_S = 30.0  # how long a call waits out the mailbox being unreachable (a reset connection)


def calling(ray: Any, call: Callable[[], Any], patience_s: float = UNAVAILABLE_S) -> Any:
    """``ray.get(call())``, made again while the actor is only unavailable: under load a connection
    can reset. A message sent twice is harmless (the driver keeps a row once, shows an event once)."""
    import time

    deadline = time.monotonic() + patience_s
    while True:
        try:
            return ray.get(call())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _asker(spec: RelaySpec) -> Callable[[str, dict[str, Any]], Any]:
    """``ask(kind, payload)``: a message to the driver, its answer or a RelayError."""
    import ray

    def ask(kind: str, payload: dict[str, Any]) -> Any:
        status, value = calling(ray, lambda: spec.mailbox.ask.remote(kind, payload))
        if status != "ok":
            raise RelayError(value)
        return value

    return ask


def _teller(spec: RelaySpec) -> Callable[[Any], None]:
    """Forwards each search event to the driver, in order (each call returns once it is queued)."""
    import ray

    def tell(event: Any) -> None:
        calling(ray, lambda: spec.mailbox.tell.remote("event", (spec.partition, spec.attempt, event)))

    return tell


class RelayedJournal(Journal):
    """A node-local journal whose every row and note is also delivered to the run's journal: an append
    returns once the driver has committed it (at least once: the row stays here until then)."""

    ask: Callable[[str, dict[str, Any]], Any] | None = None
    spec: RelaySpec | None = None
    node: str = ""
    sent: int = 0  # the id of the last row the driver acknowledged

    def seed(self, rows: Sequence[dict[str, Any]], meta: dict[str, str]) -> None:
        """Start from the run's rows and notes, unsynced: they are on the driver's disk already."""
        self._conn.execute("PRAGMA synchronous = OFF")
        try:
            for row in rows:
                self.add_row(_without_id(row))
            for key, value in meta.items():
                super().set_meta(key, value)
        finally:
            self._conn.execute("PRAGMA synchronous = FULL")

    def relay_to(self, ask: Callable[[str, dict[str, Any]], Any], spec: RelaySpec, node: str) -> None:
        self.ask, self.spec, self.node = ask, spec, node
        self.sent = max((r["id"] for r in self.raw_rows()), default=0)  # seeded rows came from the run

    def append(self, m: Any, **kw: Any) -> None:
        super().append(m, **kw)
        if self.ask is not None:
            rows = self.raw_rows(after=self.sent)
            self.ask("rows", self._payload(rows=[_without_id(r) for r in rows]))
            self.sent = rows[-1]["id"]

    def set_meta(self, key: str, value: str) -> None:
        super().set_meta(key, value)
        if self.ask is not None:
            self.ask("meta", self._payload(key=key, value=value))

    def _payload(self, **kw: Any) -> dict[str, Any]:
        assert self.spec is not None
        return {"partition": self.spec.partition, "attempt": self.spec.attempt, "node": self.node, **kw}


def _without_id(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "id"}


@contextmanager
def _held(path: Path) -> Iterator[bool]:
    """Whether this process got the lock of ``path`` (held for the block): a node-local journal is
    locked by its search while it lives, so a sweep takes only those whose search has died."""
    lock = path.with_name(path.name + ".lock")
    for tries_left in (2, 1, 0):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            break
        except FileNotFoundError:  # another search of the run pruned the empty folder just now
            if not tries_left:
                raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", ".lock"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)


def resend_leftovers(folder: Path, config_hash: str, ask: Callable[[str, dict[str, Any]], Any],
                     spec: dict[str, Any]) -> int:
    """Send the rows of every node-local journal in ``folder`` whose search died; delete those the
    driver acknowledged whole. Rows the run already holds come back as duplicates. The number sent."""
    sent = 0
    for path in sorted(folder.glob("*.sqlite")):
        with _held(path) as mine:
            if not mine:
                continue  # a live search's journal
            if not path.exists():  # another sweep took it whole while this one waited for its lock
                _remove(path)
                continue
            if ".r0." not in path.name:  # another rank's copy: rank 0's holds the same rows
                _remove(path)
                continue
            try:
                with Journal.open(path, config_hash) as old:
                    rows = [_without_id(r) for r in old.raw_rows()]
            except (sqlite3.Error, JournalError):  # unreadable: left where it is, never in the way of a search
                continue
            said = ask("rows", {**spec, "rows": rows, "resend": True}) if rows else []
            sent += len(rows)
            if KEEP not in said:
                _remove(path)
    return sent


def _node() -> tuple[str, str]:
    """(this node's id, a label for the summary: its address and the id's first digits)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return node_id, f"{ray.util.get_node_ip_address()}:{node_id[:8]}"


def run_relayed_search(task: PartitionSearchTask, spec: RelaySpec) -> SearchResult:
    """One attempt of one partition search (one rank of its group) on this node.

    Rank 0 first re-sends what dead searches of the run left on this node; every rank then starts from
    the run's rows of the partition, records into a locked node-local journal, and (rank 0) relays
    each row and event to the driver. The node-local journal is deleted once the search ended whole.
    """
    ask = _asker(spec)
    node_id, label = _node()
    folder = node_folder(spec)
    me = {"partition": spec.partition, "attempt": spec.attempt, "node": label}
    if spec.rank == 0:
        resend_leftovers(folder, task.config_hash, ask, me)
    rows, meta = ask("seed", {**me, "rank": spec.rank, "node_id": node_id})
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in spec.partition)
    path = folder / f"{safe}.a{spec.attempt}.r{spec.rank}.{uuid.uuid4().hex[:8]}.sqlite"
    with _held(path):
        journal = RelayedJournal.open(path, task.config_hash)
        try:
            journal.seed(rows, meta)
            listeners: list[Callable[[Any], None]] = []
            if spec.rank == 0:
                journal.relay_to(ask, spec, label)
                listeners.append(_teller(spec))
            result = run_search_task(task, listeners, journal=journal)
        finally:
            journal.close()
        _remove(path)  # every row is in the run's journal
    _prune(folder)
    return result


def _prune(folder: Path) -> None:
    """Remove the run's folder on this node if nothing is left in it."""
    try:
        folder.rmdir()
    except OSError:  # another search's journal, or a leftover, is still in it
        pass


def sweep_node(spec: RelaySpec, config_hash: str) -> int:
    """The end-of-run sweep of one node: re-send what dead searches left there; the rows sent."""
    _, label = _node()
    folder = node_folder(spec)
    sent = resend_leftovers(folder, config_hash, _asker(spec), {"partition": None, "attempt": None, "node": label})
    _prune(folder)
    return sent


# -- a tensor-parallel group on real GPUs ----------------------------------------------------------------
class RankWorker:
    """One rank of a search's tensor-parallel group: an actor holding one bundle of the group's
    placement group (one node, so NCCL runs inside it)."""

    def where(self) -> tuple[str, list[str], int]:
        """(this node's address, the GPU ids Ray gave this actor, its process id)."""
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return ray.util.get_node_ip_address(), [str(i) for i in ids], os.getpid()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def run(self, task: PartitionSearchTask, spec: RelaySpec, env: dict[str, str]) -> SearchResult:
        os.environ.update(env)  # before the backend starts torch.distributed and CUDA from it
        return run_relayed_search(task, spec)


def rank_env(rank: int, ranks: int, master: str, port: int, gpus: Sequence[Sequence[str]]) -> dict[str, str]:
    """torchrun's environment for ``rank``: every rank sees the group's GPUs, its own at LOCAL_RANK."""
    env = {"MASTER_ADDR": master, "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks), "RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank)}
    visible = sorted({g for ids in gpus for g in ids}, key=lambda g: (len(g), g))
    if visible and gpus[rank]:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        env["LOCAL_RANK"] = str(visible.index(gpus[rank][0]))
    return env


def run_group(task: PartitionSearchTask, spec: RelaySpec, pg: Any, ranks: int, cpus: float,
              gpus: float) -> SearchResult:
    """The leader of one attempt: one RankWorker per bundle of ``pg``, a torchrun-like rendezvous among
    them, every rank searching; rank 0's result. A rank that fails stops the others."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    worker = ray.remote(RankWorker)
    actors = [worker.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=
                             PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
              for i in range(ranks)]
    pids: list[int] = []
    finished = False
    try:
        where = ray.get([a.where.remote() for a in actors])
        pids = [w[2] for w in where]
        port = ray.get(actors[0].free_port.remote())
        refs = [a.run.remote(task, RelaySpec(**{**spec.__dict__, "rank": i}),
                             rank_env(i, ranks, where[0][0], port, [w[1] for w in where]))
                for i, a in enumerate(actors)]
        pending = list(refs)
        while pending:  # the first failure ends the group: its peers would wait in a collective
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done[0])
        finished = True
        return ray.get(refs[0])
    finally:
        _end_ranks(ray, actors, [] if finished else pids)


RANK_STOP_S = 10.0  # how long a rank stopped mid-search gets to reset its GPU's clock before it is killed


def _end_ranks(ray: Any, actors: Sequence[Any], running: Sequence[int]) -> None:
    """Kill the group's actors; ranks still ``running`` (their pids, on this node: the group is packed
    on the leader's) first get SIGTERM, on which a real GPU's clock controller resets its lock."""
    import signal
    import time

    from kareus.launch.launchers import _alive

    for pid in running:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + RANK_STOP_S
    while running and time.monotonic() < deadline and any(_alive(pid) for pid in running):
        time.sleep(0.1)
    for a in actors:
        ray.kill(a)
