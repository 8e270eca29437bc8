"""The relay between remote searches and the run's journal, without Ray: at-least-once delivery
deduplicated by candidate key, given-up attempts refused, rows of a search running elsewhere kept on
their node, dead searches' node-local journals re-sent and removed, a retry's replayed events hidden."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.events import BatchFinished, CandidateMeasured, SearchFinished, SearchStarted
from kareus.launch.cluster import Shown, fits, largest
from kareus.launch.relay import APPENDED, DUPLICATE, KEEP, Mailbox, RelayHub, rank_env, resend_leftovers, run_key
from kareus.profiler import Journal
from kareus.profiler.journal import JournalMismatchError
from kareus.types import Candidate, Measurement


def measurement(partition: str = "p", sms: int = 8, time_s: float = 1.0) -> Measurement:
    return Measurement(Candidate(partition, "linear_0", sms, 1410), time_s, 300.0, 215.0, 85.0, 40.0, 1410.0, 1)


def journal_with(path: Path, *ms: Measurement) -> Journal:
    j = Journal.open(path, "h")
    for m in ms:
        j.append(m, backend="sim", clock_mhz=1410, gpu_temperature_c=40.0, gpu_seconds=2.0)
    return j


def raw(path: Path, *ms: Measurement) -> list[dict]:
    with journal_with(path, *ms) as j:
        return [{k: v for k, v in r.items() if k != "id"} for r in j.raw_rows()]


def test_a_copied_row_is_the_original_and_a_second_copy_is_dropped(tmp_path):
    rows = raw(tmp_path / "node.sqlite", measurement(sms=4), measurement(sms=8))
    with Journal.open(tmp_path / "run.sqlite", "h") as run:
        assert [run.add_row(r) for r in rows] == [True, True]
        assert [run.add_row(r) for r in rows] == [False, False]  # at least once: sent again, kept once
        assert run.duplicates() == [] and run.measurements() == [measurement(sms=4), measurement(sms=8)]
        assert [r["worker"] for r in run.raw_rows()] == [r["worker"] for r in rows]  # the node's, not the driver's
        assert [r["id"] for r in run.raw_rows(after=1)] == [2]
    with Journal.open(tmp_path / "other.sqlite", "another") as other, pytest.raises(JournalMismatchError):
        other.add_row(rows[0])


def test_a_searchs_second_reading_of_a_candidate_is_a_row_of_its_own(tmp_path):
    import dataclasses

    again = dataclasses.replace(measurement(sms=4, time_s=1.1), flags=("reading:1",))
    rows = raw(tmp_path / "node.sqlite", measurement(sms=4), again)
    with Journal.open(tmp_path / "run.sqlite", "h") as run:
        assert [run.add_row(r) for r in rows + rows] == [True, True, False, False]
        assert run.duplicates() == [] and [m.time_s for m in run.measurements()] == [1.0, 1.1]


class Inbox:
    """The mailbox's driver side, as RelayHub calls it through Ray."""

    def __init__(self) -> None:
        self.messages: list = []
        self.answers: list = []
        self.take = self._Call(lambda seen, wait_s: self._take())
        self.answer = self._Call(lambda answers: self.answers.extend(answers))

    def _take(self) -> list:
        out, self.messages = self.messages, []
        return out

    class _Call:
        def __init__(self, fn) -> None:
            self.remote = fn


class DirectRay:
    class exceptions:
        class ActorUnavailableError(Exception):
            pass

    @staticmethod
    def get(value):
        return value


def hub_on(tmp_path: Path) -> tuple[RelayHub, Inbox]:
    inbox = Inbox()
    return RelayHub(DirectRay(), Journal.open(tmp_path / "run.sqlite", "h"), inbox), inbox


def rows_msg(token: int, partition: str, attempt, rows: list[dict], resend: bool = False) -> tuple:
    return (token, "rows", {"partition": partition, "attempt": attempt, "node": "n1", "rows": rows, "resend": resend})


def test_the_hub_appends_a_live_attempts_rows_and_refuses_a_given_up_one(tmp_path):
    hub, inbox = hub_on(tmp_path)
    first, second = raw(tmp_path / "a.sqlite", measurement(sms=4)), raw(tmp_path / "b.sqlite", measurement(sms=6))
    hub.begin("p", 1)
    inbox.messages = [rows_msg(1, "p", 1, first), rows_msg(2, "p", 1, first), rows_msg(3, "p", 0, second)]
    hub.serve(0)
    assert inbox.answers == [(1, ("ok", [APPENDED])), (2, ("ok", [DUPLICATE])),
                             (3, ("error", "partition p's search attempt 0 was given up"))]
    assert hub.journal.count() == 1 and hub.nodes["n1"].measured == 1 and hub.nodes["n1"].gpu_seconds == 2.0


