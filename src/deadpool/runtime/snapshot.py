"""The snapshot engine: background copy of a rank's state into two host slots, replication, durable reports.

Per snapshot k (training thread | this generation's engine thread):

    optimizer step k
    capture(k): take the state apart;   |
      copy small mutable parts now      |  wait for a free slot (never the newest committed step)
    forward / backward of step k+1      |  copy stable tensors into it and hash each chunk as it lands
                                        |    (data parallel: only this rank's piece of them, then audit
                                        |    another piece of the live ones: pieces.py)
    wait_copied()  <------------------- |  copied              (one pass; on GPU: side stream, then hash)
    optimizer step k+1                  |  seal, send to holders (what the slot holds), await their acks
                                        |  durable: report g{g}/durable/{rank}; the coordinator commits

The slots outlive generations (they hold what a recovery restores); each generation's thread, events and
replica streams are its own (snapshot_thread.py), so a thread that a stop gave up on can only touch its own.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import torch

from deadpool.errors import SwapAborted
from deadpool.protocol.records import Commit
from deadpool.runtime.context import Context
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.slots import Slot
from deadpool.runtime.snapshot_thread import Job, Resend, SnapshotThread
from deadpool.runtime.state import Layout, Stateful, flatten
from deadpool.runtime.watch import Watch

COSTS_KEPT = 100  # the engine's busy time of this many recent snapshots: what `auto` and the lag warning read


class SnapshotEngine:
    """Owns a rank's two local slots; `start` runs one generation's engine thread over them."""

    def __init__(self, ctx: Context, device: torch.device, slots: list[Slot] | None = None) -> None:
        self.ctx = ctx
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = slots or [Slot(), Slot()]
        self.wait_s = 0.0            # total time the training thread waited for copies
        self.replicated = False      # data parallel: the stable tensors are equal on every rank (sliced, checked)
        self.costs: deque[float] = deque(maxlen=COSTS_KEPT)  # engine busy seconds per recent snapshot
        self.reported_bytes = 0       # host memory of the slots, as last reported (`slot_memory`)
        self.committed: int | None = None  # the newest commit this rank has seen: what it persists if told to stop
        self.lock = threading.Lock()  # taken to reserve a slot, and to take slots away from a stopped run
        self._run: SnapshotThread | None = None
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    # ---- training thread -------------------------------------------------------------------

    def start(self, inc: Incarnation, watch: Watch) -> None:
        """Begins a generation: snapshots of this rank go to inc.plan.holders[rank]."""
        assert self._run is None, "stop the previous generation's run first"
        self._run = SnapshotThread(self, inc, watch)

    def capture(self, step: int, tree: dict[str, Stateful]) -> None:
        """Hands snapshot `step` to the engine; mutable parts are cloned here, the rest copied later."""
        assert self._run is not None
        self.wait_copied()
        flat = flatten(tree)
        flat.tensors = [t if stable else t.clone() for t, stable in zip(flat.tensors, flat.stable)]
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._run.copied.clear()
        self._run.queued(+1)
        self._run.jobs.put(Job(step, flat, Layout.of(flat.tensors, lead=flat.stable), ready))

    def resend(self, step: int, holders: tuple[str, ...]) -> None:
        """After a recovery: sends the restored snapshot `step` to `holders`, which were placed anew and
        hold nothing of this rank, and waits until they hold it. The previous holders drop their copies
        once the generation runs, so until then a second failure would find no copy of this rank."""
        run = self._run
        assert run is not None
        run.queued(+1)
        run.jobs.put(Resend(step, holders))
        run.await_event(run.idle, 0.01, f"the restored snapshot {step} did not reach {', '.join(holders)} before the "
                        "collective timeout")

    def wait_copied(self) -> float:
        """Blocks until the last capture is in its slot: the only wait training ever pays."""
        run = self._run
        if run is None:
            return 0.0
        start = time.monotonic()
        run.await_event(run.copied, 0.05, "snapshot copy did not finish before the collective timeout")
        waited = time.monotonic() - start
        self.wait_s += waited
        return waited

    def drain(self) -> None:
        """At the end of training: waits until the last snapshot is durable (or skipped) and the newest
        durable one is committed (or abandoned), so a finished job leaves its last state that every rank
        snapshotted committed in memory."""
        run = self._run
        assert run is not None
        run.await_event(run.idle, 0.01, "the last snapshot was not replicated before the collective timeout")
        if run.durable:
            self.wait_committed(max(run.durable))

    def wait_committed(self, step: int) -> None:
        """Blocks until the coordinator has committed `step` (or newer) in this generation, or has abandoned
        it (another rank skipped it under --backlog-policy skip, so it can never be committed)."""
        run = self._run
        assert run is not None

        def done(commit: Commit | None) -> bool:
            if commit is not None and commit.step is not None:
                self.committed = commit.step
                if commit.step >= step:
                    return True
            if commit is not None and step in commit.abandoned:
                return True
            run.raise_if_failed()
            return False

        deadline = time.monotonic() + self.ctx.config.recovery_timeout_s
        try:
            self.ctx.plane.wait_until(run.inc.committed_key(), Commit, done, deadline,
                                      pause_s=self.ctx.config.poll_interval_s / 4)
        except TimeoutError:
            raise SwapAborted(f"snapshot {step} was not committed within {self.ctx.config.recovery_timeout_s} s"
                              ) from None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops this generation's thread (bounded). A thread that does not stop in time is abandoned: the
        slot it was writing is swapped for a fresh one, so it can never write into a slot in use again."""
        run, self._run = self._run, None
        if run is None:
            return
        run.stop.set()
        for sender in list(run.senders.values()):  # a send blocked on a holder that hangs ends now
            sender.stream.interrupt()
        try:
            run.jobs.put_nowait(None)  # wakes the thread at once if it is waiting for work
        except queue.Full:
            pass  # a job is queued, so the thread is busy: it sees the stop before taking the next one
        run.thread.join(timeout_s)
        if run.thread.is_alive():
            with self.lock:
                if run.writing is not None and run.writing in self.slots:
                    self.slots[self.slots.index(run.writing)] = Slot()
            self.ctx.events.emit("snapshot_thread_abandoned", timeout_s=timeout_s, gen=run.inc.generation)

    def sliced(self, world: int) -> bool:
        """Whether snapshots hold one piece of the replicated state (slices.py): data parallel over more than
        one rank, unless --slices off. The same on every rank, so the restore's gather is too."""
        return self.ctx.config.slices and self.replicated and world > 1

    def usable_steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.usable() and s.step is not None)

    def slot_for(self, step: int) -> Slot:
        return next(s for s in self.slots if s.step == step)

    def keep_only(self, step: int | None) -> None:
        """After restoring `step`, the other slot holds a step of a failed generation: free it (None: free both)."""
        for slot in self.slots:
            if slot.step != step:
                slot.step = None


