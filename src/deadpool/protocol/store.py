"""The coordinator's key-value store, reachable only with the job's secret: a server, a client, a local view.

It offers what torch's TCPStore offers (set, get, add, check, wait, compare_set, delete_key, num_keys,
multi_get, with the same blocking `get`), so gloo's rendezvous (through runtime/plane.py's adapter) uses it
unchanged, and two calls of its own for DeadPool's ControlPlane (protocol/plane.py): `peek` (the keys that
exist, in one round trip) and `wait_any` (blocks until the first of some keys exists). Unlike TCPStore it
listens only on the address it is given, and every connection must first prove that it holds the secret
(protocol/wire.py); a refused one is reported through `on_refused` and closed. Values are bytes; nothing is
ever unpickled.

    request  = op (1 byte) + fields,  each field = length (u32) + bytes
    reply    = status (K ok, T timed out, E error) + fields
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable

from deadpool.errors import AuthenticationError, ControlPlaneError, StoreTimeout
from deadpool.protocol import wire

HANDSHAKE_S = 5.0  # a client that has not proven itself by then is dropped
_U32 = struct.Struct("!I")


def _pack(*fields: bytes) -> bytes:
    return b"".join(_U32.pack(len(f)) + f for f in fields)


def _unpack(data: bytes) -> list[bytes]:
    fields, at = [], 0
    while at < len(data):
        if at + _U32.size > len(data):
            raise ControlPlaneError("a truncated field")
        (size,) = _U32.unpack_from(data, at)
        at += _U32.size
        if at + size > len(data):
            raise ControlPlaneError("a truncated field")
        fields.append(data[at:at + size])
        at += size
    return fields


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class Table:
    """The store's contents, and the blocked calls waiting for keys to exist. Every wait is for keys to
    exist, so only a key's creation wakes a waiter, and only the waiters of that key: rewriting a key
    (heartbeats, counters, records that move on) wakes nobody, and a new key wakes no thread waiting for
    another (a busy job keeps a dozen server threads blocked: each wake-up costs its GIL)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.written: dict[str, float] = {}  # key -> when it was last set or added to (time.monotonic)
        self.lock = threading.Lock()
        self.waiters: dict[str, set[threading.Event]] = {}  # key -> the blocked calls it would wake
        # Called with every written key, under the lock (so it must be quick and never call the table): the
        # coordinator's wake-up (coordinator/server.py).
        self.on_write: Callable[[str], None] = lambda key: None
        self.closed = False

    def close(self) -> None:
        """Releases every call blocked in a wait (each raises): the job is over, no key will come."""
        with self.lock:
            self.closed = True
            for events in self.waiters.values():
                for event in events:
                    event.set()

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self._put(key, _bytes(value))

    def _put(self, key: str, value: bytes) -> None:
        """Stores `value` (the caller holds the lock); wakes the calls waiting for `key` if it is new."""
        if key not in self.data:
            for event in self.waiters.pop(key, ()):
                event.set()
        self.data[key] = value
        self.written[key] = time.monotonic()
        self.on_write(key)

    def _block(self, keys: list[str], ready: Callable[[], bool], timeout_s: float) -> bool:
        """Waits until `ready()` (asked under the lock) or `timeout_s`; woken only by the creation of one of
        `keys` (or the store's close, which raises)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if self.closed:
                    raise ControlPlaneError("the coordinator's store is closing: the job is over")
                if ready():
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                event = threading.Event()
                for key in keys:
                    self.waiters.setdefault(key, set()).add(event)
            event.wait(remaining)
            with self.lock:
                for key in keys:
                    waiting = self.waiters.get(key)
                    if waiting is not None:
                        waiting.discard(event)
                        if not waiting:
                            del self.waiters[key]

    def wait(self, keys: Iterable[str], timeout: timedelta | float | None = None) -> bool:
        """True once every key exists, False at the timeout (None: the default of 300 s, as torch's)."""
        keys = list(keys)
        return self._block(keys, lambda: all(k in self.data for k in keys), _seconds(timeout, 300.0))

    def wait_any(self, keys: list[str], timeout: float) -> str | None:
        """The first of `keys` that exists, once one does; None at the timeout."""
        found: list[str] = []

        def ready() -> bool:
            found[:] = [k for k in keys if k in self.data][:1]
            return bool(found)

        self._block(keys, ready, timeout)
        return found[0] if found else None

    def peek(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, None for those that do not exist; never blocks."""
        with self.lock:
            return [self.data.get(k) for k in keys]

    def arrivals(self, keys: list[str]) -> list[float | None]:
        """When each key was last written, on this process's monotonic clock (None: it does not exist). Only
        the process that hosts the store has this: its coordinator times heartbeats by when they arrived."""
        with self.lock:
            return [self.written.get(k) for k in keys]

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        if not self.wait([key], timeout):
            raise StoreTimeout(f"timed out waiting for key {key!r}")
        with self.lock:
            return self.data[key]

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        if not self.wait(keys, timeout):
            raise StoreTimeout(f"timed out waiting for keys {keys!r}")
        with self.lock:
            return [self.data[k] for k in keys]

    def add(self, key: str, delta: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + delta
            self._put(key, str(value).encode())
            return value

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """As TCPStore's: sets `desired` if the key holds `expected` (or is absent and `expected` is empty)."""
        with self.lock:
            current = self.data.get(key)
            if current == _bytes(expected) or (current is None and not _bytes(expected)):
                current = _bytes(desired)
                self._put(key, current)
            return _bytes(expected) if current is None else current

    def delete_key(self, key: str) -> bool:
        with self.lock:
            self.written.pop(key, None)
            return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self.lock:
            return len(self.data)


class StoreServer:
    """Listens on exactly (host, port), one thread per authenticated connection; close() ends them all."""

    def __init__(self, host: str, port: int, secret: bytes,
                 on_refused: Callable[[str, str], None] = lambda peer, why: None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=256)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.secret, self.on_refused = secret, on_refused
        self.table = Table()
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, name="deadpool-store", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stops listening and drops every connection (their threads end on the closed sockets)."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.table.close()
        with self.lock:
            for sock in self.connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.thread.join(5.0)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:  # closed
                return
            with self.lock:
                self.connections.add(sock)
            threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"), name="deadpool-store-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        stage = "handshake"
        try:
            sock.settimeout(HANDSHAKE_S)
            channel = wire.accept(sock, self.secret)
            sock.settimeout(None)
            stage = "session"
            while True:
                channel.send(self._handle(channel.recv()))
        except AuthenticationError as error:
            self.on_refused(peer, str(error))
        except (OSError, ControlPlaneError) as error:
            if stage == "handshake":  # never proved itself: a scanner, a plain TCPStore client, a wrong protocol
                self.on_refused(peer, f"no valid handshake ({type(error).__name__}: {error})")
        finally:
            with self.lock:
                self.connections.discard(sock)
            sock.close()

    def _handle(self, request: bytes) -> bytes:
        if not request:
            raise ControlPlaneError("an empty request")
        op, fields = request[:1], _unpack(request[1:])
        try:
            return b"K" + self._apply(op, fields)
        except StoreTimeout as error:
            return b"T" + _pack(str(error).encode())
        except (ControlPlaneError, ValueError, IndexError, UnicodeDecodeError) as error:  # malformed, yet authentic
            return b"E" + _pack(f"{type(error).__name__}: {error}".encode())

    def _apply(self, op: bytes, f: list[bytes]) -> bytes:
        table = self.table
        if op == b"S":  # key, value
            table.set(f[0].decode(), f[1])
            return b""
        if op == b"G":
            return _pack(table.get(f[1].decode(), float(f[0])))
        if op == b"M":
            return _pack(*table.multi_get([k.decode() for k in f[1:]], float(f[0])))
        if op == b"A":
            return _pack(str(table.add(f[0].decode(), int(f[1]))).encode())
        if op == b"C":
            return _pack(b"1" if table.check([k.decode() for k in f]) else b"0")
        if op == b"W":
            if not table.wait([k.decode() for k in f[1:]], float(f[0])):
                raise StoreTimeout(f"timed out waiting for keys {[k.decode() for k in f[1:]]}")
            return b""
        if op == b"X":
            return _pack(table.compare_set(f[0].decode(), f[1], f[2]))
        if op == b"D":
            return _pack(b"1" if table.delete_key(f[0].decode()) else b"0")
        if op == b"N":
            return _pack(str(table.num_keys()).encode())
        if op == b"P":  # each key as a presence byte and its value
            return _pack(*(part for v in table.peek([k.decode() for k in f]) for part in (
                (b"0", b"") if v is None else (b"1", v))))
        if op == b"Y":
            found = table.wait_any([k.decode() for k in f[1:]], float(f[0]))
            return _pack(*(() if found is None else (found.encode(),)))
        raise ControlPlaneError(f"unknown operation {op!r}")


class StoreClient:
    """A connection to the store that has proven it holds the secret. Safe to share between threads (one call
    at a time), though a thread that blocks in `wait` should have its own, as with TCPStore."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float = 60.0) -> None:
        self.address, self.port, self.timeout_s = f"{host}:{port}", port, timeout_s
        self.lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        while True:  # the coordinator may not be listening yet
            try:
                sock = socket.create_connection((host, port), timeout=min(timeout_s, 10.0))
                break
            except OSError as error:
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"cannot reach the coordinator at {self.address} within "
                                            f"{timeout_s:g} s ({error})") from None
                time.sleep(0.05)
        sock.settimeout(timeout_s)
        try:
            self.channel = wire.connect(sock, secret)
        except BaseException:
            sock.close()
            raise

    def _call(self, op: bytes, *fields: bytes, wait_s: float = 0.0) -> list[bytes]:
        with self.lock:
            try:
                self.channel.sock.settimeout(self.timeout_s + wait_s)
                self.channel.send(op + _pack(*fields))
                reply = self.channel.recv()
            except OSError as error:
                raise ControlPlaneError(f"lost the coordinator's store at {self.address} ({error})") from None
        status, out = reply[:1], _unpack(reply[1:])
        if status != b"K":
            why = out[0].decode() if out else "the store refused the request"
            raise StoreTimeout(why) if status == b"T" else ControlPlaneError(why)
        return out

    def set(self, key: str, value: str | bytes) -> None:
        self._call(b"S", key.encode(), _bytes(value))

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        wait_s = _seconds(timeout, self.timeout_s)
        return self._call(b"G", str(wait_s).encode(), key.encode(), wait_s=wait_s)[0]

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        wait_s = _seconds(timeout, self.timeout_s)
        return self._call(b"M", str(wait_s).encode(), *(k.encode() for k in keys), wait_s=wait_s)

    def add(self, key: str, delta: int) -> int:
        return int(self._call(b"A", key.encode(), str(int(delta)).encode())[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(b"C", *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        wait_s = _seconds(timeout, self.timeout_s)
        self._call(b"W", str(wait_s).encode(), *(k.encode() for k in keys), wait_s=wait_s)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call(b"X", key.encode(), _bytes(expected), _bytes(desired))[0]

    def delete_key(self, key: str) -> bool:
        return self._call(b"D", key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(b"N")[0])

    def peek(self, keys: list[str]) -> list[bytes | None]:
        out = self._call(b"P", *(k.encode() for k in keys))
        return [value if present == b"1" else None for present, value in zip(out[::2], out[1::2])]

    def wait_any(self, keys: list[str], timeout: float) -> str | None:
        out = self._call(b"Y", str(timeout).encode(), *(k.encode() for k in keys), wait_s=timeout)
        return out[0].decode() if out else None

    def close(self) -> None:
        self.channel.close()
