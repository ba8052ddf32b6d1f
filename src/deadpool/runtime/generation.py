"""A generation as a value: the immutable incarnation the coordinator issued to this process.

Everything that lives for one generation (abort watch and heartbeat, snapshot thread, replica streams,
process group, the data-parallel attachment) is built from an Incarnation and can only name its keys,
so nothing of generation g can write into g+1's keys, slots or groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deadpool.protocol.keys import Keys, torchrun_env
from deadpool.protocol.plan import Plan

if TYPE_CHECKING:
    from deadpool.runtime.context import Context


@dataclass(frozen=True)
class Incarnation:
    """Generation `plan.generation` as seen by process `proc`, which is `rank` in it (None: a spare)."""

    plan: Plan
    proc: str
    rank: int | None
    keys: Keys

    @classmethod
    def of(cls, plan: Plan, proc: str, keys: Keys) -> "Incarnation":
        return cls(plan, proc, plan.rank_of(proc), keys)

    @property
    def generation(self) -> int:
        return self.plan.generation

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def my_rank(self) -> int:
        assert self.rank is not None, f"{self.proc} has no rank in generation {self.generation}"
        return self.rank

    # the keys of this generation, and only these
    def abort_key(self) -> str:
        return self.keys.abort(self.generation)

    def committed_key(self) -> str:
        return self.keys.committed(self.generation)

    def durable_key(self) -> str:
        return self.keys.durable(self.generation, self.my_rank())

    def group_prefix(self) -> str:
        return self.keys.group_prefix(self.generation)

    def pair_prefix(self, rank: int, holder: str) -> str:
        return self.keys.pair_prefix(self.generation, rank, holder)

    def transfer_prefix(self, rank: int) -> str:
        return self.keys.transfer_prefix(self.generation, rank)

    def ready_key(self) -> str:
        return self.keys.ready(self.generation, self.my_rank())

    def target_key(self) -> str:
        return self.keys.target(self.generation)

    def resumed_key(self) -> str:
        return self.keys.resumed(self.generation, self.my_rank())


def assume(ctx: Context, inc: Incarnation, *, gpu: int | None) -> None:
    """Makes `inc` this process's identity: the rank and generation its events and planned faults carry, and
    torchrun's variables (RANK, WORLD_SIZE, ...) the script reads, LOCAL_RANK naming `gpu`, the GPU this
    process trains on, if any (protocol/keys.torchrun_env). The only place identity changes; it is called
    wherever a process takes up an incarnation (its first, each recovery, a spare's standby)."""
    ctx.events.generation = inc.generation
    ctx.events.rank = ctx.faults.rank = inc.rank
    if inc.rank is not None:
        os.environ.update(torchrun_env(inc.rank, inc.world_size, ctx.config.nproc_per_node, gpu))
