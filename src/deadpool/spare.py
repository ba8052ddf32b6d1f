"""A spare is a runtime in standby: it holds replicas of the ranks the plan assigns it until it becomes one.

Each assigned rank streams its snapshots into two slots here (replica.py). When a plan names this
spare as a rank, it stops receiving, reports which of that rank's snapshots pass their checksum,
and takes over with the agreed one; its replica slots become its own local slots.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from deadpool.errors import ProtocolError
from deadpool.runtime.context import Context, connect
from deadpool.runtime.recovery import Agreement, negotiate
from deadpool.runtime.replica import ReplicaReceiver
from deadpool.runtime.slots import Slot


class _Receiver:
    """One thread receiving one rank's snapshots for one generation."""

    def __init__(self, ctx: Context, gen: int, rank: int, slots: list[Slot]) -> None:
        self.ctx, self.gen, self.rank, self.slots = ctx, gen, rank, slots
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"deadpool-replica-r{rank}-g{gen}", daemon=True)
        self.thread.start()

    def _committed(self, store: object) -> int | None:
        key = self.ctx.keys.committed()
        return json.loads(store.get(key))["step"] if store.check([key]) else None

    def _run(self) -> None:
        ctx = self.ctx
        try:
            store = connect(ctx.config)
            prefix = ctx.keys.pair_prefix(self.gen, self.rank, ctx.proc)
            receiver = ReplicaReceiver(store, prefix, ctx.config.token, self.gen, self.slots,
                                       ctx.config.collective_timeout_s)
            while not self.stop.is_set():
                try:
                    slot = receiver.receive_one(lambda: self._committed(store), self.stop.is_set)
                except ProtocolError as error:
                    ctx.events.emit("replica_rejected", of_rank=self.rank, error=str(error))
                    continue
                if ctx.faults.should_corrupt(self.rank, slot.step):
                    slot.buffer[slot.nbytes // 2] ^= 0xFF  # a bit flip in host memory, after the ack
        except InterruptedError:
            pass
        except Exception as error:  # the sender died or moved on: its stream is over, the slots stay
            if not self.stop.is_set():
                ctx.events.emit("replica_stream_ended", of_rank=self.rank, error=str(error).splitlines()[0])


def _warm_up() -> None:
    """Pays now, while idle, for imports that would otherwise land on the recovery's critical path:
    creating the first torch optimizer imports torch._dynamo (about 0.9 s here)."""
    import torch._dynamo  # noqa: F401


class Standby:
    """The spare's loop between start and activation."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.slots: dict[int, list[Slot]] = {}
        self.receivers: list[_Receiver] = []

    def run(self) -> tuple[Agreement, list[Slot]]:
        """Returns once activated; exits the process when the job ends without needing this spare."""
        ctx, gen = self.ctx, -1
        _warm_up()
        while True:
            new_gen = self._next_generation(gen)
            plan = ctx.plan(new_gen)
            self._stop_receivers()
            if plan.rank_of(ctx.proc) is not None:
                return self._activate(new_gen, plan.rank_of(ctx.proc))
            if ctx.proc not in plan.spares:
                ctx.events.emit("spare_dismissed", reason=plan.reason)
                sys.exit(0)
            held = plan.held_by(ctx.proc)
            self.slots = {r: self.slots.get(r) or [Slot(), Slot()] for r in held}
            self.receivers = [_Receiver(ctx, new_gen, r, self.slots[r]) for r in held]
            ctx.events.generation = gen = new_gen
            ctx.events.emit("spare_holding", ranks=held)

    def _next_generation(self, gen: int) -> int:
        """Waits, for as long as the job runs, until the coordinator publishes a generation after `gen`."""
        ctx = self.ctx
        while True:
            if ctx.store.check([ctx.keys.shutdown()]):
                self._stop_receivers()
                ctx.events.emit("spare_released")
                sys.exit(0)
            if ctx.store.check([ctx.keys.generation()]) and ctx.generation() > gen:
                return ctx.generation()
            time.sleep(ctx.config.poll_interval_s)

    def _stop_receivers(self) -> None:
        for receiver in self.receivers:
            receiver.stop.set()
        for receiver in self.receivers:
            receiver.thread.join(2.0)
        self.receivers = []

    def _activate(self, gen: int, rank: int) -> tuple[Agreement, list[Slot]]:
        slots = self.slots.get(rank, [Slot(), Slot()])

        def verified_steps() -> list[int]:
            steps = []
            for slot in slots:
                if slot.step is None:
                    continue
                if slot.intact():
                    steps.append(slot.step)
                else:
                    self.ctx.events.emit("replica_rejected", of_rank=rank, step=slot.step,
                                         error="checksum mismatch in holder memory; never restored from")
            return sorted(steps)

        self.ctx.events.emit("spare_called", as_rank=rank, gen=gen)
        agreement = negotiate(self.ctx, gen - 1, verified_steps, self.ctx.config.decision_timeout_s)
        return agreement, slots
