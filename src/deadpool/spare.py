"""A spare is a runtime in standby: it holds replicas of the ranks the plan assigns it until it becomes one.

Each assigned rank streams its snapshots into two slots here (replica.py). When a plan makes another
process take a rank whose replica this spare holds, it hands the replica over (recovery.hand_over).
When a plan names this spare as a rank, `run` returns: the session then recovers it with the same
state machine the survivors run (runtime/recovery.py), restoring from these slots or from a holder's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable

from deadpool.errors import ProtocolError
from deadpool.runtime.context import Context, connect
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.recovery import hand_over
from deadpool.runtime.replica import ReplicaReceiver
from deadpool.runtime.slots import Slot


class _Receiver:
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
        try:
            store = connect(ctx.config)
            self.receiver = ReplicaReceiver(store, self.inc.pair_prefix(self.rank, ctx.proc), ctx.config.token,
                                            self.inc.generation, self.slots, ctx.config.collective_timeout_s)
            while not self.stop.is_set():
                try:
                    slot = self.receiver.receive_one(lambda: json.loads(store.get(key))["step"], self.stop.is_set)
                except ProtocolError as error:
                    ctx.events.emit("replica_rejected", of_rank=self.rank, error=str(error))
                    continue
                if ctx.faults.should_corrupt(self.rank, slot.step or 0):
                    slot.buffer[slot.nbytes // 2] ^= 0xFF  # a bit flip in host memory, after the ack
        except InterruptedError:
            pass
        except Exception as error:  # the sender died or moved on: its stream is over, the slots stay
            if not self.stop.is_set():
                ctx.events.emit("replica_stream_ended", of_rank=self.rank, error=str(error).splitlines()[0])

    def close(self, timeout_s: float) -> None:
        """Stops the thread; if it does not stop in time, the slot it was filling is swapped for a fresh
        one, so the abandoned thread can never write into a slot that is in use again."""
        self.stop.set()
        self.thread.join(timeout_s)
        writing = self.receiver.writing if self.receiver else None
        if self.thread.is_alive() and writing is not None and writing in self.slots:
            self.slots[self.slots.index(writing)] = Slot()
            self.ctx.events.emit("replica_receiver_abandoned", of_rank=self.rank, gen=self.inc.generation)


def _warm_up() -> None:
    """Pays now, while idle, for imports that would otherwise land on the recovery's critical path:
    creating the first torch optimizer imports torch._dynamo (about 0.9 s here)."""
    import torch._dynamo  # noqa: F401


class Standby:
    """The spare's loop between start and activation."""

    def __init__(self, ctx: Context, warmup: Callable[[], Any] | None = None) -> None:
        self.ctx = ctx
        self.warmup = warmup  # the script's warm-up (deadpool.init(warmup=...)), run once while holding
        self.slots: dict[int, list[Slot]] = {}  # rank -> its replica slots (kept until no plan needs them)
        self.receivers: list[_Receiver] = []

    def run(self) -> tuple[Incarnation, dict[int, list[Slot]]]:
        """Returns this spare's first incarnation with a rank, and the replicas it holds; exits the
        process when the job ends without needing it."""
        ctx, gen = self.ctx, -1
        _warm_up()
        while True:
            gen = self._next_generation(gen)
            inc = Incarnation.of(ctx.plan(gen), ctx.proc, ctx.keys)
            self._stop_receivers()
            if inc.rank is not None:
                ctx.events.emit("spare_called", as_rank=inc.rank, gen=gen)
                return inc, self.slots
            if ctx.proc not in inc.plan.spares:
                ctx.events.emit("spare_dismissed", reason=inc.plan.reason)
                sys.exit(0)
            ctx.events.generation = gen
            for rank in inc.plan.sends_from(ctx.proc):
                hand_over(ctx, inc, rank, self.slots.get(rank, []))
            held = inc.plan.held_by(ctx.proc)
            for rank in held:
                self.slots.setdefault(rank, [Slot(), Slot()])
            self.receivers = [_Receiver(ctx, inc, r, self.slots[r]) for r in held]
            ctx.events.emit("spare_holding", ranks=held)
            self._warm_up_script()

    def _warm_up_script(self) -> None:
        """Runs the script's warm-up once, on this (main) thread, while the receivers keep receiving in
        theirs; a plan published meanwhile is acted on when it is done."""
        if self.warmup is None:
            return
        warmup, self.warmup = self.warmup, None
        start = time.monotonic()
        warmup()
        self.ctx.events.emit("spare_warmed_up", duration_s=time.monotonic() - start)

    def _next_generation(self, gen: int) -> int:
        """Waits, for as long as the job runs, until the coordinator publishes a generation after `gen`.
        Once `gen` runs (its recovery is over), replicas of ranks this spare no longer holds are dropped."""
        ctx, pruned = self.ctx, False
        while True:
            if ctx.store.check([ctx.keys.shutdown()]):
                self._stop_receivers()
                ctx.events.emit("spare_released")
                sys.exit(0)
            if ctx.store.check([ctx.keys.generation()]) and ctx.generation() > gen:
                return ctx.generation()
            if not pruned and gen >= 0 and ctx.store.check([ctx.keys.running(gen)]):
                held = set(ctx.plan(gen).held_by(ctx.proc))
                self.slots = {r: s for r, s in self.slots.items() if r in held}
                pruned = True
            time.sleep(ctx.config.poll_interval_s)

    def _stop_receivers(self) -> None:
        for receiver in self.receivers:
            receiver.stop.set()
        for receiver in self.receivers:
            receiver.close(timeout_s=2.0)
        self.receivers = []