def test_a_resent_row_of_a_search_running_elsewhere_stays_on_its_node(tmp_path):
    """Appended now, it could answer a candidate the running search measures itself: the run's journal
    would hold one reading while the search's frontier used another."""
    hub, inbox = hub_on(tmp_path)
    left = raw(tmp_path / "left.sqlite", measurement("q", sms=4), measurement("p", sms=4))
    hub.begin("q", 2)
    inbox.messages = [rows_msg(1, "p", 0, left, resend=True), rows_msg(2, "q", 2, left, resend=True)]
    hub.begin("p", 0)
    hub.serve(0)
    assert inbox.answers == [(1, ("ok", [KEEP, APPENDED])), (2, ("ok", [APPENDED, KEEP]))]
    hub.end("q"), hub.end("p")
    inbox.messages = [rows_msg(3, None, None, left, resend=True)]  # the end-of-run sweep
    hub.serve(0)
    assert inbox.answers[-1] == (3, ("ok", [DUPLICATE, DUPLICATE]))


def test_every_rank_of_a_group_starts_from_the_rows_rank_0_found(tmp_path):
    hub, inbox = hub_on(tmp_path)
    hub.begin("p", 0)

    def seed(token: int, rank: int) -> tuple:
        return (token, "seed", {"partition": "p", "attempt": 0, "rank": rank, "node": "n1", "node_id": "abc"})

    inbox.messages = [seed(1, 1)]  # rank 1 first: its answer waits for rank 0's
    hub.serve(0)
    assert inbox.answers == []
    rows = raw(tmp_path / "a.sqlite", measurement(sms=4))
    inbox.messages = [rows_msg(2, "p", 0, rows), seed(3, 0)]
    hub.serve(0)
    answered = dict(inbox.answers)
    assert answered[1] == answered[3] and [r["sms"] for r in answered[3][1][0]] == [4]
    assert hub.placed == {"p": "abc"} and hub.nodes["n1"].searches == 1


def test_a_runs_node_folder_is_named_by_its_config_and_its_journals_lineage(tmp_path):
    from kareus.profiler.journal import copy_journal

    with Journal.open(tmp_path / "a.sqlite", "h") as j:
        key = run_key(j)
        assert key == run_key(j) and key.startswith("h-")
    copy_journal(tmp_path / "a.sqlite", tmp_path / "b.sqlite")  # what resume= does
    with Journal.open(tmp_path / "b.sqlite", "h") as j:
        assert run_key(j) == key  # a resumed run collects what its predecessor's nodes still hold
    with Journal.open(tmp_path / "c.sqlite", "h") as j:
        assert run_key(j) != key


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_leftovers_of_dead_searches_are_resent_and_removed_and_live_ones_left_alone(tmp_path):
    dead = tmp_path / "p.a0.r0.x.sqlite"
    journal_with(dead, measurement(sms=4), measurement(sms=6)).close()
    other_rank = tmp_path / "p.a0.r1.y.sqlite"
    journal_with(other_rank, measurement(sms=4)).close()
    live = tmp_path / "q.a0.r0.z.sqlite"
    journal_with(live, measurement("q", sms=4)).close()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, f"{live}.lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # a search still running on this node
        sent: list = []

        def ask(kind, payload):
            sent.append((kind, [r["sms"] for r in payload["rows"]], payload["resend"]))
            return [APPENDED] * len(payload["rows"])

        assert resend_leftovers(tmp_path, "h", ask, {"partition": "p", "attempt": 1, "node": "n"}) == 2
    finally:
        holder.kill()
        holder.wait()
    assert sent == [("rows", [4, 6], True)]
    assert not dead.exists() and not other_rank.exists() and live.exists()
    kept: list = []
    assert resend_leftovers(tmp_path, "h", lambda kind, payload: kept.append(1) or [KEEP], {}) == 1
    assert live.exists() and kept  # its search runs elsewhere: sent again later
    live.unlink()
    damaged = tmp_path / "r.a0.r0.w.sqlite"
    damaged.write_bytes(b"not a journal")
    assert resend_leftovers(tmp_path, "h", ask, {}) == 0 and damaged.exists()  # left alone, in no search's way


