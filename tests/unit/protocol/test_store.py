"""Tests for deadpool/protocol/store.py and wire.py over real sockets: TCPStore's calls, and strangers refused."""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool.errors import AuthenticationError, ControlPlaneError, StoreTimeout
from deadpool.protocol import store as store_module
from deadpool.protocol import wire
from deadpool.protocol.store import StoreClient, StoreServer, Table

SECRET = bytes(range(32))


@pytest.fixture
def server():
    refused: list[tuple[str, str]] = []
    srv = StoreServer("127.0.0.1", 0, SECRET, on_refused=lambda peer, why: refused.append((peer, why)))
    srv.refused = refused  # type: ignore[attr-defined]
    yield srv
    srv.close()


def wait_refusals(server: StoreServer, n: int) -> list[tuple[str, str]]:
    deadline = time.monotonic() + 10
    while len(server.refused) < n and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)
    return server.refused  # type: ignore[attr-defined]


def test_the_calls_of_tcpstore_with_its_semantics(server):
    client = StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5)
    client.set("a", "1")
    client.set("b", b"\x00\xff")
    assert client.get("a") == b"1" and client.get("b") == b"\x00\xff"
    assert client.multi_get(["a", "b"]) == [b"1", b"\x00\xff"]
    assert client.add("n", 2) == 2 and client.add("n", 3) == 5 and client.get("n") == b"5"
    assert client.check(["a", "b"]) and not client.check(["a", "missing"])
    assert client.compare_set("c", "", "first") == b"first"     # absent and nothing expected: set
    assert client.compare_set("c", "other", "second") == b"first"  # a wrong expectation changes nothing
    assert client.compare_set("c", "first", "second") == b"second"
    assert client.delete_key("c") and not client.delete_key("c")
    assert client.num_keys() == server.table.num_keys() == 3
    client.close()


def test_get_and_wait_block_until_the_key_appears_and_time_out_otherwise(server):
    client = StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5)
    threading.Timer(0.2, lambda: server.table.set("later", "x")).start()
    assert client.get("later") == b"x"
    with pytest.raises(StoreTimeout):
        client.wait(["never"], timedelta(seconds=0.2))
    with pytest.raises(StoreTimeout):
        client.get("never", 0.2)
    client.set("after", "1")  # the connection survives a timeout
    assert client.get("after") == b"1"
    client.close()


def test_a_wrong_secret_is_refused_on_both_sides(server):
    with pytest.raises(AuthenticationError, match="refused this process's secret"):
        StoreClient("127.0.0.1", server.port, b"x" * 32, timeout_s=5)
    [(_, why)] = wait_refusals(server, 1)
    assert why == "the client does not hold the job's secret"
    assert server.table.num_keys() == 0


def test_a_server_without_the_secret_is_not_trusted():
    impostor = StoreServer("127.0.0.1", 0, b"y" * 32)
    try:
        with pytest.raises(AuthenticationError):
            StoreClient("127.0.0.1", impostor.port, SECRET, timeout_s=5)
    finally:
        impostor.close()


def test_a_plain_tcpstore_client_can_neither_read_nor_write(server):
    server.table.set("deadpool/job", "{}")
    with pytest.raises(dist.DistError):
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2)).get("deadpool/job")
    assert wait_refusals(server, 1)[0][1].startswith("no valid handshake")
    assert server.table.num_keys() == 1


def closed_without_answer(sock: socket.socket) -> bool:
    """The server hung up: an orderly close, or a reset when our unread bytes were still in its buffer."""
    sock.settimeout(10)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


class Recorder:
    """A man in the middle: forwards one client's bytes to the server and keeps a copy of them."""

    def __init__(self, server_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.server_port, self.sent = self.listener.getsockname()[1], server_port, bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        self.upstream = socket.create_connection(("127.0.0.1", self.server_port))
        threading.Thread(target=self._pump, args=(self.upstream, client, None), daemon=True).start()
        self._pump(client, self.upstream, self.sent)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, copy: bytearray | None) -> None:
        while data := src.recv(65536):
            if copy is not None:
                copy += data
            dst.sendall(data)


def test_captured_messages_are_worthless_on_a_new_connection_and_on_the_same_one(server):
    recorder = Recorder(server.port)
    client = StoreClient("127.0.0.1", recorder.port, SECRET, timeout_s=5)
    client.set("legit", "1")
    captured = bytes(recorder.sent)  # the client's proof, then its one request frame
    proof, frame = captured[:wire.NONCE + wire.MAC], captured[wire.NONCE + wire.MAC:]
    # played on a connection of its own: the server's new nonce makes the old proof wrong
    with socket.create_connection(("127.0.0.1", server.port)) as rogue:
        rogue.recv(len(wire.HELLO) + wire.NONCE)
        rogue.sendall(proof + frame)
        assert closed_without_answer(rogue)
    # played again on the legitimate connection: its sequence number is spent
    recorder.upstream.sendall(frame)
    refusals = [why for _, why in wait_refusals(server, 2)]
    assert refusals == ["the client does not hold the job's secret",
                        "frame 1 arrived where 2 was due (replayed or reordered)"]
    assert server.table.data == {"legit": b"1"}  # written once


