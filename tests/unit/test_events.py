"""Tests for deadpool/events.py: one JSON object per line, and reading back a run's events."""

import json
import os
import time

import pytest

from deadpool.events import EventLog, read_events


@pytest.fixture
def log(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", role="worker", proc="w1")
    yield log
    log.close()


def test_each_event_is_one_json_line_with_identity(log):
    before = time.monotonic()
    first = log.emit("start")
    log.rank, log.generation = 1, 2
    second = log.emit("step", step=3, loss=2.5)
    after = time.monotonic()
    lines = log.path.read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert records == [first, second]
    assert set(records[0]) == {"event", "t", "wall", "role", "proc", "rank", "gen", "pid"}
    assert {k: records[0][k] for k in ("event", "role", "proc", "rank", "gen", "pid")} == {
        "event": "start", "role": "worker", "proc": "w1", "rank": None, "gen": 0, "pid": os.getpid()}
    assert {k: records[1][k] for k in ("event", "rank", "gen", "step", "loss")} == {
        "event": "step", "rank": 1, "gen": 2, "step": 3, "loss": 2.5}
    assert before <= records[0]["t"] <= records[1]["t"] <= after


def test_fields_may_override_the_generation(log):
    log.generation = 1
    assert log.emit("spare_called", gen=2)["gen"] == 2


def test_appends_to_an_existing_file(tmp_path):
    path = tmp_path / "events.jsonl"
    a = EventLog(path, role="coordinator", proc="coord")
    b = EventLog(path, role="spare", proc="s0")
    try:
        a.emit("one")
        b.emit("two")
        a.emit("three")
    finally:
        a.close()
        b.close()
    assert [(e["event"], e["role"], e["proc"]) for e in read_events(path)] == [
        ("one", "coordinator", "coord"), ("two", "spare", "s0"), ("three", "coordinator", "coord")]


def test_close_twice_is_harmless(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", role="worker", proc="w0")
    log.close()
    log.close()
    with pytest.raises(OSError):
        log.emit("after_close")


def test_read_events_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a", "t": 1.0}\n{"event": "b", "t": 2.0}\n{"event": "c", "t"')
    assert list(read_events(path)) == [{"event": "a", "t": 1.0}, {"event": "b", "t": 2.0}]


def test_read_events_of_an_empty_file(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("")
    assert list(read_events(path)) == []
