"""torch's `Store` interface over the authenticated control-plane client, so gloo's rendezvous uses it too."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

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
