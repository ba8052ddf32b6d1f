"""Tests for deadpool/runtime/stream.py over real sockets and a real store: a replica stream opens only
between processes that prove the job's secret, listens on loopback where told, and every wait ends."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from tests.plane import control_plane

from deadpool.config import JobConfig
from deadpool.errors import AuthenticationError, ProtocolError
from deadpool.protocol import wire
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Listening
from deadpool.protocol.secret import new_secret, read_secret
from deadpool.runtime import stream
from deadpool.runtime.context import connect


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture
def job(tmp_path):
    with control_plane(tmp_path) as (_, fields):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **fields)
        yield ControlPlane(connect(config)), read_secret(config.secret_file), config


def offered(plane: ControlPlane, secret: bytes, timeout_s: float = 20, **kw) -> tuple[threading.Thread, list]:
    """The sender's end, opened in a thread: [Stream] once a peer got through, [error] if none did."""
    out: list = []

    def run() -> None:
        try:
            out.append(stream.offer(plane, "pair/", secret, 0, timeout_s, **kw))
        except BaseException as error:
            out.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_stream_listens_on_loopback_and_carries_frames_and_bytes_handed_over_chunk_by_chunk(job):
    plane, secret, config = job
    thread, out = offered(plane, secret)
    receiver = stream.join(ControlPlane(connect(config)), "pair/", secret, 0, timeout_s=20)
    thread.join(20)
    [sender] = out
    assert plane.get(Keys.listening("pair/"), Listening).host == "127.0.0.1"
    data = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)  # more than the socket buffers hold
    sending = threading.Thread(target=lambda: (sender.send_frame(b"header"), sender.send_bytes(data)))
    sending.start()
    got, pieces = torch.empty_like(data), []
    assert receiver.recv_frame() == b"header"
    receiver.recv_bytes(got, lambda piece: pieces.append(bytes(piece)), chunk=300_000)  # 4 MiB: 14 pieces, 1 short
    sending.join(20)
    assert torch.equal(got, data)
    assert [len(p) for p in pieces] == [300_000] * 13 + [len(data) - 13 * 300_000]  # each handed over once, whole
    assert b"".join(pieces) == data.numpy().tobytes()
    receiver.send_frame(b"ack")
    assert sender.recv_frame() == b"ack"
    sender.close()
    receiver.close()


def test_a_peer_without_the_secret_is_refused_and_the_sender_waits_for_the_real_one(job):
    plane, secret, config = job
    refused: list[str] = []
    thread, out = offered(plane, secret, refused=refused.append)
    plane.wait([Keys.listening("pair/")], time.monotonic() + 10)
    where = plane.get(Keys.listening("pair/"), Listening)
    with socket.create_connection((where.host, where.port), timeout=5) as rogue:
        with pytest.raises(AuthenticationError):
            wire.connect(rogue, stream.stream_key(new_secret()), stream.HELLO)
    with socket.create_connection((where.host, where.port), timeout=5) as plane_client:  # the store's key
        with pytest.raises(AuthenticationError):
            wire.connect(plane_client, secret, stream.HELLO)
    receiver = stream.join(ControlPlane(connect(config)), "pair/", secret, 0, timeout_s=20)
    thread.join(20)
    [sender] = out
    assert len(refused) == 2 and all("secret" in why for why in refused)
    sender.send_frame(b"ok")
    assert receiver.recv_frame() == b"ok"


def test_a_silent_peer_is_dropped_after_the_handshake_time(job, monkeypatch):
    monkeypatch.setattr(stream, "HANDSHAKE_S", 0.3)
    plane, secret, config = job
    thread, out = offered(plane, secret)
    plane.wait([Keys.listening("pair/")], time.monotonic() + 10)
    where = plane.get(Keys.listening("pair/"), Listening)
    with socket.create_connection((where.host, where.port), timeout=5):  # connects, says nothing
        receiver = stream.join(ControlPlane(connect(config)), "pair/", secret, 0, timeout_s=20)
    thread.join(20)
    assert isinstance(out[0], stream.Stream)
    receiver.close()


def test_a_sender_gives_up_at_its_deadline_or_when_stopped(job):
    plane, secret, _ = job
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        stream.offer(plane, "pair/", secret, 0, timeout_s=0.3)
    assert time.monotonic() - started < 3
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(InterruptedError):
        stream.offer(plane, "late/", secret, 0, timeout_s=60, stopped=stop.is_set)
    assert time.monotonic() - started < 5


def test_a_receiver_refuses_a_stream_of_another_generation(job):
    plane, secret, config = job
    plane.put(Keys.listening("old/"), Listening(3, "127.0.0.1", 1))
    with pytest.raises(ProtocolError, match="generation 3"):
        stream.join(ControlPlane(connect(config)), "old/", secret, 4, timeout_s=5)


def test_interrupt_ends_an_idle_wait_at_once(job):
    """What stops a holder's receiver: its idle wait (30 s slices here) ends the moment it is interrupted."""
    plane, secret, config = job
    thread, out = offered(plane, secret)
    receiver = stream.join(ControlPlane(connect(config)), "pair/", secret, 0, timeout_s=20)
    thread.join(20)
    woke: list[float] = []

    def idle() -> None:
        with pytest.raises(stream.StreamClosed):
            receiver.wait_readable(lambda: False, slice_s=30)  # only the interrupt can end it in time
        woke.append(time.monotonic())

    waiter = threading.Thread(target=idle)
    waiter.start()
    time.sleep(0.2)
    asked = time.monotonic()
    receiver.interrupt()
    waiter.join(5)
    assert woke and woke[0] - asked < 1
    with pytest.raises(OSError):
        receiver.recv_frame()
    out[0].close()


def test_a_stream_closed_between_messages_is_told_apart_from_one_cut_mid_message(job):
    """A sender closing between snapshots (its generation ended) is StreamClosed; one that vanishes in the
    middle of a snapshot's bytes is a plain ConnectionError: the holder reports only the second."""
    plane, secret, config = job
    thread, out = offered(plane, secret)
    receiver = stream.join(ControlPlane(connect(config)), "pair/", secret, 0, timeout_s=20)
    thread.join(20)
    sender = out[0]
    sender.send_frame(b"header")
    sender.send_bytes(torch.zeros(10, dtype=torch.uint8))
    sender.close()
    receiver.wait_readable(lambda: False, slice_s=1)
    assert receiver.recv_frame() == b"header"
    with pytest.raises(ConnectionError) as cut:
        receiver.recv_bytes(torch.empty(100, dtype=torch.uint8))
    assert not isinstance(cut.value, stream.StreamClosed)
    with pytest.raises(stream.StreamClosed):
        receiver.wait_readable(lambda: False, slice_s=1)
