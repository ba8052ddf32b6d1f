"""The API a training script uses: init, wrap, register, run, and the loop that survives failures.

A worker's life is one loop over steps. A failed step (a peer died, the coordinator aborted the
generation) unwinds to that loop, which recovers and goes on:

    TRAINING --error--> teardown --negotiate--> RESTORE --> REJOIN --> AGREE --> TRAINING
                                      ^                        |          |
                                      +---- another failure ---+----------+
"""

from __future__ import annotations

import gc
import hashlib
import math
import random
import statistics
import sys
import time
import zlib
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from deadpool.errors import ConfigError, ProtocolError, SwapAborted, WorkerFailure
from deadpool.runtime.comms import DataParallel, finish, guard_exit, join_group, leave_group, pick_backend
from deadpool.runtime.context import Context
from deadpool.runtime.recovery import Agreement, negotiate
from deadpool.runtime.slots import Slot
from deadpool.runtime.snapshot import GenerationAborted, SnapshotEngine
from deadpool.runtime.watch import AbortWatcher
from deadpool.runtime.state import Stateful, load_into, state_sha256, unflatten

CALIBRATION_STEPS = 5  # `auto` snapshots every step until this step, then picks an interval
RECOVERABLE = (RuntimeError, GenerationAborted, TimeoutError, SwapAborted)


class RNGState:
    """Every random number generator a step may draw from: Python, NumPy, torch (and CUDA)."""

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])


def init() -> "Session":
    """Joins the job. A worker returns at once; a spare blocks here, holding other ranks' snapshots,
    until it is activated as some rank (or exits with the job if it never is)."""
    ctx = Context.from_environment()
    ctx.events.emit("process_start", argv=sys.argv)
    if ctx.role == "spare":
        from deadpool.spare import Standby

        agreement, slots = Standby(ctx).run()
        return Session(ctx, agreement.plan, agreement.rank, slots=slots, target=agreement.target)  # joins in run()
    ctx.wait_key(ctx.keys.plan(0), time.monotonic() + ctx.config.connect_timeout_s)
    plan = ctx.plan(0)
    session = Session(ctx, plan, plan.rank_of(ctx.proc))
    session._join()
    return session


