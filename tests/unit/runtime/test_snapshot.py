"""Tests for deadpool/runtime/snapshot.py against a real TCPStore: waiting for commits, draining at the end."""

from __future__ import annotations

import time

import pytest
import torch
from tests.plane import control_plane

from deadpool.config import JobConfig
from deadpool.errors import SwapAborted
from deadpool.events import EventLog, read_events
from deadpool.faults.plan import FaultInjector
from deadpool.protocol.keys import Keys
from deadpool.protocol.kinds import Role
from deadpool.protocol.plan import Plan
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Commit
from deadpool.protocol.store import Table
from deadpool.runtime.context import Context, connect
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.plane import PlaneStore
from deadpool.runtime.snapshot import SnapshotEngine
from deadpool.runtime.watch import Watch


@pytest.fixture
def engine(tmp_path):
    """A rank's engine in generation 0 of a one-rank job with no holders, and the store's master."""
    with control_plane(tmp_path) as (server, plane):
        yield from _engine(tmp_path, server.table, plane)


def _engine(tmp_path, master: Table, plane: dict):
    config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane,
                       poll_interval_s=0.01, recovery_timeout_s=1.0, collective_timeout_s=2.0,
                       silence_timeout_s=1.0)
    keys, events = Keys("t"), EventLog(tmp_path / "events.jsonl", role="worker", proc="w0")
    client = connect(config)
    plane = ControlPlane(client)
    ctx = Context("w0", Role.WORKER, config, PlaneStore(client), plane, keys, events,
                  FaultInjector((), plane, keys, events))
    inc = Incarnation.of(Plan(generation=0, ranks=("w0",), holders=((),), spares=()), "w0", keys)
    commit(master, inc, None, [])
    watch = Watch(ctx, inc, None)
    engine = SnapshotEngine(ctx, torch.device("cpu"))
    engine.start(inc, watch)
    yield engine, master, inc
    engine.stop()
    watch.close()


def commit(master: Table, inc: Incarnation, step: int | None, abandoned: list[int]) -> None:
    ControlPlane(master).put(inc.committed_key(), Commit(inc.generation, step, tuple(abandoned)))


def test_wait_committed_returns_once_the_step_or_a_newer_one_is_committed(engine):
    engine, master, inc = engine
    commit(master, inc, 5, [])
    engine.wait_committed(5)
    engine.wait_committed(4)


def test_wait_committed_returns_for_a_step_another_rank_skipped(engine):
    """Under --backlog-policy skip a rank may hold a snapshot the others skipped: it is abandoned, never
    committed, and the end of the run must not wait for it."""
    engine, master, inc = engine
    commit(master, inc, 14, [15, 16])
    started = time.monotonic()
    engine.wait_committed(16)
    assert time.monotonic() - started < 0.5


def test_wait_committed_is_bounded(engine):
    engine, master, inc = engine
    commit(master, inc, 3, [])
    with pytest.raises(SwapAborted, match="snapshot 4 was not committed within 1.0 s"):
        engine.wait_committed(4)


def test_drain_waits_for_the_last_snapshot_to_be_durable_and_committed(engine, tmp_path):
    engine, master, inc = engine
    engine.capture(1, {"model": torch.nn.Linear(4, 4)})
    deadline = time.monotonic() + 5
    while not (master.check([inc.durable_key()]) and b"[1]" in master.get(inc.durable_key())):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    commit(master, inc, 1, [])  # what the coordinator does once every rank reported step 1 durable
    engine.drain()
    assert [s.step for s in engine.slots if s.step is not None] == [1]
    [event] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "snapshot"]
    assert 0 < event["cpu_s"] <= event["total_s"]  # the engine thread's CPU time, within its wall time
