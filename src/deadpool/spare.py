"""A spare is a runtime in standby: it holds replicas of the ranks the plan assigns it until it becomes one.

Each assigned rank streams its snapshots into two slots here (runtime/holding.py). When a plan makes another
process take a rank whose replica this spare holds, it hands the replica over (recovery.hand_over).
When a plan names this spare as a rank, `run` returns: the session then recovers it with the same
state machine the survivors run (runtime/recovery.py), restoring from these slots or from a holder's.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

from deadpool.runtime.context import Context
from deadpool.runtime.generation import Incarnation, assume
from deadpool.runtime.holding import Holdings
from deadpool.runtime.persist import Persister
from deadpool.runtime.recovery import hand_over

IDLE_SLICE_S = 1.0  # how long the wait for the next generation blocks in the store per request (it has no give-up)


def _warm_up() -> None:
    """Pays now, while idle, for imports that would otherwise land on the recovery's critical path:
    creating the first torch optimizer imports torch._dynamo (about 0.9 s here)."""
    import torch._dynamo  # noqa: F401


class Standby:
    """The spare's loop between start and activation."""

    def __init__(self, ctx: Context, warmup: Callable[[], Any] | None = None) -> None:
        self.ctx = ctx
        self.warmup = warmup  # the script's warm-up (deadpool.init(warmup=...)), run once while holding
        self.held = Holdings(ctx)  # kept until no plan needs them
        self.persister = Persister(ctx, lambda rank: self.held.slots.get(rank, []))  # idle: it writes checkpoints
        self.waits = ctx.own_plane()  # the wait for the next generation blocks in the store: its own client

    def run(self) -> tuple[Incarnation, Holdings]:
        """Returns this spare's first incarnation with a rank, and the replicas it holds; exits the
        process when the job ends without needing it."""
        ctx, gen, named = self.ctx, -1, False
        _warm_up()
        while True:
            gen = self._next_generation(gen)
            inc = Incarnation.of(ctx.plan(gen), ctx.proc, ctx.keys)
            self.held.stop()
            if inc.rank is not None:
                ctx.events.emit("spare_called", as_rank=inc.rank, gen=gen)
                return inc, self.held
            if ctx.proc not in inc.plan.spares:
                if not named:  # a spare of a joining node: the plan that admits it comes once all of them started
                    continue
                ctx.events.emit("spare_dismissed", reason=inc.plan.reason)
                sys.exit(0)
            named = True
            assume(ctx, inc, gpu=None)  # no rank yet: only the generation changes
            for rank in inc.plan.sends_from(ctx.proc):
                hand_over(ctx, inc, rank, self.held.slots.get(rank, []))
            ctx.events.emit("spare_holding", ranks=self.held.start(inc))
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
        """Waits, for as long as the job runs, until the coordinator publishes a generation after `gen`: blocked
        in the store until the plan of `gen + 1` (or the shutdown) is written, not polling it. Once `gen` runs
        (its recovery is over), replicas of ranks this spare no longer holds are dropped."""
        ctx, pruned = self.ctx, gen < 0
        while True:
            keys = [ctx.keys.shutdown(), ctx.keys.plan(gen + 1), *([] if pruned else [ctx.keys.running(gen)])]
            found = self.waits.wait(keys, float("inf"), slice_s=IDLE_SLICE_S)
            if found == ctx.keys.shutdown():
                self.held.stop()
                ctx.events.emit("spare_released")
                sys.exit(0)
            if found == ctx.keys.running(gen):
                self.held.keep_only(ctx.plan(gen).held_by(ctx.proc))
                pruned = True
                continue
            # the plan is written just before the generation number (coordinator/server._publish)
            while (published := ctx.generation()) <= gen:
                time.sleep(ctx.config.poll_interval_s)
            return published
