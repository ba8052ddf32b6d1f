"""One authenticated connection: a mutual HMAC-SHA256 challenge-response, then frames that each carry a MAC.

    client                                           server
      <------------------------------------------    HELLO + nonce_s
      nonce_c + HMAC(K, "client" | nonce_s | nonce_c) -->   checked, else refused and logged
      <------------------------------------------    HMAC(K, "server" | nonce_c | nonce_s)   (client checks)
      session key S = HMAC(K, "session" | nonce_s | nonce_c)
      [seq | payload | HMAC(S, dir | seq | payload)] -->   seq must be last + 1: a replayed, reordered or
      <--  [seq | reply  | HMAC(S, dir | seq | reply)]      forged frame closes the connection

The job's secret K never crosses the wire, in clear or otherwise; a frame captured on one connection is
worthless on another (its session key differs) and cannot be played twice on the same one (its sequence
number is spent). Frames are not encrypted: what the store holds (plans, reports) is not secret, the
secret is.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from deadpool.errors import AuthenticationError, ControlPlaneError

HELLO = b"DEADPOOL-PLANE-1"
NONCE = 32
MAC = 32
MAX_FRAME = 64 << 20  # a plan or a rendezvous address is tiny; anything near this is not ours
_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Channel:
    """A socket after the handshake: send() and recv() whole frames, each authenticated and in sequence."""

    def __init__(self, sock: socket.socket, session: bytes, outgoing: bytes, incoming: bytes) -> None:
        self.sock, self.session = sock, session
        self.outgoing, self.incoming = outgoing, incoming  # direction tags: a reply is never taken for a request
        self.sent = self.received = 0

    def send(self, payload: bytes) -> None:
        self.sent += 1
        seq = _SEQ.pack(self.sent)
        body = seq + payload + _mac(self.session, self.outgoing, seq, payload)
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def recv(self) -> bytes:
        (size,) = _LEN.unpack(_read_exactly(self.sock, _LEN.size))
        if not _SEQ.size + MAC <= size <= MAX_FRAME:
            raise AuthenticationError(f"a frame of {size} bytes is not a frame of this protocol")
        body = _read_exactly(self.sock, size)
        seq, payload, tag = body[:_SEQ.size], body[_SEQ.size:-MAC], body[-MAC:]
        if not hmac.compare_digest(tag, _mac(self.session, self.incoming, seq, payload)):
            raise AuthenticationError("a frame's MAC is wrong (forged, or from another connection)")
        (number,) = _SEQ.unpack(seq)
        if number != self.received + 1:
            raise AuthenticationError(f"frame {number} arrived where {self.received + 1} was due (replayed or "
                                      "reordered)")
        self.received = number
        return payload

    def close(self) -> None:
        self.sock.close()


def accept(sock: socket.socket, secret: bytes, hello: bytes = HELLO) -> Channel:
    """The server's side of the handshake; AuthenticationError when the client does not hold the secret.
    `hello` names the protocol (the control plane's, or a replica stream's: runtime/stream.py)."""
    nonce_s = os.urandom(NONCE)
    sock.sendall(hello + nonce_s)
    answer = _read_exactly(sock, NONCE + MAC)
    nonce_c, proof = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", nonce_s, nonce_c)):
        raise AuthenticationError("the client does not hold the job's secret")
    sock.sendall(_mac(secret, b"server", nonce_c, nonce_s))
    return Channel(sock, _mac(secret, b"session", nonce_s, nonce_c), outgoing=b"r", incoming=b"q")


def connect(sock: socket.socket, secret: bytes, hello: bytes = HELLO, peer: str = "the coordinator") -> Channel:
    """The client's side of the handshake; AuthenticationError when the server (`peer`) does not hold the
    secret."""
    greeting = _read_exactly(sock, len(hello) + NONCE)
    if not greeting.startswith(hello):
        raise ControlPlaneError(f"the address does not speak DeadPool's protocol (expected {hello.decode()})")
    nonce_s, nonce_c = greeting[len(hello):], os.urandom(NONCE)
    sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
    try:
        proof = _read_exactly(sock, MAC)
    except ConnectionError:
        raise AuthenticationError(f"{peer} refused this process's secret (a secret of another job?)") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
        raise AuthenticationError(f"{peer} could not prove that it holds the job's secret")
    return Channel(sock, _mac(secret, b"session", nonce_s, nonce_c), outgoing=b"q", incoming=b"r")
