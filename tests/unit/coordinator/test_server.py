"""Tests for deadpool/coordinator/server.py: the shell applies the machine's effects to a store and processes."""

import threading
import time
from dataclasses import dataclass, replace

from deadpool.config import JobConfig
from deadpool.coordinator import server
from deadpool.coordinator.machine import start
from deadpool.coordinator.server import Coordinator
from deadpool.coordinator.state import Persisting, Phase, PublishStatus
from deadpool.coordinator.transitions import status_of
from deadpool.events import EventLog, read_events
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Commit, Durable, PersistReport, Published, Shutdown, Started
from deadpool.protocol.status import JobStatus
from deadpool.protocol.store import Table


def Store() -> ControlPlane:  # noqa: N802
    """The control plane over a real store table, in this process."""
    return ControlPlane(Table())


@dataclass
class Child:
    name: str
    pid: int
    returncode: int | None = None


class Processes:
    """The processes named in `codes` exit with their code at the first poll; those that exit 0 had started."""

    def __init__(self, store: ControlPlane, keys: Keys, codes: dict[str, int]) -> None:
        self.store, self.keys, self.codes, self.children, self.log = store, keys, codes, {}, []

    def spawn(self, name: str, role: str, rank: int) -> Child:
        self.children[name] = Child(name, pid=1000 + len(self.children))
        if self.codes.get(name) == 0:
            self.store.put(self.keys.started(name), Started(name))
        self.log.append(("spawn", name, role, rank))
        return self.children[name]

    def poll(self) -> list[Child]:
        exited = [c for c in self.children.values() if c.returncode is None and c.name in self.codes]
        for child in exited:
            child.returncode = self.codes[child.name]
        return exited

    def fence(self, name: str) -> None:
        self.log.append(("fence", name))

    def alive(self) -> set[str]:
        return {c.name for c in self.children.values() if c.returncode is None}

    def relabel(self, name: str, label: str) -> None:
        self.log.append(("relabel", name, label))

    def stop_all(self, grace_s: float) -> None:
        self.log.append(("stop_all", grace_s))

    def joined(self) -> dict[int, str]:
        return {}

    def on_exit(self, wake) -> None:
        self.wake = wake


CONFIG = dict(script="train.py", workers=2, spares=1, token="tok")


def test_a_job_whose_ranks_finish_is_published_run_and_ended_through_the_store(tmp_path):
    config = JobConfig(**CONFIG, run_dir=str(tmp_path))
    store, keys, events = Store(), Keys("tok"), EventLog(tmp_path / "events.jsonl", role="coordinator", proc="c")
    processes = Processes(store, keys, {"w0": 0, "w1": 0})
    assert Coordinator(config, store, events, processes).run() == 0
    assert processes.log == [("spawn", "w0", "worker", 0), ("spawn", "w1", "worker", 1), ("spawn", "s0", "spare", 2),
                             ("stop_all", 10.0)]
    assert store.get(keys.shutdown(), Shutdown).how == "done" and store.get(keys.generation(), Published).gen == 0
    assert store.get(keys.committed(0), Commit) == Commit(0, None, ())
    # a rank's own reports have one writer, the rank: the coordinator writes none for it
    assert store.present([keys.durable(0, 1), keys.heartbeat("s0"), keys.alive("s0")]) == [False, False, False]
    names = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert names == ["plan_published", "process_spawned", "process_spawned", "process_spawned", "job_finished"]
    status = JobStatus.from_json((tmp_path / "status.json").read_text())
    assert (status.outcome, status.exit_code) == ("finished", 0)
    assert store.get(keys.status(), JobStatus) == status


