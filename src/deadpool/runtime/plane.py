"""torch's `Store` interface over the authenticated control-plane client, so gloo's rendezvous uses it too."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from deadpool.errors import StoreTimeout
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.store import StoreClient


class PlaneStore(dist.Store):
    """What DeadPool's processes and their process groups use instead of a TCPStore client: same calls, but
    over a connection that proved it holds the job's secret (protocol/wire.py)."""

    def __init__(self, client: StoreClient) -> None:
        super().__init__()
        self.client = client
        self.port = client.port  # as TCPStore's: the coordinator's port (comms.join_group tells its socket apart)

    def set(self, key: str, value: str | bytes) -> None:
        self.client.set(key, value)

    def get(self, key: str) -> bytes:
        return self.client.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.client.multi_get(keys)

    def add(self, key: str, value: int) -> int:
        return self.client.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.client.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.client.wait(keys, timeout)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.client.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.client.delete_key(key)

    def num_keys(self) -> int:
        return self.client.num_keys()


class Interruptible(PlaneStore):
    """A PlaneStore whose blocking calls give up (InterruptedError) as soon as `stopped()`. gloo builds a group
    by waiting in the store for each peer's address, for up to the collective timeout, and nothing else can
    release that wait: a peer that died or stopped before it wrote its address (a holder killed as a transfer
    starts, a rank that died in start-up, a generation abandoned before its group formed) would hold this
    process there for a minute. Given to a group's rendezvous, this view ends it when the generation is over.
    Raised inside torch's call, the error reaches the caller as a RuntimeError from a collective's pair
    rendezvous, but as the InterruptedError itself from init_process_group (runtime/member.py handles both). Keep
    a reference to the view while torch uses it: torch holds only the C++ half of a store written in Python."""

    def __init__(self, store: PlaneStore, stopped: Callable[[], bool]) -> None:
        super().__init__(store.client)
        self.stopped = stopped
        self.plane = ControlPlane(store.client)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.client.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout.total_seconds() if timeout else self.client.timeout_s)
        try:
            for key in keys:  # every one, as the store's own wait
                self.plane.wait([key], deadline, give_up=self.stopped)
        except InterruptedError:
            raise InterruptedError(f"stopped while waiting for {keys}") from None
        except TimeoutError:
            raise StoreTimeout(f"timed out waiting for keys {keys}") from None
