"""Replicas this process holds for other ranks: one receiver thread per held rank, for one generation.

A spare holds them while it waits (spare.py); a worker holds its peers' when spares run short
(coordinator/policy.place_replicas). Each held rank streams its snapshots into two slots here
(replica.py); a recovery hands them to the rank's taker (recovery.hand_over). The slots of a rank
outlive the generation that filled them, until a plan no longer names this process as its holder.
"""

from __future__ import annotations

import threading

from deadpool.errors import ChecksumMismatch
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Commit
from deadpool.runtime.context import Context, connect
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.replica import ReplicaReceiver
from deadpool.runtime.slots import Slot
from deadpool.runtime.stream import StreamClosed


class Receiver:
    """One thread receiving one rank's snapshots for one generation, into slots of its own."""

    def __init__(self, ctx: Context, inc: Incarnation, rank: int, slots: list[Slot]) -> None:
        self.ctx, self.inc, self.rank, self.slots = ctx, inc, rank, slots
        self.stop = threading.Event()
        self.receiver: ReplicaReceiver | None = None
        self.thread = threading.Thread(target=self._run, name=f"deadpool-replica-r{rank}-g{inc.generation}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ctx, key = self.ctx, self.inc.committed_key()
        reported = (0, 0)
        try:
            plane = ControlPlane(connect(ctx.config))
            self.receiver = ReplicaReceiver(plane, self.inc.pair_prefix(self.rank, ctx.proc), ctx.secret(),
                                            self.inc.generation, self.slots, ctx.config.collective_timeout_s,
                                            stopped=self.stop.is_set)
            while not self.stop.is_set():
                try:
                    slot = self.receiver.receive_one(lambda: plane.get(key, Commit).step, self.stop.is_set)
                except ChecksumMismatch as error:  # the stream goes on: the sender sends it once more
                    ctx.events.emit("replica_rejected", of_rank=self.rank, error=str(error))
                    continue
                ranges = slot.held()
                if ranges and ctx.faults.should_corrupt(self.rank, slot.step or 0):
                    start, end = ranges[0]
                    slot.buffer[(start + end) // 2] ^= 0xFF  # a bit flip in host memory, after the ack
                memory = (sum(s.buffer.numel() for s in self.slots if not s.mapped),
                          sum(s.buffer.numel() for s in self.slots if s.mapped))
                if memory != reported:  # the slots grew (the first snapshots): what holding this rank costs
                    # `held`: the bytes of it this holder was sent (a data-parallel piece and the private
                    # state; 0 when it mapped the sender's arena); `mapped`: the sender's arenas mapped here
                    ctx.events.emit("replica_memory", of_rank=self.rank, bytes=memory[0], mapped=memory[1],
                                    pinned=slot.pinned, held=0 if slot.mapped else sum(b - a for a, b in ranges))
                    reported = memory
        except (InterruptedError, StreamClosed):  # told to stop; the sender closed its stream between snapshots
            pass
        except Exception as error:  # the sender died or moved on: its stream is over, the slots stay
            if not self.stop.is_set():
                ctx.events.emit("replica_stream_ended", of_rank=self.rank, error=str(error).splitlines()[0])
        finally:
            if self.receiver is not None:
                self.receiver.close()

    def close(self, timeout_s: float) -> None:
        """Stops the thread; if it does not stop in time, the slot it was filling is swapped for a fresh
        one, so the abandoned thread can never write into a slot that is in use again."""
        self.stop.set()
        if self.receiver is not None:  # wakes the idle wait (or ends a transfer) at once
            self.receiver.stream.interrupt()
        self.thread.join(timeout_s)
        writing = self.receiver.writing if self.receiver else None
        if self.thread.is_alive() and writing is not None and writing in self.slots:
            self.slots[self.slots.index(writing)] = Slot()
            self.ctx.events.emit("replica_receiver_abandoned", of_rank=self.rank, gen=self.inc.generation)


class Holdings:
    """The replicas one process holds, by rank, and the receivers filling them in the current generation."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.slots: dict[int, list[Slot]] = {}  # rank -> its replica slots
        self.receivers: list[Receiver] = []

    def start(self, inc: Incarnation) -> list[int]:
        """Receives the snapshots of every rank inc's plan has this process hold; returns those ranks."""
        assert not self.receivers, "stop the previous generation's receivers first"
        held = inc.plan.held_by(self.ctx.proc)
        for rank in held:
            self.slots.setdefault(rank, [Slot(), Slot()])
        self.receivers = [Receiver(self.ctx, inc, rank, self.slots[rank]) for rank in held]
        return held

    def stop(self) -> None:
        for receiver in self.receivers:
            receiver.stop.set()
        for receiver in self.receivers:
            receiver.close(timeout_s=2.0)
        self.receivers = []

    def keep_only(self, ranks: list[int]) -> None:
        """Drops the replicas of ranks this process no longer holds (their host memory goes with them)."""
        for rank in set(self.slots) - set(ranks):
            self.ctx.events.emit("replica_memory", of_rank=rank, bytes=0, mapped=0, pinned=False)
        self.slots = {rank: slots for rank, slots in self.slots.items() if rank in ranks}
