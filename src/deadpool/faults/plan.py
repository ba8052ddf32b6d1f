"""Fires the job's planned faults at exact points of exact steps, each at most once per job."""

from __future__ import annotations

import os
import signal
from typing import Callable

from deadpool.config import Fault
from deadpool.errors import InjectedError
from deadpool.events import EventLog
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane


class FaultInjector:
    """Checks the fault plan at each hook point; a counter in the control plane makes each fault fire once even if the
    rank it targets is replayed by a spare."""

    def __init__(self, faults: tuple[Fault, ...], plane: ControlPlane, keys: Keys, events: EventLog) -> None:
        self.faults = faults
        self.plane = plane
        self.keys = keys
        self.events = events
        self.rank: int | None = None

    def _claim(self, kind: str, rank: int | None, step: int, phase: str | None) -> Fault | None:
        for index, fault in enumerate(self.faults):
            if (fault.kind == kind and fault.rank == rank and fault.step == step
                    and (phase is None or fault.phase == phase)
                    and self.plane.count(self.keys.fault_fired(index)) == 1):
                return fault
        return None

    def point(self, phase: str, step: int, before_stop: Callable[[], None] = lambda: None,
              rank: int | None = None) -> None:
        """Fires the plan's fault for this rank (or for `rank`, the one a holder hands over) at this exact point,
        if there is one: `kill` is a real,
        uncatchable SIGKILL; `kill_node` the same to this process's whole node (its agent's process group:
        the agent and every process it started); `hang` a real SIGSTOP (the process stays, silent, holding
        its sockets); `error` an exception raised into the training script, as a bug in it would.
        `before_stop` runs just before a hang's SIGSTOP (the rank publishes where it stops)."""
        target = self.rank if rank is None else rank
        if not self.faults or target is None:
            return
        for kind in ("kill", "kill_node", "hang", "error"):
            if self._claim(kind, target, step, phase) is None:
                continue
            self.events.emit("fault_injected", kind=kind, target_rank=target, step=step, phase=phase)
            if kind == "error":
                raise InjectedError(f"injected error on rank {target} in {phase} of step {step}")
            if kind == "kill_node":
                os.killpg(os.getpgid(0), signal.SIGKILL)
            if kind == "hang":
                before_stop()
            os.kill(os.getpid(), signal.SIGSTOP if kind == "hang" else signal.SIGKILL)

    def should_corrupt(self, rank: int, step: int) -> bool:
        """True once for the planned (rank, step): the holder then flips a byte of that replica."""
        if not self.faults:
            return False
        fault = self._claim("corrupt_replica", rank, step, None)
        if fault is not None:
            self.events.emit("fault_injected", kind="corrupt_replica", target_rank=rank, step=step)
        return fault is not None
