"""This process's membership in one generation after another, and its part in recovery (recovery.Member).

Everything that lives for one generation (the watch, the default process group, the model's attachment
to it, the snapshot engine's run, the receivers of held replicas) is built from the incarnation in
`enter` and `resume` and torn down together in `leave`; the state they serve (the snapshot's tree, the
model, the optimizers, the slots) outlives them.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from deadpool.errors import PeerFailure
from deadpool.protocol.keys import ENV_DEVICE
from deadpool.protocol.records import Device, Resumed
from deadpool.runtime.agree import agree_on_restore
from deadpool.runtime.comms import (
    LEAVE_DEADLINE_S,
    DataParallel,
    abandon_group,
    communicating,
    join_group,
    leave_group,
    pick_backend,
)
from deadpool.runtime.context import Context
from deadpool.runtime.generation import Incarnation, assume
from deadpool.runtime.holding import Holdings
from deadpool.runtime.persist import Persister, checkpoint_of, load_from_disk, on_disk
from deadpool.runtime.pieces import gather
from deadpool.runtime.plane import Interruptible
from deadpool.runtime.sharded import ShardedModel
from deadpool.runtime.slots import Slot
from deadpool.runtime.snapshot import SnapshotEngine
from deadpool.runtime.state import Stateful, flatten, load_into, one_mesh, unflatten
from deadpool.runtime.watch import Progress, Watch


class Member:
    """One process's rank in the current generation (`inc`, the one place the generation lives)."""

    def __init__(self, ctx: Context, inc: Incarnation, held: Holdings | None = None,
                 persister: Persister | None = None) -> None:
        self.ctx = ctx
        self.inc = inc
        self.backend, self.device = pick_backend(ctx.config.backend, _device_index(ctx, inc))
        self.gpu = self.device.index if self.device.type == "cuda" else None
        assume(ctx, inc, gpu=self.gpu)
        if self.device.type == "cuda":
            ctx.plane.put(ctx.keys.device(ctx.proc), Device(ctx.proc, self.device.index))
            if ctx.config.deterministic:
                _use_deterministic_kernels()
        self.step = 0  # the last step completed: the step loop advances it, a restore rolls it back
        self.frontier = 0  # the furthest step any rank had completed before the last failure: up to it, replays
        self.progress = Progress()
        self.engine = SnapshotEngine(ctx, self.device)
        self.watch: Watch | None = None
        self.rendezvous: Interruptible | None = None  # the store view the default group was built over
        self.held = held or Holdings(ctx)  # other ranks' replicas: a spare's, or a peer's when spares run short
        self.model: DataParallel | ShardedModel | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.tree: dict[str, Stateful] = {}  # everything a snapshot holds, named (built by Session.run)
        self.persister = persister or Persister(ctx, self.slots_of)  # a spare's came with it from its standby
        self.persister.sources = self.slots_of

    @property
    def rank(self) -> int:
        return self.inc.my_rank()

    @property
    def world_size(self) -> int:
        return self.inc.world_size

    # ---- one generation ------------------------------------------------------------------

    def enter(self) -> None:
        """Builds this generation's watch and joins its process group (PeerFailure if a peer fails meanwhile, or
        the generation is aborted before its group formed: a peer that died before joining never will)."""
        self.watch = Watch(self.ctx, self.inc, self.progress, on_abort=lambda: abandon_group(self.device))
        start = time.monotonic()
        # referenced as long as the group lives: torch keeps only the C++ half of a store written in Python
        self.rendezvous = Interruptible(self.ctx.store, self.watch.aborted)
        what = f"joining generation {self.inc.generation}'s process group"
        with communicating(what):
            try:
                join_group(self.rendezvous, self.inc.group_prefix(), self.backend, self.rank, self.world_size,
                           self.ctx.config.collective_timeout_s)
            except InterruptedError:  # the rendezvous gave up (the abort): torch lets the store's own error through
                raise PeerFailure(f"{what} was given up: generation {self.inc.generation} was aborted") from None
        self.ctx.events.emit("group_joined", duration_s=time.monotonic() - start, world_size=self.world_size,
                             device=str(self.device))

    def attach(self, sync: bool) -> None:
        """Binds the model to this generation's group (`sync`: rank 0's weights win, at job start only)."""
        assert self.watch is not None
        if self.model is not None:
            self.model.attach(sync, self.watch.aborted, self.progress.waiting_for,
                              self.ctx.config.collective_timeout_s)

    def hold(self) -> None:
        """Starts receiving the peers' snapshots this process holds in this generation (spares ran short)."""
        held = self.held.start(self.inc)
        if held:
            self.ctx.events.emit("holding", ranks=held)

    def leave(self) -> None:
        """Tears down everything of the current generation (safe to call twice)."""
        if self.model is not None:
            self.model.detach()
        self.engine.stop()
        self.held.stop()
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if not leave_group():
            self.ctx.events.emit("group_left_behind", deadline_s=LEAVE_DEADLINE_S)

    def persist(self, step: int | None) -> None:
        """Writes this rank's part of checkpoint `step` from its own slot, unless it is on disk already (at the
        end of training: the coordinator completes the checkpoint once every rank finished)."""
        config = self.ctx.config
        if not config.persist_dir or step is None or on_disk(config, step):
            return
        with self.progress.waiting_for("persist"):
            report = self.persister.write(step, [self.rank])
        if not report.ok:
            print(f"[deadpool] rank {self.rank}: could not write step {step} to disk: {report.error}",
                  file=sys.stderr, flush=True)

    def persist_newest(self) -> None:
        """On SIGTERM, perhaps with no coordinator left to ask: writes every snapshot in this rank's slots from
        the newest commit it saw on. Another rank may have seen a newer commit, which this rank holds too (a step
        is committed only once every rank holds it): `--resume` finishes the newest step every rank wrote."""
        seen = self.engine.committed
        held = sorted(s.step for s in self.engine.slots if s.step is not None and s.trusted)
        steps = [step for step in held if seen is not None and step >= seen]
        self.ctx.events.emit("persist_on_stop", committed_seen=seen, held=held, writes=steps)
        for step in steps:
            self.persist(step)

    def slots_of(self, rank: int) -> list[Slot]:
        """The slots holding rank's snapshots in this process: its own, or a replica it holds."""
        return self.engine.slots if rank == self.inc.rank else self.held.slots.get(rank, [])

    # ---- the recovery state machine's view of this process (recovery.Member) ---------------

    def replicas(self) -> dict[int, list[Slot]]:
        return self.held.slots

    def take(self, slots: list[Slot]) -> None:
        self.engine.slots = slots

    def holdings(self) -> list[int]:
        intact = self.engine.usable_steps()
        for slot in self.engine.slots:
            if slot.step is not None and slot.step not in intact:
                self.ctx.events.emit("replica_rejected", of_rank=self.inc.rank, step=slot.step,
                                     error="checksum mismatch in host memory; never restored from")
        return intact

    def join(self, inc: Incarnation) -> None:
        """Becomes generation `inc`'s rank (recovery.py assumed its identity already): its watch and group."""
        self.inc = inc
        self.progress.mark(self.step, "rejoin")
        self.enter()

    def restore(self, step: int) -> None:
        """Loads snapshot `step` into the live state (the step loop's counters too): from this rank's slot or,
        when no copy of it is in memory (its holders were lost with it), from the checkpoint on disk. A slot
        that holds one piece of the replicated state is made whole first, from the other ranks' pieces or,
        where they still equal them, from its own live tensors (pieces.gather: PeerFailure if a peer fails
        meanwhile)."""
        slot = next((s for s in self.engine.slots if s.step == step and s.usable()), None)
        if slot is None:
            slot = self.engine.slots[0]
            path = checkpoint_of(self.ctx.config, step)
            load_from_disk(path, self.rank, slot, self.world_size)
            self.ctx.events.emit("restored_from_disk", step=step, path=str(path))
        if self.engine.sliced(self.world_size):
            assert self.watch is not None
            with self.progress.waiting_for("gather"):
                took = gather(slot, self.rank, self.world_size, self.device, self.watch.aborted,
                              self.ctx.config.collective_timeout_s, live=flatten(self.tree))
            self.ctx.events.emit("pieces_gathered", step=step, pieces=self.world_size, **took)
        skeleton, tensors, numpy_flags = slot.tensors(self.device)
        load_into(self.tree, unflatten(skeleton, tensors, numpy_flags, one_mesh(self.tree)))
        self.engine.keep_only(step)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def resume(self, step: int | None) -> None:
        """Checks that every rank restored the same state, then restarts snapshots, first sending the
        restored one to holders placed anew. None (nothing was committed): the slots and replicas of the
        failed start are dropped, and the step loop begins afresh (loop._begin), as at the job's start."""
        assert self.watch is not None
        if step is None:
            self.held.keep_only([])
            self.engine.keep_only(None)
            self.ctx.store.set(self.inc.resumed_key(), "afresh")
            return
        self.attach(sync=False)
        agree_on_restore(self, step)
        self.held.keep_only(self.inc.plan.held_by(self.ctx.proc))
        self.hold()  # before sending: two peers may each hold the other's replica
        self.engine.start(self.inc, self.watch)
        fresh = self.inc.plan.fresh_for(self.rank)
        if fresh:
            with self.progress.waiting_for("resend"):
                self.engine.resend(step, fresh)
        self.ctx.plane.put(self.inc.resumed_key(), Resumed(self.inc.generation, self.rank, step))


def _device_index(ctx: Context, inc: Incarnation) -> int | None:
    """This process's GPU: its own (the launcher's placement, coordinator/policy.place_devices) or, for a
    spare that has none, the GPU of the process that held its rank before: that process is dead (it was
    replaced), so its device is free. None: train on the CPU."""
    own = os.environ.get(ENV_DEVICE, "")
    if own:
        return int(own)
    for gen in range(inc.generation - 1, -1, -1):  # the latest earlier owner that had a device
        previous = ctx.plan(gen).ranks[inc.my_rank()]
        device = ctx.plane.poll(ctx.keys.device(previous), Device)
        if device is not None:
            return device.gpu
    return None


def _use_deterministic_kernels() -> None:
    """What a replayed step needs to compute the same bits on a GPU: torch's deterministic kernels (an op
    that has none raises, naming itself), cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, set by the
    launcher before CUDA starts) and cuDNN without autotuning. Uninitialised memory is not filled: that
    costs a write per allocation and only matters to kernels that read memory they never wrote."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

