"""The decisions every rank takes together, each one small collective of DeadPool's own.

To stop after a step (session.stop() on any rank, or the run's last step, which every rank must agree on),
how often to snapshot (`auto`), and that a recovery restored the same state everywhere. A failure in one
is a peer's (PeerFailure)."""

from __future__ import annotations

import statistics
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deadpool.errors import ProtocolError, UsageError
from deadpool.runtime.cadence import Price, longest_gap, price
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
    _all_reduce(member, flags, dist.ReduceOp.MAX, "stop", "the stop agreement")
    most, fewest = int(flags[1]), -int(flags[2])
    if most != fewest:
        def said(n: int) -> str:
            return "None (until session.stop())" if n == UNLIMITED else str(n)
        raise UsageError(f"the ranks disagree on the steps to run: session.run(steps=...) is {said(fewest)} on "
                         f"some ranks and {said(most)} on others (rank {member.rank}: {said(limit)}). Give every "
                         "rank the same steps; a spare runs the script's set-up when it takes a rank, so steps "
                         "computed from the script's own files (a resumed checkpoint) may differ there")
    return bool(flags[0].item())


def agree_on_interval(member: Member, step: int, durations: dict[int, float], snapshotted: set[int],
                      current: int | None) -> int:
    """`auto`: the densest interval whose measured cost stays within the budget (cadence.py); `current` is
    the interval agreed before (None at the calibration's end).

    Every rank decides at the same step (a collective) from the mean of the ranks' measurements (the
    ranks run in step, so each measures the same cost with its own noise; the max of them would pick
    too sparse an interval). A spare that took a rank over recently has timed too few blocks and abstains. If
    no rank measured one, the interval stays; at the calibration's end the engine's busy time prices a
    snapshot instead (an upper bound: steps cannot lose more than the time the work runs beside them)."""
    config, engine = member.ctx.config, member.engine
    busy = statistics.median(engine.costs) if engine.costs else 0.0
    measured = price(durations, snapshotted)
    fallback = Price(cost_s=busy, step_s=statistics.median(member.progress.step_times), blocks=0)
    # sums over the ranks, in float64: an all-reduce leaves the same bits on every rank, so every rank
    # computes the same interval from them
    sums = torch.tensor([measured.cost_s if measured else 0.0, measured.step_s if measured else 0.0,
                         1.0 if measured else 0.0, fallback.cost_s, fallback.step_s, 1.0],
                        dtype=torch.float64, device=member.device)
    _all_reduce(member, sums, dist.ReduceOp.SUM, "all_reduce", "the snapshot interval agreement")
    cost_s, step_s, n, busy_s, busy_step_s, ranks = sums.tolist()
    used = (Price(cost_s=cost_s / n, step_s=step_s / n, blocks=measured.blocks if measured else 0) if n else
            Price(cost_s=busy_s / ranks, step_s=busy_step_s / ranks, blocks=0))
    every = current if current is not None and not n else used.interval(config.snapshot_budget)
    # what the interval costs a recovery: a failure just before the next snapshot is committed replays
    # up to the longest gap between two snapshots (`every`, more around a probe: cadence.py)
    replay = longest_gap(every)
    member.ctx.events.emit("snapshot_interval", at_step=step, every=every, was=current, cost_s=used.cost_s,
                           step_s=used.step_s, my_cost_s=measured.cost_s if measured else None, busy_s=busy,
                           blocks=measured.blocks if measured else 0, ranks_measured=int(n),
                           budget=config.snapshot_budget, replay_steps=replay, replay_s=replay * used.step_s)
    if member.rank == 0 and every != current:
        how = (f"blocks of steps with snapshots against those without, {int(n)} ranks' mean, "
               f"{measured.blocks if measured else 0} blocks here" if n
               else "its work's busy time: no rank timed blocks to compare")
        print(f"[deadpool] snapshot-every auto at step {step}: a snapshot costs {used.cost_s * 1e3:.0f} ms of step "
              f"time ({how}; the work itself takes {busy * 1e3:.0f} ms), a step {used.step_s * 1e3:.0f} ms; "
              f"snapshotting every {every} steps keeps it within {config.snapshot_budget:.1%}; a failure replays "
              f"up to {replay} steps ({replay * used.step_s:.1f} s)", flush=True)
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


def _all_reduce(member: Member, tensor: torch.Tensor, op: Any, phase: str, what: str) -> None:
    assert member.watch is not None
    with member.progress.waiting_for(phase):
        collective(lambda: dist.all_reduce(tensor, op=op, async_op=True), member.watch.aborted,
                   member.ctx.config.collective_timeout_s, what)