def test_a_retrys_replayed_events_are_shown_once():
    m = measurement()
    shown = Shown()
    first = [SearchStarted("p", 10, 4, "mbo"), *[CandidateMeasured("p", i, m) for i in range(3)],
             BatchFinished("p", 0, 3, 1.0)]
    retry = [SearchStarted("p", 10, 4, "mbo"), *[CandidateMeasured("p", i, m, cached=True) for i in range(4)],
             BatchFinished("p", 0, 3, 1.0), BatchFinished("p", 1, 4, 1.5), SearchFinished("p", None, 4, 0, 1.0, 1.5)]
    assert [shown.admit(e) for e in first] == [True] * 5
    assert [shown.admit(e) for e in retry] == [False, False, False, False, True, False, True, True]


def test_a_group_fits_a_node_only_with_all_its_gpus_and_cpus():
    nodes = [{"Resources": {"CPU": 16.0, "GPU": 4.0}}, {"Resources": {"CPU": 64.0}}]
    assert fits(nodes[0], (4, 4.0, 8.0)) and not fits(nodes[0], (8, 8.0, 8.0)) and not fits(nodes[1], (1, 1.0, 1.0))
    assert largest(nodes) == (4.0, 16.0) and largest([]) == (0.0, 0.0)


def test_each_rank_gets_torchruns_environment_and_sees_the_groups_gpus():
    env = rank_env(1, 2, "10.0.0.7", 29500, [["3"], ["1"]])
    assert env == {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1",
                   "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1,3"}
    assert rank_env(0, 2, "10.0.0.7", 29500, [["3"], ["1"]])["LOCAL_RANK"] == "1"
    cpu = rank_env(1, 2, "127.0.0.1", 29500, [[], []])  # a gloo group on CPUs
    assert cpu["LOCAL_RANK"] == "1" and "CUDA_VISIBLE_DEVICES" not in cpu
    assert rank_env(0, 1, "h", 1, [["10"], ["9"]])["CUDA_VISIBLE_DEVICES"] == "9,10"


def test_a_call_the_mailbox_could_not_take_is_made_again():
    from kareus.launch.relay import calling

    tries = []

    def call():
        tries.append(1)
        if len(tries) < 3:
            raise DirectRay.exceptions.ActorUnavailableError("connection reset")
        return "answer"

    assert calling(DirectRay, call) == "answer" and len(tries) == 3


def test_the_mailbox_answers_a_waiting_message_once_the_driver_has():
    async def scenario():
        box = Mailbox()
        asked = asyncio.ensure_future(box.ask("rows", {"n": 1}))
        await asyncio.sleep(0)
        await box.tell("event", "e")
        taken = await box.take(0, 0.01)
        assert [(kind, payload) for _, kind, payload in taken] == [("rows", {"n": 1}), ("event", "e")]
        assert await box.take(0, 0.01) == taken  # a take retried after a lost reply loses nothing
        assert not asked.done()
        await box.answer([(taken[0][0], ("ok", [APPENDED]))])
        assert await asked == ("ok", [APPENDED])
        assert await box.take(taken[-1][0], 0.01) == []

    asyncio.run(scenario())


def test_a_node_local_journal_hands_each_new_row_to_the_driver_and_not_the_seeded_ones(tmp_path):
    from kareus.launch.relay import RelayedJournal, RelaySpec

    seed = raw(tmp_path / "run.sqlite", measurement(sms=4))
    journal = RelayedJournal.open(tmp_path / "node.sqlite", "h")
    journal.seed(seed, {"thermal:x": "{}"})
    sent: list = []
    journal.relay_to(lambda kind, payload: sent.append((kind, payload)), RelaySpec(None, "k", "p", 2), "n1")
    journal.append(measurement(sms=6), backend="sim", clock_mhz=1410, gpu_temperature_c=40.0)
    journal.set_meta("thermal:x", "{\"a\": 1}")
    journal.close()
    assert [kind for kind, _ in sent] == ["rows", "meta"]
    rows = sent[0][1]
    assert (rows["partition"], rows["attempt"], rows["node"]) == ("p", 2, "n1")
    assert [r["sms"] for r in rows["rows"]] == [6] and "id" not in rows["rows"][0]
    assert sent[1][1]["key"] == "thermal:x"
