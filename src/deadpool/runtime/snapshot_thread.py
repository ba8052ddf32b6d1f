"""One generation's snapshot engine thread (snapshot.py's SnapshotEngine starts one per generation): it takes
each captured snapshot, reserves a slot the coordinator's commits have freed, copies and hashes the state into
it (pieces.py), sends it to the rank's holders (replica.py) and reports it durable to the coordinator.

Its queue, events and replica streams are its own, so a thread that a stop gave up on can only touch its own;
the slots are the engine's, which outlive generations.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deadpool.errors import GenerationAborted, ProtocolError, SwapAborted
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Commit, Durable
from deadpool.runtime.comms import communicating
from deadpool.runtime.context import connect
from deadpool.runtime.digest import hash_name
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.pieces import audited, copy_in, piece_of
from deadpool.runtime.replica import ReplicaSender
from deadpool.runtime.slices import held
from deadpool.runtime.slots import Slot, free_slot, make_meta
from deadpool.runtime.state import Flat, Layout
from deadpool.runtime.watch import Watch

if TYPE_CHECKING:
    from deadpool.runtime.snapshot import SnapshotEngine


@dataclass
class Job:
    """Snapshot `step`, as the training thread captured it."""

    step: int
    flat: Flat
    layout: Layout
    ready: torch.cuda.Event | None  # on GPU: marks the training stream's position at capture


@dataclass
class Resend:
    """The restored snapshot `step`, for holders placed anew in a recovery (Plan.fresh)."""

    step: int
    holders: tuple[str, ...]


class SnapshotThread:
    """One generation's engine thread, with its own queue, events and replica streams."""

    def __init__(self, engine: SnapshotEngine, inc: Incarnation, watch: Watch) -> None:
        self.engine, self.inc, self.watch = engine, inc, watch
        self.ctx = engine.ctx
        self.copied = threading.Event()
        self.copied.set()
        self.idle = threading.Event()  # no snapshot queued or in flight
        self.idle.set()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.jobs: queue.Queue[Job | Resend | None] = queue.Queue(maxsize=1)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.writing: Slot | None = None
        self.durable: set[int] = set()
        self.fingerprints: dict[int, int] = {}  # step -> hash of its replicated tensors (or of its piece of them)
        self.audits: dict[int, tuple[int, int]] = {}  # sliced: step -> (piece audited, its hash from live tensors)
        self.taken = 0  # snapshots handed over in this generation: the same count on every rank (audit rotation)
        self.skipped: list[int] = []
        self.senders: dict[str, ReplicaSender] = {}  # holder -> its open stream (written by the thread only)
        self.thread = threading.Thread(target=self._run, name=f"deadpool-snapshot-g{inc.generation}", daemon=True)
        self.thread.start()

    def queued(self, change: int) -> None:
        """Counts snapshots handed over and not yet done with; `idle` is set exactly when none are."""
        with self._pending_lock:
            self._pending += change
            if self._pending:
                self.idle.clear()
            else:
                self.idle.set()

    def await_event(self, event: threading.Event, every_s: float, why: str) -> None:
        """The training thread's wait for this run's thread: raises its latched error (or the abort) as soon as
        there is one, and SwapAborted(why) past the collective timeout."""
        deadline = time.monotonic() + self.ctx.config.collective_timeout_s
        while not event.wait(every_s):
            self.raise_if_failed()
            if time.monotonic() > deadline:
                raise SwapAborted(why)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Surfaces a latched engine error at a step boundary, never at a random point."""
        if self.watch.aborted():
            raise GenerationAborted(f"generation {self.inc.generation} was aborted by the coordinator")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        if self.engine.cuda:  # this thread's own CUDA calls run on the rank's GPU, never making a context on GPU 0
            torch.cuda.set_device(self.engine.device)
        plane = ControlPlane(connect(self.ctx.config))  # its own client: blocking waits must not stall training's
        try:
            for holder in self.inc.plan.holders[self.inc.my_rank()]:  # connect now, not in the first snapshot's path
                self._connect(holder, plane)
            while not self.stop.is_set():
                job = self.jobs.get()  # stop() puts None if nothing is queued: no need to wake up and look
                if isinstance(job, Resend):
                    self._resend(job, plane)
                    self.queued(-1)
                elif job is not None:  # None: the wake-up stop() sends
                    self._snapshot(job, plane)
                    self.queued(-1)
        except InterruptedError:
            pass
        except BaseException as error:  # latched; the training thread raises it at the next step boundary
            if not self.stop.is_set():
                self.error = error
                self.ctx.events.emit("snapshot_failed", error=f"{type(error).__name__}: {error}")
        finally:
            self.copied.set()
            self.idle.set()
            for sender in self.senders.values():  # a closed stream tells its holder that it is over
                sender.close()

    def _snapshot(self, job: Job, plane: ControlPlane) -> None:
        start, cpu = time.monotonic(), time.thread_time()
        rank, world, sliced = self.inc.my_rank(), self.inc.world_size, self.engine.sliced(self.inc.world_size)
        piece = piece_of(job.layout, rank, world) if sliced else None
        checked = audited(world, self.taken)  # audited by every rank but its owner, whose piece hash stands for it
        other = piece_of(job.layout, checked, world) if sliced and checked != rank else None
        self.taken += 1
        reserved_slot = self._reserve(job, plane)
        if reserved_slot is None:
            self.skipped = (self.skipped + [job.step])[-8:]
            self._report(plane)
            self.ctx.events.emit("snapshot_skipped", step=job.step, reason="no free slot: the last snapshot is "
                                 "not committed yet (--backlog-policy skip)")
            self.copied.set()
            return
        slot, replaced = reserved_slot
        reserved = time.monotonic()
        self._report_memory()
        landed: list[float] = []  # when training may go on: every byte is in the slot (on GPU, before the hash)

        def copied() -> None:
            landed.append(time.monotonic())
            self.copied.set()

        digest, seen = copy_in(job.flat.tensors, job.layout, slot.data, piece, other, stream=self.engine.stream,
                               ready=job.ready, copied=copied,
                               midway=lambda: self.ctx.faults.point("snapshot_copy", job.step))
        if seen is not None:
            self.audits[job.step] = (checked, seen)
        meta = make_meta(job.step, job.flat.skeleton, job.layout, job.flat.numpy, job.flat.cuda, job.flat.stable,
                         self.engine.replicated, piece)
        fingerprint, whole = digest.finish(meta)
        hashed = time.monotonic()
        slot.seal(job.step, meta, whole, trusted=True, ranges=held(job.layout.lead_nbytes, job.layout.nbytes, piece))
        self.fingerprints[job.step] = fingerprint
        self.writing = None
        holders = self.inc.plan.holders[self.inc.my_rank()]
        sent = sum(self._replicate(slot, holder, plane, replaced) for holder in holders)
        # the event first: a snapshot the coordinator can commit is always in the events, even if this
        # process dies right after its report
        self.ctx.events.emit("snapshot", step=job.step, bytes=job.layout.nbytes, held=digest.fed,
                             audited=0 if other is None else other[1] - other[0],
                             slice=None if piece is None else list(piece), slot_wait_s=reserved - start,
                             landed_s=landed[0] - reserved, copy_s=hashed - reserved, hash=hash_name(),
                             pinned=slot.pinned, sent=sent, total_s=time.monotonic() - start,
                             cpu_s=time.thread_time() - cpu, holders=list(holders))
        self.durable.add(job.step)
        self._report(plane)
        self.engine.costs.append(time.monotonic() - reserved)  # waiting for a free slot takes nothing from training

    def _resend(self, job: Resend, plane: ControlPlane) -> None:
        slot, start = self.engine.slot_for(job.step), time.monotonic()
        sent = sum(self._replicate(slot, holder, plane) for holder in job.holders)
        send_s = time.monotonic() - start  # connecting to the new holders and streaming: a swap's transfer
        self.ctx.events.emit("snapshot_resent", step=job.step, holders=list(job.holders), bytes=slot.nbytes,
                             held=sum(b - a for a, b in slot.held()), sent=sent, send_s=send_s)
        self.durable.add(job.step)
        self._report(plane)

    def _reserve(self, job: Job, plane: ControlPlane) -> tuple[Slot, int | None] | None:
        """A slot for this snapshot, and the step it held before (its holders overwrite the same one): under
        `wait`, waits until one is free; under `skip`, None if none is."""
        skip = self.ctx.config.backlog_policy == "skip"
        reserved: list[tuple[Slot, int | None]] = []

        def done(commit: Commit | None) -> bool:
            if commit is None:  # the coordinator writes a generation's commit before its ranks snapshot
                return False
            committed, abandoned = commit.step, commit.abandoned
            self.engine.committed = committed if committed is not None else self.engine.committed
            with self.engine.lock:
                if self.stop.is_set() or self.watch.aborted():
                    raise InterruptedError("generation over")
                slot = free_slot(self.engine.slots, committed, list(abandoned))
                if slot is not None:
                    self.writing = slot
                    reserved.append((slot, slot.step))
                    # snapshot 0 precedes the optimizer's state, so its size is not final: pinned from step 1 on
                    # shared: holders on this machine map it instead of receiving a copy (arena.py)
                    slot.reserve(job.layout.nbytes, pin=self.engine.cuda and job.step > 0, share=True)
            return bool(reserved) or skip

        deadline = time.monotonic() + self.ctx.config.collective_timeout_s
        try:
            plane.wait_until(self.inc.committed_key(), Commit, done, deadline)
        except TimeoutError:
            raise SwapAborted(f"no slot for snapshot {job.step}: nothing was committed before the collective "
                              "timeout") from None
        return reserved[0] if reserved else None

    def _report_memory(self) -> None:
        """What this rank's own slots hold in host memory, when it changes (the first snapshots size them)."""
        slots = self.engine.slots
        held = sum(s.buffer.numel() for s in slots)
        if held != self.engine.reported_bytes:
            self.engine.reported_bytes = held
            self.ctx.events.emit("slot_memory", bytes=held, slots=len(slots), pinned=any(s.pinned for s in slots))

    def _report(self, plane: ControlPlane) -> None:
        """Tells the coordinator which steps this rank holds durably (and which it skipped)."""
        steps = sorted(s.step for s in self.engine.slots if s.step in self.durable)
        fingerprints: dict[int, int] = {}
        if self.engine.replicated:
            # a resent snapshot has none: it was compared when it was taken
            self.fingerprints = fingerprints = {step: fp for step, fp in self.fingerprints.items() if step in steps}
            self.audits = {step: audit for step, audit in self.audits.items() if step in steps}
        plane.put(self.inc.durable_key(), Durable(self.inc.generation, self.inc.my_rank(), tuple(steps),
                                                  tuple(self.skipped), fingerprints, dict(self.audits)))

    def _connect(self, holder: str, plane: ControlPlane) -> None:
        if holder not in self.senders:
            prefix = self.inc.pair_prefix(self.inc.my_rank(), holder)

            def refused(why: str) -> None:
                self.ctx.events.emit("replica_stream_refused", holder=holder, peer=why)

            with communicating(f"connecting to holder {holder}"):
                self.senders[holder] = ReplicaSender(plane, prefix, self.ctx.secret(), self.inc.generation,
                                                     self.ctx.config.collective_timeout_s, self.stop.is_set, refused)

    def _replicate(self, slot: Slot, holder: str, plane: ControlPlane, replaced: int | None = None) -> int:
        """Sends `slot` to `holder`, returning the bytes streamed (0: mapped); `replaced`: the step the slot
        held before this snapshot (None: a resend)."""
        self._connect(holder, plane)

        def midway() -> None:
            self.ctx.faults.point("replicate", slot.step or 0)

        with communicating(f"replicating snapshot {slot.step} to {holder}"):
            try:
                return self.senders[holder].send(slot, midway, replaced)
            except ProtocolError as error:  # a corrupted transfer: send once more before giving up
                self.ctx.events.emit("replica_rejected", step=slot.step, holder=holder, error=str(error))
                return self.senders[holder].send(slot, replaced=replaced)
