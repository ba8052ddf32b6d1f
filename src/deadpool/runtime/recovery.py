"""The participant's side of a recovery, shared by survivors and the activated spare.

    AWAIT_PLAN --(plan g+1 names me)--> REPORT --(ready/{rank} set)--> AWAIT_TARGET
        ^                                                                 |
        +------------------ abort/{g+1}: another failure -----------------+
                                                                          v
                                                                   target C agreed

A process the new plan no longer names has been fenced out: it must stop, never rejoin.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass
from typing import Callable

from deadpool.coordinator.protocol import Plan
from deadpool.errors import SwapAborted, WorkerFailure
from deadpool.runtime.context import Context


class Phase(enum.Enum):
    AWAIT_PLAN = "await_plan"
    REPORT = "report"
    AWAIT_TARGET = "await_target"


@dataclass(frozen=True)
class Agreement:
    plan: Plan
    rank: int
    target: int


def negotiate(ctx: Context, after_gen: int, holdings: Callable[[], list[int]], first_deadline_s: float) -> Agreement:
    """Waits for a plan newer than `after_gen`, reports the intact snapshots, returns the restore target."""
    phase, gen = Phase.AWAIT_PLAN, after_gen
    deadline = time.monotonic() + first_deadline_s
    plan, rank = None, -1
    while True:
        if phase is Phase.AWAIT_PLAN:
            gen = ctx.wait_generation_after(gen, deadline)
            plan = ctx.plan(gen)
            rank = plan.rank_of(ctx.proc)
            if rank is None:
                raise WorkerFailure(f"{ctx.proc} was fenced out of generation {gen} ({plan.reason}); it must not rejoin")
            ctx.events.generation, ctx.events.rank = gen, rank
            phase = Phase.REPORT
        elif phase is Phase.REPORT:
            steps = holdings()
            ctx.store.set(ctx.keys.ready(gen, rank), json.dumps(steps))
            ctx.events.emit("recovery_ready", holds=steps, plan_reason=plan.reason)
            deadline = time.monotonic() + ctx.config.recovery_timeout_s
            phase = Phase.AWAIT_TARGET
        elif phase is Phase.AWAIT_TARGET:
            target_key, abort_key = ctx.keys.target(gen), ctx.keys.abort(gen)
            try:
                got = ctx.wait_key(target_key, deadline, give_up=(abort_key, ctx.keys.shutdown()))
            except SwapAborted:
                raise SwapAborted(f"generation {gen}: the coordinator chose no restore step in time") from None
            if got == ctx.keys.shutdown():
                raise SwapAborted("the coordinator gave up on this recovery and is shutting the job down")
            if got == abort_key:
                deadline = time.monotonic() + ctx.config.decision_timeout_s
                phase = Phase.AWAIT_PLAN
                continue
            return Agreement(plan, rank, int(ctx.store.get(target_key)))
