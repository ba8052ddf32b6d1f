"""What every DeadPool process knows about itself: identity, config, store, events, faults."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from deadpool.config import JobConfig
from deadpool.coordinator.protocol import ENV_CONFIG, ENV_PROC, ENV_ROLE, Keys, Plan
from deadpool.errors import ConfigError, SwapAborted
from deadpool.events import EventLog
from deadpool.faults.plan import FaultInjector
from deadpool.protocol.secret import read_secret
from deadpool.protocol.store import StoreClient
from deadpool.runtime.plane import PlaneStore


def wait_for_key(store: dist.Store, key: str, deadline: float, give_up: tuple[str, ...] = (),
                 stopped: Callable[[], bool] = lambda: False, max_pause: float = 0.01) -> str:
    """Waits until `key` (or first one of `give_up`) exists in the store and returns which one did.

    Polls with a pause that grows from 0.5 ms to `max_pause`: quick when the key is about to appear,
    cheap when idle, and interruptible (store.wait cannot be interrupted and logs every timeout).
    Raises InterruptedError when `stopped()` and TimeoutError at the deadline.
    """
    pause = 0.0005
    while True:
        for candidate in (key, *give_up):
            if store.check([candidate]):
                return candidate
        if stopped():
            raise InterruptedError(f"stopped while waiting for {key}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {key}")
        time.sleep(pause)
        pause = min(2 * pause, max_pause)


def connect(config: JobConfig, timeout_s: float | None = None) -> PlaneStore:
    """A client of the coordinator's store that proved it holds the job's secret; each thread that blocks on
    the store gets its own."""
    client = StoreClient(config.store_host, config.store_port, read_secret(config.secret_file),
                         timeout_s or config.connect_timeout_s)
    return PlaneStore(client)


@dataclass
class Context:
    """Fixed for the life of the process; what changes with each generation lives in an Incarnation."""

    proc: str
    role: str
    config: JobConfig
    store: PlaneStore
    keys: Keys
    events: EventLog
    faults: FaultInjector

    @classmethod
    def from_environment(cls) -> "Context":
        missing = [v for v in (ENV_CONFIG, ENV_PROC, ENV_ROLE) if v not in os.environ]
        if missing:
            raise ConfigError(f"{', '.join(missing)} not set: start training scripts with `deadpool run`, "
                              "not directly with python")
        config = JobConfig.read(Path(os.environ[ENV_CONFIG]))
        proc, role = os.environ[ENV_PROC], os.environ[ENV_ROLE]
        events = EventLog(Path(config.run_dir) / "events.jsonl", role=role, proc=proc)
        store = connect(config)
        keys = Keys(config.token)
        return cls(proc, role, config, store, keys, events, FaultInjector(config.faults, store, keys, events))

    def generation(self) -> int:
        return int(self.store.get(self.keys.generation()))

    def plan(self, gen: int) -> Plan:
        return Plan.from_json(self.store.get(self.keys.plan(gen)))

    def wait_key(self, key: str, deadline: float, give_up: tuple[str, ...] = ()) -> str | None:
        """Waits for `key` (or one of `give_up`) on this process's main store client; SwapAborted at the deadline."""
        try:
            return wait_for_key(self.store, key, deadline, give_up)
        except TimeoutError:
            raise SwapAborted(f"timed out waiting for {key.removeprefix(self.keys.prefix)}") from None

    def wait_generation_after(self, gen: int, deadline: float) -> int:
        """Blocks until the coordinator publishes a generation newer than `gen`."""
        while True:
            current = self.generation()
            if current > gen:
                return current
            if self.store.check([self.keys.shutdown()]):
                raise SwapAborted("the job is shutting down")
            if time.monotonic() > deadline:
                raise SwapAborted(f"no new generation after {gen} was published in time")
            time.sleep(self.config.poll_interval_s)