def test_a_script_that_fails_before_init_fences_the_others_and_says_why_on_stderr(tmp_path, capsys):
    config = JobConfig(**CONFIG, run_dir=str(tmp_path))
    store, keys, events = Store(), Keys("tok"), EventLog(tmp_path / "events.jsonl", role="coordinator", proc="c")
    processes = Processes(store, keys, {"w1": 2})
    assert Coordinator(config, store, events, processes).run() == 1
    assert sorted(processes.log[3:5]) == [("fence", "s0"), ("fence", "w0")]  # the live ones, in any order
    assert processes.log[5:] == [("stop_all", 5.0)]
    assert store.get(keys.shutdown(), Shutdown).how == "failed"
    assert capsys.readouterr().err == (
        "[coordinator] job failed: error in the training script on w1: exited with code 2 before deadpool.init(). "
        "This is a bug in the script, not a node failure, so no spare was used; the traceback is above (and in "
        "logs/w1.log). Fix the script and run again.\n")
    status = JobStatus.from_json((tmp_path / "status.json").read_text())
    assert (status.outcome, status.exit_code, status.reason) == ("failed", 1, events_reason(tmp_path))


def events_reason(run_dir) -> str:
    return next(e["reason"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "job_failed")


def test_a_writers_report_on_an_earlier_checkpoint_is_not_an_answer_to_this_one(tmp_path):
    """Each writer rewrites one report key (a key per checkpoint would pile up over a month of them), so the
    shell takes a report only for the step being written."""
    config = JobConfig(**CONFIG, run_dir=str(tmp_path))
    store, keys, events = Store(), Keys("tok"), EventLog(tmp_path / "events.jsonl", role="coordinator", proc="c")
    coordinator = Coordinator(config, store, events, Processes(store, keys, {}))
    state, _ = start(config)
    state = replace(state, persisting=Persisting(20, ("w0", "w1"), ordered_t=0.0, deadline=9.0, reason="every 10"))
    store.put(keys.persisted("w0"), PersistReport(10, "w0", (0,), ok=True))
    store.put(keys.persisted("w1"), PersistReport(20, "w1", (1,), ok=True))
    assert coordinator._persist_reports(state) == {"w1": PersistReport(20, "w1", (1,), ok=True)}
    store.put(keys.persisted("w0"), PersistReport(20, "w0", (0,), ok=False, error="disk full"))
    assert coordinator._persist_reports(state)["w0"].error == "disk full"


def test_a_report_or_an_exit_wakes_the_coordinator_and_a_heartbeat_or_its_own_write_does_not(tmp_path):
    """Between ticks the shell sleeps until woken (or QUIET_TICK_S in a quiet steady state): by a report the
    machine waits on, written by another thread (a store connection), or by a process's exit; heartbeats come
    every 0.1 s per rank and are dated by their arrival instead, so they wake nobody."""
    config = JobConfig(**CONFIG, run_dir=str(tmp_path))
    store, keys, events = Store(), Keys("tok"), EventLog(tmp_path / "events.jsonl", role="coordinator", proc="c")
    processes = Processes(store, keys, {})
    coordinator = Coordinator(config, store, events, processes)
    coordinator.thread = threading.get_ident()  # as run() sets it: this thread is the coordinator's

    def written_elsewhere(key: str) -> bool:
        thread = threading.Thread(target=store.put, args=(key, Started("w0")))
        thread.start()
        thread.join(5.0)
        woken = coordinator.woken.is_set()
        coordinator.woken.clear()
        return woken

    assert written_elsewhere(keys.durable(0, 1))
    assert not written_elsewhere(keys.heartbeat("w0")) and not written_elsewhere(keys.alive("w0"))
    store.put(keys.durable(0, 0), Started("w0"))  # the coordinator's own thread
    assert not coordinator.woken.is_set()
    processes.wake()  # the agent: a child exited
    assert coordinator.woken.is_set()
    coordinator.woken.clear()
    coordinator.request_stop()  # SIGTERM
    assert coordinator.woken.is_set()


def test_in_the_steady_state_a_durable_report_wakes_the_coordinator_only_with_the_others_it_awaits(tmp_path):
    """With a snapshot every step, each rank's report of a step woke a tick of its own (3 ticks a commit where
    1 does): now a durable report wakes the shell once every rank that lags behind the newest step (else every
    rank) has written one since the last tick's gather, including between its gather and the next wait."""
    config = JobConfig(**CONFIG, run_dir=str(tmp_path))
    store, keys, events = Store(), Keys("tok"), EventLog(tmp_path / "events.jsonl", role="coordinator", proc="c")
    coordinator = Coordinator(config, store, events, Processes(store, keys, {}))
    coordinator.thread = threading.get_ident()
    state = replace(start(config)[0], phase=Phase.STEADY)
    gen = state.plan.generation

    def report(rank: int, *steps: int) -> bool:
        thread = threading.Thread(target=store.put, args=(keys.durable(gen, rank), Durable(gen, rank, steps, ())))
        thread.start()
        thread.join(5.0)
        woken = coordinator.woken.is_set()
        coordinator.woken.clear()
        return woken

    def tick() -> None:
        coordinator._gather(state)
        coordinator._arm(state)

    assert report(0, 4, 5) and report(1, 3, 4)  # not armed yet: any report wakes, as outside the steady state
    tick()  # rank 1 lags behind step 5
    assert not report(0, 5, 6)  # rank 0 goes on: nothing more can be committed yet
    assert report(1, 4, 5)  # step 5 can
    tick()  # rank 1 lags behind step 6
    assert report(1, 5, 6)
    tick()  # both hold step 6: each must report step 7
    assert not report(1, 6, 7) and report(0, 6, 7)
    tick()
    assert not report(0, 7, 8)
    coordinator._gather(state)  # sees rank 1 lag behind step 8
    assert not report(1, 7, 8)  # after that gather, before the arming: the old arming awaits both ranks
    coordinator._arm(state)  # the new one awaits rank 1, which has written since the gather: a tick at once
    assert coordinator.woken.is_set()


def test_status_json_waits_for_a_commit_alone_and_never_for_anything_else(tmp_path, monkeypatch):
    """The store's copy is always the newest; the file takes a new commit at most every STATUS_FILE_EVERY_S
    (a snapshot every step commits every step), any other change at once, and whatever is pending at the end.
    The interval is an hour here, so that no pause of this test's own can make a write due."""
    monkeypatch.setattr(server, "STATUS_FILE_EVERY_S", 3600.0)
    config = JobConfig(**CONFIG, run_dir=str(tmp_path))
    store, keys, events = Store(), Keys("tok"), EventLog(tmp_path / "events.jsonl", role="coordinator", proc="c")
    coordinator = Coordinator(config, store, events, Processes(store, keys, {}))
    first = status_of(start(config)[0])

    def publish(status: JobStatus) -> JobStatus:
        coordinator._apply(PublishStatus(status))
        assert store.get(keys.status(), JobStatus) == status
        return JobStatus.from_json((tmp_path / "status.json").read_text())

    assert publish(first) == first
    assert publish(replace(first, committed=1)) == first  # a commit alone, within the interval: waits
    assert publish(replace(first, committed=2)) == first
    coordinator._write_status_file(time.monotonic())  # a tick within the interval: still waits
    assert JobStatus.from_json((tmp_path / "status.json").read_text()) == first
    coordinator._write_status_file(time.monotonic() + 3600.0)  # a tick after it: written
    assert JobStatus.from_json((tmp_path / "status.json").read_text()) == replace(first, committed=2)
    moved = replace(first, committed=3, phase="settling")
    assert publish(moved) == moved  # anything else: at once, with the commit that came with it
    assert publish(replace(moved, committed=4)) == moved
    coordinator._write_status_file(time.monotonic(), due_only=False)  # the job's end: whatever is pending
    assert JobStatus.from_json((tmp_path / "status.json").read_text()) == replace(moved, committed=4)


def test_a_checkpoint_resumed_from_the_persist_dir_counts_as_persisted_one_elsewhere_does_not(tmp_path):
    checkpoint = tmp_path / "ckpt" / "step-0000000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text('{"step": 4}')
    config = JobConfig(script="train.py", workers=2, run_dir="run", resume=str(checkpoint), persist_dir=str(tmp_path))
    assert server.resumed_in_place(replace(config, persist_dir=str(tmp_path / "ckpt"))) == 4
    assert server.resumed_in_place(config) is None  # it will be written into --persist-dir once committed
    assert server.resumed_in_place(replace(config, resume="")) is None
