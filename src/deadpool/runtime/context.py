"""What every DeadPool process knows about itself: identity, config, store, events, faults."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from deadpool.config import JobConfig
from deadpool.errors import ConfigError, SwapAborted
from deadpool.events import EventLog
from deadpool.faults.plan import FaultInjector
from deadpool.protocol.keys import ENV_CONFIG, ENV_PROC, ENV_ROLE, Keys
from deadpool.protocol.kinds import Role
from deadpool.protocol.plan import Plan
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Published
from deadpool.protocol.secret import read_secret
from deadpool.protocol.store import StoreClient
from deadpool.runtime.plane import PlaneStore


def connect(config: JobConfig, timeout_s: float | None = None) -> StoreClient:
    """A client of the coordinator's store that proved it holds the job's secret; each thread that blocks on
    the store gets its own (ControlPlane(client) for DeadPool's records, PlaneStore(client) for gloo)."""
    return StoreClient(config.store_host, config.store_port, read_secret(config.secret_file),
                       timeout_s or config.connect_timeout_s)


@dataclass
class Context:
    """Fixed for the life of the process; what changes with each generation lives in an Incarnation. Two
    fields move: `heartbeat_t`, when this process's Watch last published a heartbeat (watch.Beacon reads it),
    and `ready_gen`, the newest generation it reported ready in (a Watch's stuck report reads it)."""

    proc: str
    role: Role
    config: JobConfig
    store: PlaneStore   # the main thread's client, as gloo's rendezvous uses it
    plane: ControlPlane  # the same client, for DeadPool's own records
    keys: Keys
    events: EventLog
    faults: FaultInjector
    heartbeat_t: float = -math.inf  # time.monotonic() of the last heartbeat put (a float: written atomically)
    ready_gen: int = -1             # recovery.py's REPORT: the newest generation this process reported ready in

    @classmethod
    def from_environment(cls) -> "Context":
        missing = [v for v in (ENV_CONFIG, ENV_PROC, ENV_ROLE) if v not in os.environ]
        if missing:
            raise ConfigError(f"{', '.join(missing)} not set: start training scripts with `deadpool run`, "
                              "not directly with python")
        config = JobConfig.read(Path(os.environ[ENV_CONFIG]))
        proc, role = os.environ[ENV_PROC], Role(os.environ[ENV_ROLE])
        events = EventLog(Path(config.run_dir) / "events.jsonl", role=role.value, proc=proc)
        client, keys = connect(config), Keys(config.token)
        plane = ControlPlane(client)
        return cls(proc, role, config, PlaneStore(client), plane, keys, events,
                   FaultInjector(config.faults, plane, keys, events))

    def own_plane(self) -> ControlPlane:
        """A control plane on a client of its own, for a thread that must never queue behind another's call."""
        return ControlPlane(connect(self.config))

    def secret(self) -> bytes:
        """The job's secret, which replica streams prove too (runtime/stream.py)."""
        return read_secret(self.config.secret_file)

    def generation(self) -> int:
        return self.plane.get(self.keys.generation(), Published).gen

    def plan(self, gen: int) -> Plan:
        return self.plane.get(self.keys.plan(gen), Plan)

    def wait_key(self, key: str, deadline: float, give_up: tuple[str, ...] = ()) -> str:
        """Waits for `key` (or one of `give_up`) on this process's main client; SwapAborted at the deadline."""
        try:
            return self.plane.wait([key, *give_up], deadline)
        except TimeoutError:
            raise SwapAborted(f"timed out waiting for {key.removeprefix(self.keys.prefix)}") from None

    def wait_generation_after(self, gen: int, deadline: float) -> int:
        """Blocks until the coordinator publishes a generation newer than `gen` (plans come one number at a
        time, each before the generation that names it) and returns the newest."""
        try:
            got = self.plane.wait([self.keys.plan(gen + 1), self.keys.shutdown()], deadline)
        except TimeoutError:
            raise SwapAborted(f"no new generation after {gen} was published in time") from None
        if got == self.keys.shutdown():
            raise SwapAborted("the job is shutting down")
        return max(gen + 1, self.generation())
