"""The snapshot engine: background copy of a rank's state into two host slots, replication, and commit.

Per snapshot k (training thread | engine thread):

    optimizer step k
    capture(k): take the state apart;   |
      copy small mutable parts now      |  wait until snapshot k-1 is committed (slot reuse rule)
    forward / backward of step k+1      |  copy stable tensors into the free slot (side stream on GPU)
    wait_copied()  <------------------- |  copied
    optimizer step k+1                  |  checksum, send to holders, await their acks
                                        |  durable: add to the step's counter; the last rank commits k
"""

from __future__ import annotations

import json
import queue
from contextlib import nullcontext
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from deadpool.coordinator.protocol import Plan
from deadpool.errors import ProtocolError, SwapAborted
from deadpool.runtime.context import Context, connect, wait_for_key
from deadpool.runtime.replica import ReplicaSender
from deadpool.runtime.slots import Slot, checksum, make_meta, pick_slot
from deadpool.runtime.state import Flat, Layout, Stateful, flatten


class GenerationAborted(Exception):
    """The coordinator replaced this generation: unwind the step and recover."""


@dataclass
class _Job:
    step: int
    flat: Flat
    layout: Layout
    ready: torch.cuda.Event | None  # on GPU: marks the training stream's position at capture


class SnapshotEngine:
    """Owns a rank's two local slots and the thread that fills, replicates and commits them."""

    def __init__(self, ctx: Context, device: torch.device, aborted: Callable[[], bool],
                 slots: list[Slot] | None = None) -> None:
        self.ctx = ctx
        self.aborted = aborted
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = slots or [Slot(pinned=self.cuda), Slot(pinned=self.cuda)]
        self.committed: int | None = None
        self.wait_s = 0.0            # total time the training thread waited for copies
        self.costs: list[float] = []  # engine busy seconds per snapshot (copy + checksum + replicate)
        self._copied = threading.Event()
        self._copied.set()
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._stop = threading.Event()  # the running thread's; replaced at every start
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    # ---- training thread -------------------------------------------------------------------

    def start(self, gen: int, plan: Plan, rank: int, committed: int | None) -> None:
        """Begins a generation: snapshots of this rank go to plan.holders[rank]."""
        self.gen, self.plan, self.rank, self.committed = gen, plan, rank, committed
        self._prev = committed
        self._stop = threading.Event()  # a fresh one: a thread abandoned earlier keeps its own, still set
        self._error = None
        self._copied.set()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name=f"deadpool-snapshot-g{gen}",
                                        daemon=True)
        self._thread.start()

    def capture(self, step: int, tree: dict[str, Stateful]) -> None:
        """Hands snapshot `step` to the engine; mutable parts are cloned here, the rest copied later."""
        self.wait_copied()
        flat = flatten(tree)
        flat.tensors = [t if stable else t.clone() for t, stable in zip(flat.tensors, flat.stable)]
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._copied.clear()
        self._jobs.put(_Job(step, flat, Layout.of(flat.tensors), ready))

    def wait_copied(self) -> float:
        """Blocks until the last capture is in its slot: the only wait training ever pays."""
        start = time.monotonic()
        deadline = start + self.ctx.config.collective_timeout_s
        while not self._copied.wait(0.05):
            self.raise_if_failed()
            if time.monotonic() > deadline:
                raise SwapAborted("snapshot copy did not finish before the collective timeout")
        self.raise_if_failed()
        waited = time.monotonic() - start
        self.wait_s += waited
        return waited

    def raise_if_failed(self) -> None:
        """Surfaces a latched engine error at a step boundary, never at a random point."""
        if self.aborted():
            raise GenerationAborted(f"generation {self.gen} was aborted by the coordinator")
        if self._error is not None:
            raise self._error

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the thread (bounded); a slot it was writing stays unsealed and is never restored."""
        self._stop.set()
        try:
            self._jobs.put_nowait(None)  # wakes the thread at once if it is waiting for work
        except queue.Full:
            pass  # a job is queued, so the thread is busy: it sees the stop before taking the next one
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.ctx.events.emit("snapshot_thread_abandoned", timeout_s=timeout_s)
        self._thread = None
        while not self._jobs.empty():
            self._jobs.get_nowait()
        self._copied.set()

    def intact_steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.intact())

    def slot_for(self, step: int) -> Slot:
        return next(s for s in self.slots if s.step == step)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        store = connect(self.ctx.config)  # its own client: blocking waits must not stall training's
        senders: dict[str, ReplicaSender] = {}
        try:
            for holder in self.plan.holders[self.rank]:  # connect now, not in the first snapshot's path
                self._connect(holder, store, senders)
            while not stop.is_set():
                try:
                    job = self._jobs.get(timeout=0.05)
                except queue.Empty:
                    continue
                if job is not None:  # None: the wake-up stop() sends
                    self._snapshot(job, store, senders, stop)
        except InterruptedError:
            pass
        except BaseException as error:  # latched; the training thread raises it at the next step boundary
            if not stop.is_set():
                self._error = error
                self.ctx.events.emit("snapshot_failed", error=f"{type(error).__name__}: {error}")
        finally:
            self._copied.set()
            senders.clear()  # closing the pair groups tells the holders this stream is over

    def _snapshot(self, job: _Job, store: object, senders: dict[str, ReplicaSender], stop: threading.Event) -> None:
        start = time.monotonic()
        if self._prev is not None and self._prev != self.committed:
            if not self._await_commit(self._prev, store, stop, skip=self.ctx.config.backlog_policy == "skip"):
                self.ctx.events.emit("snapshot_skipped", step=job.step, reason=f"snapshot {self._prev} not committed yet")
                self._copied.set()
                return
        slot = pick_slot(self.slots, self.committed)
        buffer = slot.reserve(job.layout.nbytes)
        self._copy(job, buffer)
        meta = make_meta(job.step, job.flat.skeleton, job.layout, job.flat.numpy)
        copied = time.monotonic()
        self._copied.set()
        slot.seal(job.step, meta, checksum(meta, slot.data))
        self._prev = job.step
        for holder in self.plan.holders[self.rank]:
            self._replicate(slot, holder, store, senders)
        self._mark_durable(job.step, store)
        self.costs.append(time.monotonic() - start)
        self.ctx.events.emit("snapshot", step=job.step, bytes=job.layout.nbytes, copy_s=copied - start,
                             total_s=time.monotonic() - start, holders=list(self.plan.holders[self.rank]))

    def _copy(self, job: _Job, buffer: torch.Tensor) -> None:
        """Copies every tensor into its place in the slot; on GPU through a side stream into pinned memory."""
        half = len(job.flat.tensors) // 2
        with torch.cuda.stream(self._stream) if self.cuda else nullcontext():
            if job.ready is not None:
                self._stream.wait_event(job.ready)
            for i, (tensor, (_, _, offset, n)) in enumerate(zip(job.flat.tensors, job.layout.specs)):
                if i == half:
                    self.ctx.faults.kill_point("snapshot_copy", job.step)
                if n:
                    buffer[offset: offset + n].copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=self.cuda)
        if self.cuda:
            self._stream.synchronize()

    def _connect(self, holder: str, store: object, senders: dict[str, ReplicaSender]) -> None:
        if holder not in senders:
            prefix = self.ctx.keys.pair_prefix(self.gen, self.rank, holder)
            senders[holder] = ReplicaSender(store, prefix, self.ctx.config.token, self.gen,
                                            self.ctx.config.collective_timeout_s)

    def _replicate(self, slot: Slot, holder: str, store: object, senders: dict[str, ReplicaSender]) -> None:
        self._connect(holder, store, senders)
        midway = lambda: self.ctx.faults.kill_point("replicate", slot.step)  # noqa: E731
        try:
            senders[holder].send(slot, midway)
        except ProtocolError as error:  # a corrupted transfer: send once more before giving up
            self.ctx.events.emit("replica_rejected", step=slot.step, holder=holder, error=str(error))
            senders[holder].send(slot)

    def _await_commit(self, step: int, store: object, stop: threading.Event, skip: bool) -> bool:
        """Waits until `step` is committed by all ranks; False at once under the skip policy."""
        marker = self.ctx.keys.commit_marker(self.gen, step)
        if skip and not store.check([marker]):
            return False
        deadline = time.monotonic() + self.ctx.config.collective_timeout_s
        try:
            wait_for_key(store, marker, deadline, stopped=lambda: stop.is_set() or self.aborted())
        except TimeoutError:
            raise SwapAborted(f"snapshot {step} was not committed before the collective timeout") from None
        self.committed = step
        return True

    def _mark_durable(self, step: int, store: object) -> None:
        """Counts this rank in; the last rank to arrive commits the step for everyone."""
        if store.add(self.ctx.keys.durable(self.gen, step), 1) == self.plan.world_size:
            store.set(self.ctx.keys.committed(), json.dumps({"step": step, "gen": self.gen}))
            store.set(self.ctx.keys.commit_marker(self.gen, step), "1")
            self.ctx.events.emit("commit", step=step)

