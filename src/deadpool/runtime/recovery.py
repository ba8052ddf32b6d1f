"""The recovery protocol, as one state machine run by every process that ends up in the new generation:
survivors (which roll back from their own slots) and takers (spares given a rank, which restore from
a replica). An idle spare that holds a taken rank's replica only streams it (spare.py, same helpers).

    AWAIT_PLAN --plan g+1 names me--> TRANSFER --my rank's replica is here--> REPORT --ready sent-->
    AWAIT_TARGET --target C--> RESTORE --C loaded--> REJOIN --group joined, all agree on C--> done
         ^                        |                                    |                 |
         +------- abort of g+1 (another failure), or the rejoin failed -+-----------------+

A process the new plan no longer names has been fenced out: it must stop, never rejoin.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from deadpool.errors import SwapAborted, WorkerFailure
from deadpool.runtime.context import Context
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.replica import receive_replica, send_replica
from deadpool.runtime.slots import Slot


class State(enum.Enum):
    AWAIT_PLAN = "await_plan"      # wait for a generation newer than the failed one
    TRANSFER = "transfer"          # holders stream taken ranks' replicas to their takers
    REPORT = "report"              # tell the coordinator which steps this rank holds intact
    AWAIT_TARGET = "await_target"  # the coordinator picks the newest step every rank holds
    RESTORE = "restore"            # load it into the live state
    REJOIN = "rejoin"              # join the new group, agree on it, restart snapshots


class Member(Protocol):
    """What the state machine needs from the process it recovers (the Session implements it)."""

    def leave(self) -> None:
        """Tears down everything of the current generation (idempotent)."""

    def replicas(self) -> dict[int, list[Slot]]:
        """Replicas of other ranks this process holds (a spare's), by rank."""

    def take(self, slots: list[Slot]) -> None:
        """Makes these slots this rank's own: a taker's state comes from them."""

    def holdings(self) -> list[int]:
        """The snapshot steps this rank can restore, checksums verified."""

    def restore(self, step: int) -> None: ...

    def rejoin(self, inc: Incarnation, step: int) -> None:
        """Joins inc's group, checks every rank restored `step`, restarts snapshots; raises if that fails."""


@dataclass
class Timings:
    """Where a recovery's time went, for the `recovered` event."""

    started: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()


def recover(ctx: Context, member: Member, failed_gen: int, failed_step: int,
            inc: Incarnation | None = None) -> tuple[Incarnation, int]:
    """Runs the state machine from the failure of `failed_gen` in `failed_step` (or, for a spare already
    named by `inc`, from its TRANSFER) to a running generation; returns it and the restored step.
    SwapAborted if the job ends."""
    state = State.AWAIT_PLAN if inc is None else State.TRANSFER
    gen = failed_gen if inc is None else inc.generation
    deadline = time.monotonic() + ctx.config.collective_timeout_s
    target = -1
    timings = Timings()
    while True:
        if state is State.AWAIT_PLAN:
            member.leave()
            gen = ctx.wait_generation_after(gen, deadline)
            inc = Incarnation.of(ctx.plan(gen), ctx.proc, ctx.keys)
            if inc.rank is None:
                raise WorkerFailure(f"{ctx.proc} was fenced out of generation {gen} ({inc.plan.reason}); "
                                    "it must not rejoin")
            ctx.events.generation, ctx.events.rank, ctx.faults.rank = gen, inc.rank, inc.rank
            state = State.TRANSFER
        elif state is State.TRANSFER:
            assert inc is not None
            ctx.events.generation, ctx.events.rank, ctx.faults.rank = gen, inc.rank, inc.rank
            state = State.REPORT if _transfer(ctx, member, inc) else State.AWAIT_PLAN
        elif state is State.REPORT:
            assert inc is not None
            ctx.faults.point("recovery", failed_step)
            steps = member.holdings()
            ctx.store.set(inc.ready_key(), json.dumps(steps))
            ctx.events.emit("recovery_ready", holds=steps, plan_reason=inc.plan.reason)
            deadline = time.monotonic() + ctx.config.recovery_timeout_s
            state = State.AWAIT_TARGET
        elif state is State.AWAIT_TARGET:
            assert inc is not None
            got = ctx.wait_key(inc.target_key(), deadline, give_up=(inc.abort_key(), ctx.keys.shutdown()))
            if got == ctx.keys.shutdown():
                raise SwapAborted("the coordinator gave up on this recovery and is shutting the job down")
            if got == inc.abort_key():
                deadline = time.monotonic() + ctx.config.collective_timeout_s
                state = State.AWAIT_PLAN
                continue
            target = int(ctx.store.get(inc.target_key()))
            timings.mark("agreed")
            state = State.RESTORE
        elif state is State.RESTORE:
            member.restore(target)
            timings.mark("restored")
            state = State.REJOIN
        elif state is State.REJOIN:
            assert inc is not None
            try:
                member.rejoin(inc, target)
            except Exception as error:  # a failure while rejoining: the coordinator publishes the next generation
                ctx.events.emit("rejoin_failed", error=f"{type(error).__name__}: {str(error).splitlines()[0]}")
                deadline = time.monotonic() + ctx.config.collective_timeout_s
                state = State.AWAIT_PLAN
                continue
            timings.mark("rejoined")
            t = timings.marks
            ctx.events.emit("recovered", restored_step=target, negotiate_s=t["agreed"] - timings.started,
                            restore_s=t["restored"] - t["agreed"], rebuild_s=t["rejoined"] - t["restored"],
                            total_s=t["rejoined"] - timings.started)
            return inc, target


def _transfer(ctx: Context, member: Member, inc: Incarnation) -> bool:
    """Streams the replicas this process must hand over, and receives (or adopts) its own rank's.
    False if the generation was aborted meanwhile."""
    rank, held = inc.my_rank(), member.replicas()
    stopped = lambda: ctx.store.check([inc.abort_key()]) or ctx.store.check([ctx.keys.shutdown()])  # noqa: E731
    sends = [threading.Thread(target=hand_over, args=(ctx, inc, r, held.get(r, [])), daemon=True,
                              name=f"deadpool-handover-r{r}") for r in inc.plan.sends_from(ctx.proc)]
    for thread in sends:
        thread.start()
    try:
        source = inc.plan.source_of(rank)
        if source is not None:
            deadline = time.monotonic() + ctx.config.recovery_timeout_s
            member.take(receive_replica(ctx.store, inc.transfer_prefix(rank), ctx.config.token, inc.generation,
                                        ctx.config.collective_timeout_s, deadline, stopped))
            ctx.events.emit("replica_received", of_rank=rank, source=source)
        elif rank in held:
            member.take(held[rank])
    except (InterruptedError, TimeoutError, RuntimeError) as error:
        ctx.events.emit("transfer_failed", of_rank=rank, error=str(error).splitlines()[0] if str(error) else "")
        return False
    finally:
        for thread in sends:
            thread.join(ctx.config.recovery_timeout_s)
    return True


def hand_over(ctx: Context, inc: Incarnation, rank: int, slots: list[Slot]) -> None:
    """A holder's part of TRANSFER: sends rank's replica to the process that takes the rank over."""
    try:
        sent = send_replica(ctx.store, inc.transfer_prefix(rank), ctx.config.token, inc.generation, slots,
                            ctx.config.collective_timeout_s)
        ctx.events.emit("replica_handed_over", of_rank=rank, to=inc.plan.ranks[rank], snapshots=sent)
    except Exception as error:  # the taker died or the generation moved on: the coordinator decides what next
        ctx.events.emit("handover_failed", of_rank=rank, error=str(error).splitlines()[0] if str(error) else "")
