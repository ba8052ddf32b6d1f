"""The recovery protocol, as one state machine run by every process that ends up in the new generation:
survivors (which roll back from their own slots) and takers (spares given a rank, which restore from
a replica). An idle spare that holds a taken rank's replica only streams it (spare.py, same helpers).

    AWAIT_PLAN --plan g+1 names me--> TRANSFER --my rank's replica is here--> REPORT --ready sent-->
    AWAIT_TARGET --target C--> JOIN --group g+1 joined--> RESTORE --C gathered, loaded--> RESUME --agree on C--> done
         ^                       |                          |                                       |
         +------- abort of g+1 (another failure), or joining, gathering or agreeing failed ---------+

The group is joined before the state is restored so that a spare's deadpool.init() returns with the
default group in place (the script may call torch.distributed at once), while its script builds the
model; the survivors wait for it in RESUME.

When nothing was committed yet (a rank died in start-up), the target is None: nothing is restored, and
every rank begins afresh (loop._begin), as at the job's start; a worker that had not joined generation 0
yet enters this machine from deadpool.init(), as a spare does.

A process the new plan no longer names has been fenced out: it must stop, never rejoin.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from typing import Callable, Protocol

from deadpool.errors import PeerFailure, SwapAborted, WorkerFailure
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Ready, Target
from deadpool.runtime.comms import communicating
from deadpool.runtime.context import Context, connect
from deadpool.runtime.failures import RECOVERABLE
from deadpool.runtime.generation import Incarnation, assume
from deadpool.runtime.replica import receive_replica, send_replica
from deadpool.runtime.slots import Slot


class State(enum.Enum):
    AWAIT_PLAN = "await_plan"      # wait for a generation newer than the failed one
    TRANSFER = "transfer"          # holders stream taken ranks' replicas to their takers
    REPORT = "report"              # tell the coordinator which steps this rank holds intact
    AWAIT_TARGET = "await_target"  # the coordinator picks the newest step every rank holds
    JOIN = "join"                  # join generation g+1's process group (the default group)
    RESTORE = "restore"            # load C into the live state
    RESUME = "resume"              # agree on C with every rank, restart snapshots


class Member(Protocol):
    """What the state machine needs from the process it recovers (member.Member implements it)."""

    gpu: int | None  # the GPU this process trains on, which its LOCAL_RANK names (None: the CPU)

    def leave(self) -> None:
        """Tears down everything of the current generation (idempotent)."""

    def replicas(self) -> dict[int, list[Slot]]:
        """Replicas of other ranks this process holds (a spare's), by rank."""

    def take(self, slots: list[Slot]) -> None:
        """Makes these slots this rank's own: a taker's state comes from them."""

    def holdings(self) -> list[int]:
        """The snapshot steps this rank can restore, checksums verified."""

    def join(self, inc: Incarnation) -> None:
        """Becomes inc's rank: joins its process group (the default group); PeerFailure if a peer fails meanwhile."""

    def restore(self, step: int) -> None:
        """Loads `step` into the live state; PeerFailure if a peer fails while the ranks gather their pieces."""

    def resume(self, step: int | None) -> None:
        """Checks every rank restored `step`, restarts snapshots; PeerFailure if a peer fails meanwhile.
        None: nothing to agree on, the step loop begins afresh."""


class Recovery:
    """One process's way from a failed generation to a running one. `run` may stop before a given state
    and be called again to go on: a spare that is given a rank runs it up to RESTORE inside deadpool.init()
    (hand over, receive, report, join), and goes on from there in session.run, once its script has built
    the state to restore into."""

    def __init__(self, ctx: Context, member: Member, failed_gen: int, failed_step: int | None,
                 inc: Incarnation | None = None) -> None:
        self.ctx, self.member, self.failed_step = ctx, member, failed_step
        self.state = State.AWAIT_PLAN if inc is None else State.TRANSFER
        self.inc = inc
        self.gen = failed_gen if inc is None else inc.generation
        self.deadline = time.monotonic() + ctx.config.plan_wait_s
        self.target: int | None = -1  # -1: not known yet; None: nothing was committed, begin afresh
        self.started = time.monotonic()
        self.marks: dict[str, float] = {}

    def run(self, until: State | None = None) -> tuple[Incarnation, int | None] | None:
        """Runs the states up to `until` (None if it stopped there), or to a running generation: returns it
        and the restored step (None: begin afresh). SwapAborted if the job ends, WorkerFailure if this process
        was fenced out."""
        while self.state is not until:
            done = self._advance()
            if done is not None:
                return done
        return None

    def _advance(self) -> tuple[Incarnation, int | None] | None:
        ctx, member = self.ctx, self.member
        if self.state is State.AWAIT_PLAN:
            member.leave()
            self.gen = ctx.wait_generation_after(self.gen, self.deadline)
            self.inc = Incarnation.of(ctx.plan(self.gen), ctx.proc, ctx.keys)
            if self.inc.rank is None:
                raise WorkerFailure(f"{ctx.proc} was fenced out of generation {self.gen} ({self.inc.plan.reason}); "
                                    "it must not rejoin")
            self.state = State.TRANSFER
            return None
        inc = self.inc
        assert inc is not None
        if self.state is State.TRANSFER:
            assume(ctx, inc, gpu=member.gpu)
            self.state = State.REPORT if _transfer(ctx, member, inc) else State.AWAIT_PLAN
        elif self.state is State.REPORT:
            if self.failed_step is not None:
                ctx.faults.point("recovery", self.failed_step)
            steps = member.holdings()
            ctx.plane.put(inc.ready_key(), Ready(inc.generation, inc.my_rank(), tuple(steps)))
            ctx.events.emit("recovery_ready", holds=steps, plan_reason=inc.plan.reason)
            ctx.ready_gen = inc.generation
            self.deadline = time.monotonic() + ctx.config.recovery_timeout_s
            self.state = State.AWAIT_TARGET
        elif self.state is State.AWAIT_TARGET:
            got = ctx.wait_key(inc.target_key(), self.deadline, give_up=(inc.abort_key(), ctx.keys.shutdown()))
            if got == ctx.keys.shutdown():
                raise SwapAborted("the coordinator gave up on this recovery and is shutting the job down")
            if got == inc.abort_key():
                self._again()
                return None
            self.target = ctx.plane.get(inc.target_key(), Target).step
            self.marks["agreed"] = time.monotonic()
            self.state = State.JOIN
        elif self.state is State.JOIN:
            if self._attempt(lambda: member.join(inc)):
                self.marks["joined"] = time.monotonic()
                self.state = State.RESTORE
        elif self.state is State.RESTORE:
            self.marks["restore"] = time.monotonic()
            target = self.target
            if target is None or self._attempt(lambda: member.restore(target)):
                self.marks["restored"] = time.monotonic()
                self.state = State.RESUME
        elif self.state is State.RESUME:
            if not self._attempt(lambda: member.resume(self.target)):
                return None
            t, now = self.marks, time.monotonic()
            ctx.events.emit("recovered", restored_step=self.target, negotiate_s=t["agreed"] - self.started,
                            restore_s=t["restored"] - t["restore"],
                            rebuild_s=(t["joined"] - t["agreed"]) + (now - t["restored"]), total_s=now - self.started)
            return inc, self.target
        return None

    def _attempt(self, action: Callable[[], None]) -> bool:
        """Joining or agreeing fails when another rank fails meanwhile (raised as PeerFailure where DeadPool
        communicates): the coordinator then publishes the next generation, which this process waits for.
        Any other error is a bug, and propagates: retrying it would hide it."""
        try:
            action()
            return True
        except RECOVERABLE as error:
            self.ctx.events.emit("rejoin_failed", state=self.state.value,
                                 error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            self._again()
            return False

    def _again(self) -> None:
        """Generation self.gen failed too: wait for the one after it."""
        self.deadline = time.monotonic() + self.ctx.config.plan_wait_s
        self.state = State.AWAIT_PLAN


def _transfer(ctx: Context, member: Member, inc: Incarnation) -> bool:
    """Streams the replicas this process must hand over, and receives (or adopts) its own rank's.
    False if the generation was aborted meanwhile."""
    rank, held = inc.my_rank(), member.replicas()
    stopped = lambda: any(ctx.plane.present([inc.abort_key(), ctx.keys.shutdown()]))  # noqa: E731
    sends = [threading.Thread(target=hand_over, args=(ctx, inc, r, held.get(r, [])), daemon=True,
                              name=f"deadpool-handover-r{r}") for r in inc.plan.sends_from(ctx.proc)]
    for thread in sends:
        thread.start()
    try:
        source = inc.plan.source_of(rank)
        if source is not None:
            deadline = time.monotonic() + ctx.config.recovery_timeout_s
            with communicating(f"receiving rank {rank}'s replica from {source}"):
                slots, rejected = receive_replica(ctx.plane, inc.transfer_prefix(rank), ctx.secret(), inc.generation,
                                                  ctx.config.collective_timeout_s, deadline, stopped)
            for mismatch in rejected:
                ctx.events.emit("replica_rejected", of_rank=rank, step=mismatch.step, source=source,
                                error=str(mismatch))
            member.take(slots)
            pieces = {s.step: json.loads(s.meta).get("slice") for s in slots if s.step is not None}
            ctx.events.emit("replica_received", of_rank=rank, source=source, slices=pieces)  # step -> piece held
        elif rank in held:
            member.take(held[rank])
    except (InterruptedError, TimeoutError, PeerFailure) as error:  # stopped, past the deadline, the holder failed
        ctx.events.emit("transfer_failed", of_rank=rank, error=str(error).splitlines()[0] if str(error) else "")
        return False
    finally:
        for thread in sends:
            thread.join(ctx.config.recovery_timeout_s)
    return True


def hand_over(ctx: Context, inc: Incarnation, rank: int, slots: list[Slot]) -> None:
    """A holder's part of TRANSFER: sends rank's replica to the process that takes the rank over (on a
    store client of its own: it may run beside the main thread's), until the generation is aborted (the
    taker died, or failed to come: the coordinator plans again)."""
    plane = ControlPlane(connect(ctx.config))
    over = lambda: any(plane.present([inc.abort_key(), ctx.keys.shutdown()]))  # noqa: E731
    try:
        sent = send_replica(plane, inc.transfer_prefix(rank), ctx.secret(), inc.generation, slots,
                            ctx.config.collective_timeout_s, over,
                            lambda: ctx.faults.point("handover", 0, rank=rank),
                            lambda: ctx.faults.point("handover_data", 0, rank=rank))
        ctx.events.emit("replica_handed_over", of_rank=rank, to=inc.plan.ranks[rank], snapshots=sent)
    except Exception as error:  # the taker died or the generation moved on: the coordinator decides what next
        ctx.events.emit("handover_failed", of_rank=rank, error=str(error).splitlines()[0] if str(error) else "")
