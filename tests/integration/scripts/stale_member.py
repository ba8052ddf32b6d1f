"""A process of generation 0 that sleeps through its own replacement, then tries everything it used to do.

Started as `w1` of a running job (the environment of `deadpool run`), it takes generation 0's incarnation
at once and prints READY; the test then stops it (SIGSTOP) until w1 has been replaced, and wakes it
(SIGCONT). Each attempt prints one line `<what>: <outcome>` for the test to check.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Durable
from deadpool.runtime.context import Context, connect
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.plane import PlaneStore
from deadpool.runtime.recovery import Recovery
from deadpool.runtime.replica import ReplicaSender
from deadpool.runtime.slots import Slot, checksum

ctx = Context.from_environment()
inc = Incarnation.of(ctx.plan(0), ctx.proc, ctx.keys)
print("READY", flush=True)
while ctx.generation() == 0:  # stopped here by the test; woken once generation 0 is over
    time.sleep(0.05)


def attempt(what: str, action) -> None:
    try:
        print(f"{what}: {action()}", flush=True)
    except Exception as error:
        print(f"{what}: refused ({type(error).__name__}) {str(error).splitlines()[0][:160]}", flush=True)


def join() -> str:
    store = dist.PrefixStore(inc.group_prefix(), PlaneStore(connect(ctx.config, timeout_s=1.0)))
    dist.ProcessGroupGloo(store, inc.my_rank(), inc.world_size, timedelta(seconds=1))
    return "joined"


def replicate() -> str:
    holder = inc.plan.holders[1][0]
    sender = ReplicaSender(ControlPlane(connect(ctx.config, timeout_s=1.0)), inc.pair_prefix(inc.my_rank(), holder),
                           ctx.secret(), inc.generation, 1.0)
    slot = Slot()
    slot.reserve(8).copy_(torch.arange(8, dtype=torch.uint8))
    slot.seal(99, b"{}", checksum(b"{}", slot.data))
    sender.send(slot)
    return "sent"


ctx.plane.put(inc.durable_key(), Durable(inc.generation, inc.my_rank(), (99,), ()))  # keys name its generation only
print(f"durable key: {inc.durable_key().removeprefix(ctx.keys.prefix)}", flush=True)


class Nothing:
    def leave(self) -> None: ...


attempt("rejoin", lambda: Recovery(ctx, Nothing(), inc.generation, 5).run())  # type: ignore[arg-type]
attempt("join group", join)
attempt("replicate", replicate)
