"""The decisions every rank takes together, each one small collective of DeadPool's own.

To stop after a step (session.stop() on any rank, or the run's last step, which every rank must agree on),
how often to snapshot (`auto`), and that a recovery restored the same state everywhere. A failure in one
is a peer's (PeerFailure)."""

from __future__ import annotations

import math
import statistics
import zlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from deadpool.errors import ProtocolError, UsageError
from deadpool.runtime.comms import DataParallel, collective

if TYPE_CHECKING:
    from deadpool.runtime.member import Member


UNLIMITED = 2**62  # session.run(steps=None): until session.stop()


def agree_to_stop(member: Member, requested: bool, steps: int | None) -> bool:
    """True on every rank if any rank called stop() in this step (one small all-reduce per step).

    The same all-reduce checks that every rank runs to the same `steps` (its maximum and minimum): a rank
    that ended earlier than its peers would leave them waiting on it, and the rank that waited would be
    taken for hung. A UsageError names the disagreement instead, on every rank at the first step.

    It stays a collective of its own instead of riding on the gradients' last bucket: a rank may call
    stop() after backward (on the step's loss, after the optimizer step), which a bucket launched during
    backward cannot carry without stopping a step late; a step may run no backward at all, or several of
    which only the last reduces; and a float sum inside the last bucket would change that bucket's length,
    so where gloo's ring cuts it, and so the bits of the gradients beyond 2 ranks."""
    limit = UNLIMITED if steps is None else steps
    flags = torch.tensor([int(requested), limit, -limit], dtype=torch.int64, device=member.device)
    _all_reduce_max(member, flags, "stop", "the stop agreement")
    most, fewest = int(flags[1]), -int(flags[2])
    if most != fewest:
        def said(n: int) -> str:
            return "None (until session.stop())" if n == UNLIMITED else str(n)
        raise UsageError(f"the ranks disagree on the steps to run: session.run(steps=...) is {said(fewest)} on "
                         f"some ranks and {said(most)} on others (rank {member.rank}: {said(limit)}). Give every "
                         "rank the same steps; a spare runs the script's set-up when it takes a rank, so steps "
                         "computed from the script's own files (a resumed checkpoint) may differ there")
    return bool(flags[0].item())


def agree_on_interval(member: Member) -> int:
    """`auto`: the densest interval whose snapshot cost stays within the budget; ranks take the max.

    Every rank decides at the same step (a collective), whatever it measured: a spare that just took over
    has measured little, and the others' costs decide."""
    config, engine = member.ctx.config, member.engine
    cost = statistics.median(engine.costs) if engine.costs else 0.0
    step_s = statistics.median(member.progress.step_times)
    chosen = torch.tensor([max(1, math.ceil(cost / (config.snapshot_budget * step_s)))], dtype=torch.int64,
                          device=member.device)
    _all_reduce_max(member, chosen, "all_reduce", "the snapshot interval agreement")
    every = int(chosen.item())
    # what the interval costs a recovery: a failure just before the next snapshot is committed replays
    # up to `every` steps (every / 2 on average)
    member.ctx.events.emit("snapshot_interval", every=every, cost_s=cost, step_s=step_s, budget=config.snapshot_budget,
                           replay_steps=every, replay_s=every * step_s)
    if member.rank == 0:
        print(f"[deadpool] snapshot-every auto: a snapshot costs {cost * 1e3:.0f} ms, "
              f"a step {step_s * 1e3:.0f} ms; snapshotting every {every} steps keeps it within "
              f"{config.snapshot_budget:.1%}; a failure replays up to {every} steps ({every * step_s:.1f} s)",
              flush=True)
    return every


def agree_on_restore(member: Member, target: int) -> None:
    """All ranks must hold the same step and, data-parallel, bit-identical parameters (sharded, each rank's
    own shards: those are checked against the snapshot's checksum when it is restored). They also agree on
    the frontier, the furthest step any of them had completed, so that every rank (a spare, which ran none)
    sees the same steps as replays."""
    assert member.watch is not None
    crc = 0
    if isinstance(member.model, DataParallel):
        for p in member.model.module.parameters():
            crc = zlib.crc32(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
    mine = torch.tensor([target, crc, member.frontier], dtype=torch.int64, device=member.device)
    everyone = [torch.zeros_like(mine) for _ in range(member.world_size)]
    with member.progress.waiting_for("agree"):
        collective(lambda: dist.all_gather(everyone, mine, async_op=True), member.watch.aborted,
                   member.ctx.config.collective_timeout_s, "the agreement on the restored state")
    if any(not torch.equal(other[:2], mine[:2]) for other in everyone):
        raise ProtocolError(f"ranks disagree on the restored state: {[t[:2].tolist() for t in everyone]}")
    member.frontier = max(int(other[2]) for other in everyone)


def _all_reduce_max(member: Member, tensor: torch.Tensor, phase: str, what: str) -> None:
    assert member.watch is not None
    with member.progress.waiting_for(phase):
        collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True), member.watch.aborted,
                   member.ctx.config.collective_timeout_s, what)
