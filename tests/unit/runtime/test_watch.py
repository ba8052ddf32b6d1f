"""The watch sees its generation's abort as soon as the coordinator writes it, and only while it is open."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

from tests.plane import control_plane

from deadpool.config import JobConfig
from deadpool.events import EventLog
from deadpool.protocol.keys import Keys
from deadpool.protocol.kinds import Role
from deadpool.protocol.plan import Plan
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Abort, Heartbeat, Published
from deadpool.runtime.context import Context, connect
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.plane import PlaneStore
from deadpool.runtime.watch import ABORT_SLICE_S, BEAT_EVERY_S, Beacon, Progress, Watch


def _context(tmp_path: Path, fields: dict) -> Context:
    config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **fields)
    client = connect(config)
    return Context("w0", Role.WORKER, config, PlaneStore(client), ControlPlane(client), Keys("t"),
                   EventLog(tmp_path / "events.jsonl", role="worker", proc="w0"), None)  # type: ignore[arg-type]


def _watch(tmp_path: Path, fields: dict, aborts: list[float], progress: Progress | None = None,
           ctx: Context | None = None) -> tuple[Watch, Incarnation]:
    ctx = ctx or _context(tmp_path, fields)
    inc = Incarnation.of(Plan(generation=0, ranks=("w0",), holders=((),), spares=()), "w0", ctx.keys)
    return Watch(ctx, inc, progress, on_abort=lambda: aborts.append(time.monotonic())), inc


def test_the_abort_is_seen_at_once_and_acted_on_once(tmp_path):
    with control_plane(tmp_path) as (server, fields):
        aborts: list[float] = []
        watch, inc = _watch(tmp_path, fields, aborts)
        time.sleep(2 * ABORT_SLICE_S)  # the wait has gone round a slice or two: it still wakes at once
        assert not watch.aborted()
        written = time.monotonic()
        ControlPlane(server.table).put(inc.abort_key(), Abort(0, "test"))
        deadline = written + 5.0
        while not aborts and time.monotonic() < deadline:
            time.sleep(0.001)
        assert watch.aborted() and len(aborts) == 1
        assert aborts[0] - written < ABORT_SLICE_S  # woken by the write, not by the end of a slice
        time.sleep(2 * ABORT_SLICE_S)
        assert len(aborts) == 1
        watch.close()


def test_a_closed_watch_ignores_a_later_abort_and_its_thread_ends(tmp_path):
    with control_plane(tmp_path) as (server, fields):
        aborts: list[float] = []
        before = set(threading.enumerate())  # another test's watch of generation 0 may still be winding down
        watch, inc = _watch(tmp_path, fields, aborts)
        [ours] = [t for t in threading.enumerate() if t not in before and t.name == "deadpool-abort-g0"]
        watch.close()
        ControlPlane(server.table).put(inc.abort_key(), Abort(0, "after the close"))
        ours.join(5.0)
        assert not ours.is_alive()
        assert aborts == [] and not watch.aborted()


def test_a_store_gone_before_the_abort_wait_connects_ends_the_watch_quietly(tmp_path):
    """The abort wait opens a connection of its own when its thread starts; if the store is gone (or another
    job's now listens there) it says so in the events and ends, with no traceback from a dying thread."""
    with control_plane(tmp_path) as (_, fields):
        ctx = _context(tmp_path, fields)
    (tmp_path / "other").mkdir()
    with control_plane(tmp_path / "other") as (_, other):  # what now answers may be another job's store
        ctx.config = replace(ctx.config, store_port=other["store_port"])
        escaped: list[threading.ExceptHookArgs] = []
        previous, threading.excepthook = threading.excepthook, escaped.append
        try:
            before = set(threading.enumerate())
            watch, _ = _watch(tmp_path, fields, [], ctx=ctx)
            [ours] = [t for t in threading.enumerate() if t not in before and t.name == "deadpool-abort-g0"]
            ours.join(10.0)
        finally:
            threading.excepthook = previous
        assert not ours.is_alive() and escaped == []
        watch.close()
    ended = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["error"] for e in ended if e["event"] == "watch_ended"] == [
        "the coordinator refused this process's secret (a secret of another job?)"]


