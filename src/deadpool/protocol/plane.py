"""The control plane's one door: typed records into and out of the coordinator's store, and every wait on it.

No other DeadPool code calls the store (gloo's rendezvous drives its own adapter, runtime/plane.py):

    process --put(key, record)----------> ControlPlane --set---------> store (authenticated: protocol/store.py)
    process <--get / poll / poll_all------ ControlPlane <--get / peek---
    process --count(key)----------------> ControlPlane --add---------> a counter (beacons, claims, numbers)
    process --delete(key)---------------> ControlPlane --delete_key--> gone (what its writer no longer needs)
    process --wait(keys, deadline, give_up)  blocks in the store a slice at a time: the first key that
                                             exists, InterruptedError once give_up(), TimeoutError at the deadline
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence, TypeVar

from deadpool.errors import ProtocolError

SLICE_S = 0.05  # how long one wait blocks in the store before asking `give_up` again


class Store(Protocol):
    """What the plane needs of a store: protocol/store.py's client, or the server's own table in the
    coordinator's process."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str, timeout: float | None = None) -> bytes: ...
    def add(self, key: str, delta: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...
    def peek(self, keys: list[str]) -> list[bytes | None]: ...
    def wait_any(self, keys: list[str], timeout: float) -> str | None: ...


class Wire(Protocol):
    def to_json(self) -> str: ...


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Kind(Protocol[T_co]):
    """A record type: its `from_json` parses one strictly (protocol/record.py), or raises ProtocolError."""

    def from_json(self, text: str) -> T_co: ...


def _never() -> bool:
    return False


class ControlPlane:
    """One process's (or thread's) connection to the control plane. A thread that blocks in `wait` or `get`
    should have its own, so that it holds up no other thread's call."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.parsed: dict[object, dict[str, tuple[bytes, object]]] = {}  # kind -> key -> the last (raw, record)

    def put(self, key: str, record: Wire) -> None:
        """Writes `record` at `key`."""
        self.store.set(key, record.to_json())

    def get(self, key: str, kind: Kind[T], timeout_s: float | None = None) -> T:
        """The record at `key`, waiting up to `timeout_s` for it (StoreTimeout past it; None: the store's default)."""
        return _parse(kind, self.store.get(key, timeout_s))

    def poll(self, key: str, kind: Kind[T]) -> T | None:
        """The record at `key`, or None if it is not there yet; never blocks."""
        return self.poll_all([key], kind)[0]

    def poll_all(self, keys: Sequence[str], kind: Kind[T]) -> list[T | None]:
        """The records at `keys`, None for those not there yet, in one round trip. A record whose bytes have
        not changed since the last poll of this kind is not parsed again (records are frozen): the coordinator
        polls every rank's reports every tick, and most have not moved. Only the last poll's are kept."""
        last = self.parsed.get(kind, {})
        now: dict[str, tuple[bytes, object]] = {}
        for key, raw in zip(keys, self.store.peek(list(keys))):
            if raw is not None:
                seen = last.get(key)
                now[key] = seen if seen is not None and seen[0] == raw else (raw, _parse(kind, raw))
        self.parsed[kind] = now
        return [now[key][1] if key in now else None for key in keys]  # type: ignore[misc]

    def has(self, key: str) -> bool:
        """Whether `key` exists, whatever it holds."""
        return self.present([key])[0]

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists, whatever it holds, in one round trip."""
        return [raw is not None for raw in self.store.peek(list(keys))]

    def count(self, key: str, delta: int = 1) -> int:
        """Adds `delta` to the counter at `key` (atomically: no two callers get one number) and returns it."""
        return self.store.add(key, delta)

    def counters(self, keys: Sequence[str]) -> list[int]:
        """The counters at `keys`, 0 for those nobody counted yet, in one round trip."""
        return [0 if raw is None else int(raw) for raw in self.store.peek(list(keys))]

    def wait(self, keys: Sequence[str], deadline: float, give_up: Callable[[], bool] = _never,
             slice_s: float = SLICE_S) -> str:
        """Blocks until the first of `keys` exists, and returns it. Raises InterruptedError once `give_up()`
        (asked every `slice_s`: the generation is over, the thread was told to stop) and TimeoutError at
        `deadline` (time.monotonic()); the store itself wakes the wait as soon as a key is written."""
        while True:
            found = self.store.wait_any(list(keys), max(0.0, min(slice_s, deadline - time.monotonic())))
            if found is not None:
                return found
            if give_up():
                raise InterruptedError(f"gave up waiting for {', '.join(keys)}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out waiting for {', '.join(keys)}")

    def wait_until(self, key: str, kind: Kind[T], done: Callable[[T | None], bool], deadline: float,
                   give_up: Callable[[], bool] = _never, pause_s: float = 0.01) -> T | None:
        """For a record rewritten in place (a commit moving on), whose change no new key announces: reads it,
        with a pause that grows from 0.5 ms to `pause_s`, until `done(record)` (None: not there yet), and
        returns it. InterruptedError once `give_up()`, TimeoutError at `deadline`."""
        pause = min(0.0005, pause_s)
        while True:
            record = self.poll(key, kind)
            if done(record):
                return record
            if give_up():
                raise InterruptedError(f"gave up waiting on {key}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out waiting on {key}")
            time.sleep(pause)
            pause = min(2 * pause, pause_s)


def _parse(kind: Kind[T], raw: bytes) -> T:
    try:
        text = raw.decode()
    except UnicodeDecodeError as error:
        raise ProtocolError(f"malformed {getattr(kind, '__name__', kind)} record: not text ({error})") from None
    return kind.from_json(text)
