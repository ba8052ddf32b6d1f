"""Tests for deadpool/protocol/plane.py with a real store server on loopback: typed records in and out, and
waits that honour their deadline and their give-up condition."""

from __future__ import annotations

import threading
import time

import pytest

from deadpool.errors import ProtocolError, StoreTimeout
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Commit, Target
from deadpool.protocol.store import StoreClient, StoreServer

SECRET = bytes(range(32))


@pytest.fixture
def served():
    """A plane on a client of a real server, and a second plane on another client (another process's)."""
    server = StoreServer("127.0.0.1", 0, SECRET)
    clients = [StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5) for _ in range(2)]
    yield ControlPlane(clients[0]), ControlPlane(clients[1])
    for client in clients:
        client.close()
    server.close()


def test_a_record_put_by_one_process_is_read_back_typed_by_another(served):
    writer, reader = served
    assert reader.poll("c", Commit) is None
    writer.put("c", Commit(gen=3, step=7, abandoned=(5,)))
    assert reader.get("c", Commit) == Commit(gen=3, step=7, abandoned=(5,))
    assert reader.poll("c", Commit) == Commit(gen=3, step=7, abandoned=(5,))
    assert reader.poll_all(["c", "none"], Commit) == [Commit(3, 7, (5,)), None]
    assert reader.present(["c", "none"]) == [True, False] and reader.has("c") and not reader.has("none")


def test_a_record_of_the_wrong_kind_or_not_text_is_a_protocol_error_naming_it(served):
    writer, reader = served
    writer.put("c", Commit(gen=3, step=7, abandoned=()))
    with pytest.raises(ProtocolError, match="malformed Target record"):
        reader.get("c", Target)
    writer.store.set("bytes", b"\xff\xfe")
    with pytest.raises(ProtocolError, match="malformed Commit record: not text"):
        reader.poll("bytes", Commit)


def test_a_record_polled_again_unchanged_is_not_parsed_again_and_a_changed_one_is(served):
    writer, reader = served
    writer.put("c", Commit(gen=3, step=7, abandoned=()))
    [first] = reader.poll_all(["c"], Commit)
    [again] = reader.poll_all(["c"], Commit)
    assert again is first  # the same bytes: the record parsed last time
    writer.put("c", Commit(gen=3, step=8, abandoned=()))
    assert reader.poll_all(["c"], Commit) == [Commit(gen=3, step=8, abandoned=())]
    writer.store.set("c", b"\xff")  # a malformed rewrite is refused every time, never served from the cache
    for _ in range(2):
        with pytest.raises(ProtocolError, match="not text"):
            reader.poll_all(["c"], Commit)


def later(delay: float, action) -> threading.Timer:
    """Runs `action` on a thread after `delay`; join it before the test ends (its client closes then)."""
    timer = threading.Timer(delay, action)
    timer.start()
    return timer


def test_get_waits_up_to_its_timeout(served):
    writer, reader = served
    writing = later(0.1, lambda: writer.put("t", Target(1, 4)))
    assert reader.get("t", Target, timeout_s=5.0) == Target(1, 4)
    writing.join()
    with pytest.raises(StoreTimeout):
        reader.get("never", Target, timeout_s=0.1)


def test_counters_count_atomically_and_read_zero_before_the_first(served):
    writer, reader = served
    assert reader.counters(["n", "m"]) == [0, 0]
    assert [writer.count("n") for _ in range(3)] == [1, 2, 3]
    assert reader.count("n", 5) == 8 and reader.counters(["n", "m"]) == [8, 0]


def test_wait_returns_the_first_key_as_soon_as_it_is_written(served):
    writer, reader = served
    writing = later(0.1, lambda: writer.put("abort", Target(0, 0)))
    started = time.monotonic()
    assert reader.wait(["target", "abort"], time.monotonic() + 5.0) == "abort"
    assert time.monotonic() - started < 1.0
    writing.join()


def test_wait_times_out_at_its_deadline(served):
    _, reader = served
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out waiting for never"):
        reader.wait(["never"], started + 0.3)
    assert 0.3 <= time.monotonic() - started < 1.5


def test_wait_gives_up_once_told_well_before_its_deadline(served):
    _, reader = served
    stop = threading.Event()
    later(0.2, stop.set)
    started = time.monotonic()
    with pytest.raises(InterruptedError, match="gave up waiting for never"):
        reader.wait(["never"], started + 60.0, give_up=stop.is_set)
    assert time.monotonic() - started < 1.5


def test_wait_until_reads_a_rewritten_record_until_it_is_done(served):
    writer, reader = served
    writing = [later(delay, lambda s=step: writer.put("c", Commit(0, s, ()))) for step, delay in ((1, 0.05), (2, 0.1),
                                                                                               (3, 0.15))]
    assert reader.wait_until("c", Commit, lambda c: c is not None and c.step == 3, time.monotonic() + 5.0) == \
        Commit(0, 3, ())
    for timer in writing:
        timer.join()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.wait_until("c", Commit, lambda c: False, started + 0.2)
    with pytest.raises(InterruptedError):
        reader.wait_until("c", Commit, lambda c: False, started + 60.0, give_up=lambda: True)
    assert time.monotonic() - started < 1.5