class Session:
    """One process's membership in the job; Stateful itself (its step counter is part of every snapshot)."""

    def __init__(self, ctx: Context, plan: Any, rank: int, slots: list[Slot] | None = None,
                 target: int | None = None) -> None:
        self.ctx = ctx
        self.backend, self.device = pick_backend(ctx.config.backend, rank)
        self.plan, self.generation, self.rank = plan, plan.generation, rank
        self.world_size = plan.world_size
        self.step = 0
        every = ctx.config.snapshot_every
        self.calibrating = every == "auto"
        self.every = 1 if self.calibrating else int(every)
        self.watcher = AbortWatcher(ctx, self.generation)
        self.engine = SnapshotEngine(ctx, self.device, self.watcher.aborted, slots)
        self._target = target
        self._tree: dict[str, Stateful] = {}
        self._model: DataParallel | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._step_times: list[float] = []
        self._frontier = 0
        ctx.faults.rank = ctx.events.rank = rank
        ctx.events.generation = self.generation

    # ---- the public API ------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> DataParallel:
        """Use instead of DistributedDataParallel(model): the returned module survives group rebuilds."""
        model.to(self.device)
        self._model = DataParallel(model)
        self._model.interrupted = self.watcher.aborted
        kill = self.ctx.faults.kill_point
        self._model.register_forward_pre_hook(lambda *_: kill("forward", self.step + 1))
        params = [p for p in model.parameters() if p.requires_grad]
        if params:  # a hook midway through the parameters fires in the middle of backward
            params[len(params) // 2].register_hook(lambda grad: kill("backward", self.step + 1))
        return self._model

    def register(self, **objects: Stateful) -> None:
        """Declares the state a snapshot holds: model, optimizer, scheduler, data position, anything
        Stateful. RNG states and the step counter are added by DeadPool."""
        for name, obj in objects.items():
            if name in ("rng", "deadpool"):
                raise ConfigError(f"state name {name!r} is reserved by DeadPool; pick another")
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"{name!r} is not Stateful: it needs state_dict() and load_state_dict()")
        self._tree = {**objects, "rng": RNGState(), "deadpool": self}
        self._optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        for opt in self._optimizers:
            opt.register_step_pre_hook(lambda *_: self._before_optimizer_step())
            opt.register_step_post_hook(lambda *_: self.ctx.faults.kill_point("after_optimizer", self.step + 1))
        if self._target is not None:
            self._restore(self._target)

    def run(self, train_step: Callable[[int], Any], steps: int) -> None:
        """Calls train_step(step) for step = next..steps; returns when every step is done, recovering
        from failures on the way. train_step may return the loss (a tensor or a float)."""
        if not self._tree:
            raise ConfigError("call session.register(model=..., optimizer=..., ...) before session.run()")
        # Everything built so far (torch, the model, the data) lives as long as the run: freezing it keeps it
        # out of the gc.collect() in leave_group, which otherwise walks it all (0.2-0.4 s) while recovering.
        gc.freeze()
        cause = self._attempt(self._begin)
        while cause or self.step < steps:
            if cause:
                self._recover(cause)
            cause = self._attempt(lambda: self._one_step(train_step))
        self._finish()

    def log(self, event: str, **fields: Any) -> None:
        """Appends an event of the script's own to the run's events.jsonl (JSON-serialisable fields)."""
        self.ctx.events.emit(event, **fields)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "every": self.every, "calibrating": self.calibrating}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.every, self.calibrating = state["step"], state["every"], state["calibrating"]

    # ---- steady state --------------------------------------------------------------------

    def _join(self) -> None:
        start = time.monotonic()
        join_group(self.ctx.store, self.ctx.keys.group_prefix(self.generation), self.backend, self.rank,
                   self.world_size, self.ctx.config.collective_timeout_s)
        self.ctx.events.emit("group_joined", duration_s=time.monotonic() - start, world_size=self.world_size)

    def _begin(self) -> None:
        if self._target is None:  # a fresh job: rank 0's initial weights win, snapshot 0 is the first state
            if self._model is not None:
                self._model.attach(sync=True)
            self.engine.start(self.generation, self.plan, self.rank, committed=None)
            if self.every:
                self.engine.capture(0, self._tree)
        else:                      # a spare taking over: its state was restored in register()
            target = self._target
            self._resume(target)
            self.ctx.events.emit("spare_activated", restored_step=target)

    def _before_optimizer_step(self) -> None:
        """The state may change from here on, so the last snapshot's copy must be complete."""
        self.engine.wait_copied()

    def _one_step(self, train_step: Callable[[int], Any]) -> None:
        if self.watcher.aborted():
            raise GenerationAborted(f"generation {self.generation} was aborted by the coordinator")
        step = self.step + 1
        self.ctx.faults.kill_point("step_start", step)
        start, waited = time.monotonic(), self.engine.wait_s
        loss = train_step(step)
        self.step = step
        duration = time.monotonic() - start
        self._step_times.append(duration)
        self.ctx.events.emit("step", step=step, loss=None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss), dur_s=duration,
                             wait_s=self.engine.wait_s - waited, replay=step <= self._frontier)
        if self.every and step % self.every == 0:
            self.engine.capture(step, self._tree)
        if self.calibrating and step >= CALIBRATION_STEPS:
            self._choose_interval()

    def _choose_interval(self) -> None:
        """`auto`: the densest interval whose snapshot cost stays within the budget; ranks take the max.

        Every rank decides at the same step (a collective), whatever it measured: a spare that just
        took over has measured little, and the others' costs decide.
        """
        cost = statistics.median(self.engine.costs) if self.engine.costs else 0.0
        step_s = statistics.median(self._step_times)
        mine = max(1, math.ceil(cost / (self.ctx.config.snapshot_budget * step_s)))
        chosen = torch.tensor([mine], dtype=torch.int64, device=self.device)
        finish(dist.all_reduce(chosen, op=dist.ReduceOp.MAX, async_op=True), self.watcher.aborted)
        self.every, self.calibrating = int(chosen.item()), False
        self.ctx.events.emit("snapshot_interval", every=self.every, cost_s=cost, step_s=step_s,
                             budget=self.ctx.config.snapshot_budget)
        if self.rank == 0:
            print(f"[deadpool] snapshot-every auto: a snapshot costs {cost * 1e3:.0f} ms, a step {step_s * 1e3:.0f} ms; "
                  f"snapshotting every {self.every} steps keeps it within {self.ctx.config.snapshot_budget:.1%}",
                  flush=True)

    def _finish(self) -> None:
        self.engine.wait_copied()
        self.engine.stop()
        # the training state: everything registered, the RNGs and the step, not DeadPool's own settings
        training = {name: obj for name, obj in self._tree.items() if name != "deadpool"}
        digests = {**state_sha256(training), "step": str(self.step)}
        whole = hashlib.sha256("".join(digests[k] for k in sorted(digests)).encode()).hexdigest()
        self.ctx.events.emit("finished", step=self.step, state_sha256=whole, entry_sha256=digests)
        self.watcher.close()
        leave_group()

    # ---- recovery ------------------------------------------------------------------------

    @staticmethod
    def _attempt(action: Callable[[], None]) -> str | None:
        """Runs one unit of work; a failure comes back as text, so the exception (and the frames
        holding the old process group) is gone before recovery starts."""
        try:
            action()
            return None
        except RECOVERABLE as error:
            return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def _teardown(self) -> None:
        if self._model is not None:
            self._model.detach()
        leave_group()
        self.engine.stop()

    def _recover(self, cause: str) -> None:
        """Unwinds a failed step, rolls back to the agreed committed step, and rejoins the new group."""
        started = time.monotonic()
        guard_exit()
        self._frontier = max(self._frontier, self.step)
        self.ctx.events.emit("failure_seen", cause=cause, step=self.step)
        while True:
            self._teardown()
            self.ctx.faults.kill_point("recovery", self.step + 1)
            try:
                agreement = negotiate(self.ctx, self.generation, self.engine.intact_steps,
                                      self.ctx.config.decision_timeout_s)
            except SwapAborted as error:
                raise WorkerFailure(f"rank {self.rank} cannot continue after '{cause}': {error}") from None
            agreed = time.monotonic()
            self._adopt(agreement)
            self._restore(agreement.target)
            restored = time.monotonic()
            failed_again = self._attempt(lambda: self._resume(agreement.target))
            if failed_again is None:
                break
            cause = failed_again  # another failure while rejoining: negotiate the next generation
        done = time.monotonic()
        self.ctx.events.emit("recovered", restored_step=agreement.target, frontier=self._frontier,
                             negotiate_s=agreed - started, restore_s=restored - agreed, rebuild_s=done - restored,
                             total_s=done - started)
        print(f"[deadpool] rank {self.rank}: generation {self.generation}, rolled back to step {agreement.target} "
              f"(was at {self._frontier}) in {done - started:.2f} s", flush=True)

    def _adopt(self, agreement: Agreement) -> None:
        self.plan, self.generation, self.rank = agreement.plan, agreement.plan.generation, agreement.rank
        self.ctx.events.generation = self.generation
        self.watcher.watch(self.generation)

    def _restore(self, step: int) -> None:
        """Loads snapshot `step` from the local slot (or, on a spare, the replica slot) into the live state."""
        skeleton, tensors, numpy_flags = self.engine.slot_for(step).tensors()
        load_into(self._tree, unflatten(skeleton, tensors, numpy_flags))
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        if self._model is not None:
            self._model.zero_grad(set_to_none=True)

    def _resume(self, target: int) -> None:
        """Joins this generation's group, checks every rank restored the same step, and restarts snapshots."""
        self._join()
        if self._model is not None:
            self._model.attach(sync=False)
        self._agree(target)
        self.ctx.store.set(self.ctx.keys.resumed(self.generation, self.rank), str(target))
        self.engine.start(self.generation, self.plan, self.rank, committed=target)
        self._target = None

    def _agree(self, target: int) -> None:
        """All ranks must hold the same step and, data-parallel, bit-identical parameters."""
        crc = 0
        if self._model is not None:
            for p in self._model.module.parameters():
                crc = zlib.crc32(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
        mine = torch.tensor([target, crc], dtype=torch.int64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        finish(dist.all_gather(everyone, mine, async_op=True), self.watcher.aborted)
        if any(not torch.equal(other, mine) for other in everyone):
            raise ProtocolError(f"ranks disagree on the restored state: {[t.tolist() for t in everyone]}")
