"""A replica stream's connection: one TCP socket from a snapshot's sender to its holder, opened with the job's
secret, carrying authenticated frames for what steers the stream and raw bytes for the snapshot itself.

    sender (a rank; a holder handing a rank over)         receiver (its holder; the taker)
    listens on this machine's job interface, port 0
    Listening(gen, host, port) at {stream}addr   ------>  waits for the key (giving up when told to stop)
    accept + wire.accept: mutual proof of the     <----->  connect + wire.connect
      job's secret; anyone else is refused and
      the sender listens on until its deadline
                                                  <------  its machine (arena.machine), a frame
    header frames and acknowledgments: wire.Channel frames (each MAC'd, in sequence, never replayable)
    a snapshot's bytes: raw, covered by the digest its MAC'd header carries (the holder recomputes it);
      to a holder on the same machine, only where the sender's arena is (the holder maps it: arena.py)

Why not a two-process gloo group, as before: a gloo send and receive of 9.6 MB took 2.6 ms of CPU at the
two ends against 1.6 ms over a plain socket (2 cores, loopback), each process's gloo device woke every
10 ms, idle or not, and an idle holder could not wait on the group, so each snapshot was announced through
the store first. A socket wakes its idle holder itself, and its peer has proven it belongs to the job.
The key is derived from the job's secret for streams alone, so a stream's handshake is never valid on the
control plane, nor the reverse.
"""

from __future__ import annotations

import hashlib
import hmac
import select
import socket
import time
from typing import Callable

import torch

from deadpool.errors import AuthenticationError, ProtocolError
from deadpool.launcher.address import listen_address
from deadpool.protocol import wire
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Listening
from deadpool.runtime.arena import machine

HELLO = b"DEADPOOL-STREAM1"  # as long as the control plane's: a stream is never taken for the store
HANDSHAKE_S = 5.0  # a peer that has not proven itself by then is dropped, and the sender listens on
ACCEPT_SLICE_S = 0.25  # how often a listening sender asks whether to give up


def stream_key(secret: bytes) -> bytes:
    """The key replica streams authenticate with, derived from the job's secret."""
    return hmac.new(secret, b"deadpool replica stream", hashlib.sha256).digest()


class StreamClosed(ConnectionError):
    """The other end closed the stream between two messages: its generation or the job ended, or it died."""


class Stream:
    """One end of an open replica stream. Every call but `wait_readable` times out after `timeout_s`."""

    def __init__(self, channel: wire.Channel, timeout_s: float, local: bool = False) -> None:
        self.channel, self.sock = channel, channel.sock
        self.local = local  # the peer is on this machine (arena.machine): it can map this process's arenas
        self.sock.settimeout(timeout_s)
        # a header, then the data: without this, Nagle holds the data's last segment until the header is
        # acknowledged, and the receiver delays that acknowledgement by up to 40 ms
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_frame(self, payload: bytes) -> None:
        self.channel.send(payload)

    def recv_frame(self) -> bytes:
        return self.channel.recv()

    def send_bytes(self, data: torch.Tensor) -> None:
        """Sends a contiguous uint8 CPU tensor's bytes as they are (the kernel copies them, no Python copy)."""
        self.sock.sendall(data.numpy().data)

    def recv_bytes(self, data: torch.Tensor, landed: Callable[[memoryview], None] = lambda _: None,
                   chunk: int = 1 << 62) -> None:
        """Fills a contiguous uint8 CPU tensor from the stream, in place, handing each `chunk` bytes to
        `landed` as soon as they are in (a holder hashes them then, while they are still in cache)."""
        view, got, fed = data.numpy().data, 0, 0
        while got < len(view):
            n = self.sock.recv_into(view[got: min(len(view), fed + chunk)])
            if not n:
                raise ConnectionError("the sender closed the replica stream in the middle of a snapshot")
            got += n
            if got - fed >= chunk or got == len(view):
                landed(view[fed:got])
                fed = got

    def wait_readable(self, stopped: Callable[[], bool], slice_s: float) -> None:
        """Idle: returns once the peer starts to send; StreamClosed if it closes the stream instead,
        InterruptedError once `stopped()`, asked every `slice_s` (`interrupt` from another thread ends the
        wait at once)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while not poller.poll(slice_s * 1000):
            if stopped():
                raise InterruptedError("stopped while waiting for the next snapshot")
        if not self.sock.recv(1, socket.MSG_PEEK):
            raise StreamClosed("the other end closed the replica stream")

    def interrupt(self) -> None:
        """From another thread: ends any wait or transfer on this stream at once (the owner then closes it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def close(self) -> None:
        self.sock.close()


def offer(plane: ControlPlane, prefix: str, secret: bytes, gen: int, timeout_s: float,
          stopped: Callable[[], bool] = lambda: False, refused: Callable[[str], None] = lambda why: None) -> Stream:
    """The sender's end: listens, publishes where, and returns the first connection whose peer proves the
    job's secret within `timeout_s`. Others are closed and reported to `refused`. TimeoutError when no peer
    came in time, InterruptedError once `stopped()`."""
    host = listen_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + timeout_s
    with socket.create_server((host, 0), family=family) as listener:
        plane.put(Keys.listening(prefix), Listening(gen, host, listener.getsockname()[1]))
        while True:
            left = deadline - time.monotonic()
            if stopped():
                raise InterruptedError(f"stopped while waiting for the other end of {prefix}")
            if left <= 0:
                raise TimeoutError(f"no holder connected to the replica stream {prefix} within {timeout_s:g} s")
            listener.settimeout(min(left, ACCEPT_SLICE_S))
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(min(HANDSHAKE_S, timeout_s))
            try:
                channel = wire.accept(sock, stream_key(secret), HELLO)
                return Stream(channel, timeout_s, local=channel.recv() == machine())
            except (AuthenticationError, OSError) as error:
                sock.close()
                refused(f"{peer[0]}:{peer[1]}: {error}")


def join(plane: ControlPlane, prefix: str, secret: bytes, gen: int, timeout_s: float,
         stopped: Callable[[], bool] = lambda: False) -> Stream:
    """The receiver's end: waits (up to `timeout_s`, giving up once `stopped()`) for the sender to listen,
    connects and proves the job's secret, as the sender must."""
    deadline = time.monotonic() + timeout_s
    plane.wait([Keys.listening(prefix)], deadline, give_up=stopped)
    where = plane.get(Keys.listening(prefix), Listening)
    if where.gen != gen:
        raise ProtocolError(f"the replica stream {prefix} belongs to generation {where.gen}, not {gen}")
    sock = socket.create_connection((where.host, where.port), timeout=max(0.1, deadline - time.monotonic()))
    try:
        channel = wire.connect(sock, stream_key(secret), HELLO, peer="the replica stream's sender")
        channel.send(machine())  # which machine this end is on: the sender's arenas are mapped, not sent, on its own
        return Stream(channel, timeout_s)
    except BaseException:
        sock.close()
        raise