def test_the_heartbeat_goes_out_every_beat_period_however_often_the_progress_moves(tmp_path):
    """A training thread that marks progress every 5 ms costs one pulse per BEAT_EVERY_S, not one per mark
    (or per 20 ms poll, as once), and each pulse carries the progress as it is then."""
    with control_plane(tmp_path) as (server, fields):
        progress = Progress()
        watch, _ = _watch(tmp_path, fields, [], progress)
        plane, key = ControlPlane(server.table), Keys("t").heartbeat("w0")
        start = time.monotonic()
        while time.monotonic() - start < 1.0:
            progress.mark(progress.step + 1, "forward")
            time.sleep(0.005)
        beat = plane.poll(key, Heartbeat)
        watch.close()
    assert beat is not None
    assert 1.0 / BEAT_EVERY_S / 2 <= beat.beat <= 1.0 / BEAT_EVERY_S + 2  # ~10 pulses, where 200 marks were made
    assert progress.step - beat.step <= 2 * BEAT_EVERY_S / 0.005  # at most two periods behind the last mark


def _events(path: Path, name: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name] if path.exists() else []


def test_a_rank_that_does_not_leave_an_aborted_generation_reports_every_threads_stack(tmp_path, capfd):
    """The training thread is blocked where the abort cannot reach it: half the recovery timeout after the
    abort, with the next plan out, the watch names the function it is blocked in (events and stderr); a
    rank that left and reported ready in the next generation says nothing; one that left but got stuck
    before reporting is named too (`left`)."""
    with control_plane(tmp_path) as (server, fields):
        fields = {**fields, "recovery_timeout_s": 1.0}
        release = threading.Event()

        def blocked_where_no_abort_reaches() -> None:
            release.wait(10.0)

        training = threading.Thread(target=blocked_where_no_abort_reaches, name="training")
        training.start()
        ctx = _context(tmp_path, fields)
        watch, inc = _watch(tmp_path, fields, [], Progress(), ctx)
        ControlPlane(server.table).put(Keys("t").generation(), Published(1))  # the next plan is out
        ControlPlane(server.table).put(inc.abort_key(), Abort(0, "test"))
        log = tmp_path / "events.jsonl"
        deadline = time.monotonic() + 5.0
        while not _events(log, "abort_unheeded") and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()
        training.join()
        watch.close()
        [event] = _events(log, "abort_unheeded")
        assert event["after_s"] == 0.5 and event["phase"] == "start" and event["left"] is False
        assert any("in blocked_where_no_abort_reaches" in line for line in event["threads"]["training"])
        assert "blocked_where_no_abort_reaches" in capfd.readouterr().err

        prompt, _ = _watch(tmp_path, fields, [], Progress(), ctx)  # the abort is written already
        time.sleep(0.1)
        prompt.close()  # left in time (as member.leave does)
        ctx.ready_gen = 1  # and reported ready in generation 1 (recovery.py)
        time.sleep(0.6)
        assert len(_events(log, "abort_unheeded")) == 1

        ctx.ready_gen = -1
        stuck, _ = _watch(tmp_path, fields, [], Progress(), ctx)
        time.sleep(0.1)
        stuck.close()  # left, but never reports ready: stuck in leaving or recovering
        deadline = time.monotonic() + 5.0
        while len(_events(log, "abort_unheeded")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [e["left"] for e in _events(log, "abort_unheeded")] == [False, True]


def test_the_beacon_rests_while_the_heartbeat_goes_out_and_beats_again_once_it_stops(tmp_path):
    """One sign of life a period, not two: the coordinator takes a heartbeat's arrival as the beacon's."""
    with control_plane(tmp_path) as (server, fields):
        ctx = _context(tmp_path, fields)
        plane, alive, beat = ControlPlane(server.table), Keys("t").alive("w0"), Keys("t").heartbeat("w0")

        def counted_over(seconds: float) -> int:
            before = plane.counters([alive])[0]
            time.sleep(seconds)
            return plane.counters([alive])[0] - before

        Beacon(ctx)
        assert counted_over(1.0) >= 1.0 / BEAT_EVERY_S / 2  # no watch: the beacon beats
        watch, _ = _watch(tmp_path, fields, [], Progress(), ctx)
        time.sleep(3 * BEAT_EVERY_S)  # the first heartbeats have gone out
        first = plane.poll(beat, Heartbeat)
        assert counted_over(1.0) <= 3  # ~10 if it beat: it rests (one may slip in behind a heartbeat late under load)
        last = plane.poll(beat, Heartbeat)
        assert first is not None and last is not None and last.beat - first.beat >= 1.0 / BEAT_EVERY_S / 2
        watch.close()
        time.sleep(3 * BEAT_EVERY_S)
        assert counted_over(1.0) >= 1.0 / BEAT_EVERY_S / 2  # the watch closed: the beacon beats again