def test_a_forged_or_oversized_frame_closes_the_connection(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        channel = wire.connect(sock, SECRET)
        body = struct.pack("!Q", 1) + b"S" + b"\x00" * 8 + b"\x00" * wire.MAC  # a MAC made without the session key
        sock.sendall(struct.pack("!I", len(body)) + body)
        assert closed_without_answer(sock)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        channel = wire.connect(sock, SECRET)
        sock.sendall(struct.pack("!I", wire.MAX_FRAME + 1))
        assert closed_without_answer(sock)
    del channel
    assert [why for _, why in wait_refusals(server, 2)] == [
        "a frame's MAC is wrong (forged, or from another connection)",
        f"a frame of {wire.MAX_FRAME + 1} bytes is not a frame of this protocol"]


def test_a_connection_that_never_proves_itself_is_dropped_after_the_handshake_time(server, monkeypatch):
    monkeypatch.setattr(store_module, "HANDSHAKE_S", 0.3)
    with socket.create_connection(("127.0.0.1", server.port)) as silent:  # connects, says nothing
        started = time.monotonic()
        silent.settimeout(10)
        while silent.recv(100):  # the server's challenge, then the close
            pass
        assert 0.25 < time.monotonic() - started < 5
        client = StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5)  # others are served meanwhile
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    [(peer, why)] = wait_refusals(server, 1)
    assert peer.startswith("127.0.0.1:") and why.startswith("no valid handshake (") and "timed out" in why


def test_the_server_listens_only_on_its_address_and_says_when_the_port_is_taken(server):
    assert server.listener.getsockname()[0] == "127.0.0.1"
    with pytest.raises(OSError):
        StoreServer("127.0.0.1", server.port, SECRET)


def test_a_lost_server_is_a_control_plane_error():
    srv = StoreServer("127.0.0.1", 0, SECRET)
    client = StoreClient("127.0.0.1", srv.port, SECRET, timeout_s=5)
    srv.close()
    with pytest.raises(ControlPlaneError):
        client.set("a", "1")


def test_closing_the_server_releases_a_blocked_wait():
    srv = StoreServer("127.0.0.1", 0, SECRET)
    client = StoreClient("127.0.0.1", srv.port, SECRET, timeout_s=30)
    threading.Timer(0.2, srv.close).start()
    started = time.monotonic()
    with pytest.raises(ControlPlaneError):
        client.wait(["never"], timedelta(seconds=30))
    assert time.monotonic() - started < 10  # released by the close, not by its 30 s timeout


def test_peek_reads_what_exists_in_one_call_and_never_blocks(server):
    client = StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5)
    client.set("a", b"")
    client.set("b", b"\x00\xff")
    assert client.peek(["a", "missing", "b"]) == [b"", None, b"\x00\xff"]
    assert client.peek([]) == []
    client.close()


def test_wait_any_returns_the_first_key_that_exists_and_none_at_its_timeout(server):
    client = StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5)
    threading.Timer(0.1, lambda: server.table.set("late", "1")).start()
    started = time.monotonic()
    assert client.wait_any(["never", "late"], 5.0) == "late"
    assert time.monotonic() - started < 2.0  # woken by the write, not at the timeout
    server.table.set("early", "1")
    assert client.wait_any(["late", "early"], 1.0) == "late"  # the first of the keys, in their order
    started = time.monotonic()
    assert client.wait_any(["never"], 0.2) is None
    assert 0.2 <= time.monotonic() - started < 2.0
    client.close()


def test_only_the_creation_of_a_waited_key_wakes_its_waiter():
    """Every wait is for keys to exist: rewriting a key (a heartbeat, a counter, a record moving on) must not
    wake the server's blocked threads, nor must the creation of a key they do not wait for; the creation of
    theirs, by any call, must."""
    table = Table()
    found: list[str | None] = []
    waiter = threading.Thread(target=lambda: found.append(table.wait_any(["new", "other"], 10.0)))
    waiter.start()
    deadline = time.monotonic() + 5.0
    while "new" not in table.waiters and time.monotonic() < deadline:
        time.sleep(0.001)
    [event] = table.waiters["new"]
    table.set("hb", b"1")
    table.add("count", 1)
    table.compare_set("cas", b"", b"x")
    for _ in range(5):
        table.set("hb", b"2")
        table.add("count", 1)
        table.compare_set("cas", b"x", b"y")
    assert not event.is_set() and waiter.is_alive()  # three other keys created, fifteen rewrites: not woken
    table.add("new", 1)
    waiter.join(5.0)
    assert event.is_set() and found == ["new"]
    assert table.waiters == {}  # a finished wait leaves nothing registered


def test_a_wait_for_several_keys_ends_once_the_last_of_them_is_created():
    table = Table()
    done: list[bool] = []
    waiter = threading.Thread(target=lambda: done.append(table.wait(["a", "b", "c"], 10.0)))
    waiter.start()
    for key in "abc":
        time.sleep(0.02)
        assert waiter.is_alive()
        table.set(key, b"")
    waiter.join(5.0)
    assert done == [True] and table.waiters == {}


def test_the_table_dates_every_write_and_names_its_key_to_its_host():
    """The coordinator beside the store dates heartbeats by their arrival and is woken by the reports it waits
    on: every write (set, add, compare_set) stamps its key and is passed to on_write; a delete forgets it."""
    table, written = Table(), []
    table.on_write = written.append
    before = time.monotonic()
    table.set("a", b"1")
    table.add("b", 1)
    table.compare_set("c", b"", b"x")
    after = time.monotonic()
    assert written == ["a", "b", "c"]
    stamps = table.arrivals(["a", "b", "c", "never"])
    assert all(before <= t <= after for t in stamps[:3]) and stamps[3] is None
    time.sleep(0.01)
    table.set("a", b"2")
    assert table.arrivals(["a"])[0] > stamps[0]  # a rewrite is a new arrival
    table.delete_key("a")
    assert table.arrivals(["a"]) == [None] and written == ["a", "b", "c", "a"]
