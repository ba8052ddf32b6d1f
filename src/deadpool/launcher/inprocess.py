"""The control plane of a job that no launcher started (runtime/standalone.py): the store and the coordinator
run in threads of rank 0's own process, and the job's processes are the ones that already run.

The coordinator is the launcher's, unchanged (coordinator/server.py); only its view of the processes
differs (`Peers`): it cannot start them (they run already), it learns of their exits from what each one
publishes as it exits (Keys.exited) or, on this machine, from its pid vanishing, and it fences them by pid.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from deadpool.config import JobConfig
from deadpool.coordinator.nodes import Exited, Ordered
from deadpool.coordinator.server import Coordinator
from deadpool.errors import ConfigError
from deadpool.events import EventLog
from deadpool.launcher.launch import log_refusals
from deadpool.protocol.keys import CONFIG_KEY, Keys
from deadpool.protocol.kinds import Role
from deadpool.protocol.nodes import Pid, ProcessExit
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Fence
from deadpool.protocol.store import StoreServer
from deadpool.report import summarize

VANISHED = "no exit report: its process ended without running Python's exit handlers (a signal, or os._exit)"


def running(pid: int) -> bool:
    """Whether process `pid` of this machine still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class Peers:
    """The job's processes, as the coordinator sees them when no launcher started them: worker r is rank r,
    on node r // nproc (0 on one machine); this process (`own`, rank 0) hosts the coordinator."""

    def __init__(self, plane: ControlPlane, keys: Keys, own: str, nproc: int) -> None:
        self.plane, self.keys, self.own, self.nproc = plane, keys, own, nproc
        self.node: dict[str, int] = {}
        self.done: dict[str, Exited] = {}
        self.fenced: set[str] = set()

    def spawn(self, name: str, role: Role, rank: int) -> Ordered:
        """Nothing to start: the process runs already (it publishes its pid at init)."""
        self.node[name] = rank // self.nproc if self.nproc else 0
        return Ordered(name, self.node[name], os.getpid() if name == self.own else None)

    def pid(self, name: str) -> int | None:
        known = self.plane.poll(self.keys.node_pid(name), Pid)
        return None if known is None else known.pid

    def _local(self, name: str) -> bool:
        return self.node.get(name) == self.node.get(self.own)

    def poll(self) -> list[Exited]:
        """Processes that published their exit since the last call, and those of this machine whose pid
        vanished without one (killed): torch would say how only to their parent, torchrun.

        Those stopped by SIGTERM come last: when one rank dies, torchrun SIGTERMs the others, and if a tick
        sees both, the one that died first is the root cause the job's error names first."""
        exited = []
        for name in self.node:
            if name in self.done:
                continue
            report, pid = self.plane.poll(self.keys.exited(name), ProcessExit), self.pid(name)
            if report is not None:
                self.done[name] = Exited(name, report.code, report.pid)
            elif pid is not None and self._local(name) and not running(pid):
                self.done[name] = Exited(name, -signal.SIGKILL, pid, lost_with_node=VANISHED)
            else:
                continue
            exited.append(self.done[name])
        return sorted(exited, key=lambda x: x.returncode == -signal.SIGTERM)  # stable: else in rank order

    def fence(self, name: str) -> None:
        """SIGKILLs a process of this machine by its pid (this one too, if it is the hung rank); one on
        another machine only learns it is fenced (the new generation refuses it)."""
        self.fenced.add(name)
        self.plane.put(self.keys.fence(name), Fence(name))
        pid = self.pid(name)
        if pid is not None and self._local(name) and running(pid):
            os.kill(pid, signal.SIGKILL)

    def alive(self) -> set[str]:
        """The processes to stop at the job's end, never this one: it hosts the job and ends by itself."""
        return {name for name in self.node if name not in self.done and name != self.own}

    def relabel(self, name: str, label: str) -> None:
        """Each process prints its own output: no prefix to change."""

    def joined(self) -> dict[int, str]:
        """No node can join a job that torchrun started."""
        return {}

    def on_exit(self, wake: Callable[[], None]) -> None:
        """Nothing to do: an exit report is a store write, which wakes the coordinator itself; a pid that
        vanished is seen at its next tick."""

    def stop_all(self, grace_s: float) -> None:
        """Waits up to `grace_s` for the other processes to report their exits, then fences the rest."""
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.02)
        for name in self.alive():
            self.fence(name)


class HostedJob:
    """The job's store and coordinator, in threads of this process, from `start` to `finish`."""

    def __init__(self, config: JobConfig, secret: bytes, own: str) -> None:
        try:
            self.store = StoreServer(config.store_host, config.store_port, secret)
        except OSError as error:
            raise ConfigError(f"cannot host DeadPool's control plane on {config.store_host}:{config.store_port} "
                              f"({error.strerror}): under torchrun it takes MASTER_PORT + 1; start torchrun with "
                              "another --master-port") from None
        run_dir = Path(config.run_dir)
        self.config = replace(config, store_port=self.store.port)
        self.events = EventLog(run_dir / "events.jsonl", role="coordinator", proc="coordinator")
        self.store.on_refused = log_refusals(self.events)
        self.config_path = run_dir / "config.json"
        self.config.write(self.config_path)
        self.plane = ControlPlane(self.store.table)
        self.plane.put(CONFIG_KEY, self.config)  # what the other ranks read first
        self.peers = Peers(self.plane, Keys(self.config.token), own, self.config.nproc_per_node)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name="deadpool-coordinator", daemon=True)

    def start(self) -> "HostedJob":
        self.events.emit("job_start", workers=self.config.workers, spares=0, port=self.config.store_port,
                         snapshot_every=self.config.snapshot_every, devices=None, placement="no launcher")
        self.thread.start()
        return self

    def _run(self) -> None:
        """The coordinator's loop, then the summary the launcher would write (status.json as it goes)."""
        started = time.monotonic()
        try:
            self.code = Coordinator(self.config, self.plane, self.events, self.peers).run()
        except Exception as error:  # the coordinator's own bug: say so, and let the job end with it
            print(f"[deadpool] the coordinator failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            self.code = 1
        self.events.emit("job_end", exit_code=self.code, duration_s=time.monotonic() - started)
        summary: dict[str, Any] = summarize(Path(self.config.run_dir) / "events.jsonl", exit_code=self.code,
                                            faults=self.config.faults)
        (Path(self.config.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))

    def finish(self, timeout_s: float) -> None:
        """Waits (at most `timeout_s`) for the coordinator to see every process exit and end the job,
        then closes the store: called as this process exits."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            print(f"[deadpool] the job did not end within {timeout_s:g} s of rank 0's exit; stopping its "
                  "control plane", file=sys.stderr, flush=True)
        self.store.close()
        self.events.close()
