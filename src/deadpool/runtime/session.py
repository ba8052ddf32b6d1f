"""The API a training script uses: init, wrap, register, run, and the loop that survives failures.

A worker's life is one loop over steps. A failed step (a peer died or hung, the coordinator aborted the
generation) unwinds to that loop, which runs the recovery state machine (recovery.py) and goes on; a
spare enters the same machine when it is given a rank. An exception of the script's own is not a
failure a spare can fix: it is reported to the coordinator, which stops the job.

    TRAINING --failure--> leave generation g --recover()--> restored, rejoined g+1 --> TRAINING
    TRAINING --script error--> report it, re-raise (traceback, exit 1; the job stops)
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import random
import statistics
import sys
import time
import zlib
from types import TracebackType
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from deadpool.errors import ConfigError, DeadPoolError, ProtocolError, SwapAborted, WorkerFailure
from deadpool.runtime.comms import (
    CollectiveAborted,
    DataParallel,
    abort_communicator,
    finish,
    guard_exit,
    is_communication_error,
    join_group,
    leave_group,
    pick_backend,
)
from deadpool.runtime.context import Context
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.recovery import Recovery, State
from deadpool.runtime.slots import Slot
from deadpool.runtime.snapshot import GenerationAborted, SnapshotEngine
from deadpool.runtime.state import Stateful, load_into, state_sha256, unflatten
from deadpool.runtime.watch import Progress, Watch

CALIBRATION_STEPS = 5  # `auto` snapshots every step until this step, then picks an interval
FAILURES = (GenerationAborted, CollectiveAborted, SwapAborted, TimeoutError)  # always a failure of some rank
FINISHED = "finished"  # the last phase a rank reports: the coordinator expects silence after it
ABORT_GRACE_S = 1.0  # an error of unknown origin counts as a failure if the generation is aborted this soon


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
    until it is given a rank (or exits with the job if it never is)."""
    ctx = Context.from_environment()
    ctx.store.set(ctx.keys.started(ctx.proc), "1")
    ctx.events.emit("process_start", argv=sys.argv)
    if ctx.role == "spare":
        from deadpool.spare import Standby

        inc, held = Standby(ctx).run()
        session = Session(ctx, inc, held=held)
        # Hand over, receive and report this rank's replicas now, while the script builds its model;
        # session.run() goes on from there with the same state machine as the survivors.
        session._recovery = Recovery(ctx, session, inc.generation - 1, failed_step=None, inc=inc)
        session._recovery.run(until=State.AWAIT_TARGET)
        return session
    ctx.wait_key(ctx.keys.plan(0), time.monotonic() + ctx.config.connect_timeout_s)
    session = Session(ctx, Incarnation.of(ctx.plan(0), ctx.proc, ctx.keys))
    session._enter()  # the script may use torch.distributed from here on
    return session


class Session:
    """One process's membership in the job; Stateful itself (its step counter is part of every snapshot).

    `inc` is the one place the generation lives; the watch, the process group, the model's attachment
    and the snapshot engine's run are built from it in `_enter` and torn down together in `leave`.
    """

    def __init__(self, ctx: Context, inc: Incarnation, held: dict[int, list[Slot]] | None = None) -> None:
        self.ctx = ctx
        self.inc = inc
        self.backend, self.device = pick_backend(ctx.config.backend, inc.my_rank())
        self.step = 0
        every = ctx.config.snapshot_every
        self.calibrating = every == "auto"
        self.every = 1 if self.calibrating else int(every)
        self.progress = Progress()
        self.engine = SnapshotEngine(ctx, self.device)
        self.watch: Watch | None = None
        self._held = held  # a spare's replicas, until it has taken its rank
        self._recovery: Recovery | None = None  # a spare's recovery into its rank, begun in init()
        self._tree: dict[str, Stateful] = {}
        self._model: DataParallel | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._frontier = 0
        ctx.faults.rank = ctx.events.rank = inc.rank
        ctx.events.generation = inc.generation
        _report_script_errors(self)

    @property
    def rank(self) -> int:
        return self.inc.my_rank()

    @property
    def world_size(self) -> int:
        return self.inc.world_size

    @property
    def generation(self) -> int:
        return self.inc.generation

    # ---- the public API ------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> DataParallel:
        """Use instead of DistributedDataParallel(model): the returned module survives group rebuilds."""
        model.to(self.device)
        self._model = DataParallel(model)
        self._model.register_forward_pre_hook(lambda *_: self._point("forward"))
        params = [p for p in model.parameters() if p.requires_grad]
        if params:  # a hook midway through the parameters fires in the middle of backward
            params[len(params) // 2].register_hook(lambda grad: self._point("backward"))
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
            opt.register_step_post_hook(lambda *_: self._point("after_optimizer"))

    def run(self, train_step: Callable[[int], Any], steps: int) -> None:
        """Calls train_step(step) for step = next..steps; returns when every step is done, recovering
        from failures on the way. train_step may return the loss (a tensor or a float)."""
        if not self._tree:
            raise ConfigError("call session.register(model=..., optimizer=..., ...) before session.run()")
        # Everything built so far (torch, the model, the data) lives as long as the run: freezing it keeps it
        # out of the gc.collect() in leave_group, which otherwise walks it all (0.2-0.4 s) while recovering.
        gc.freeze()
        cause = "activated as a spare" if self._recovery is not None else self._attempt(self._begin)
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

    # ---- one generation ------------------------------------------------------------------

    def _enter(self) -> None:
        """Builds this generation's watch and joins its process group."""
        self.watch = Watch(self.ctx, self.inc, self.progress, on_abort=abort_communicator)
        start = time.monotonic()
        join_group(self.ctx.store, self.inc.group_prefix(), self.backend, self.rank, self.world_size,
                   self.ctx.config.collective_timeout_s)
        self.ctx.events.emit("group_joined", duration_s=time.monotonic() - start, world_size=self.world_size)

    def _attach(self, sync: bool) -> None:
        assert self.watch is not None
        if self._model is not None:
            self._model.attach(sync, self.watch.aborted, self.progress.waiting_for)

    def leave(self) -> None:
        """Tears down everything of the current generation (safe to call twice)."""
        if self._model is not None:
            self._model.detach()
        self.engine.stop()
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        leave_group()

    # ---- steady state --------------------------------------------------------------------

    def _begin(self) -> None:
        """A fresh job: rank 0's initial weights win, and snapshot 0 is committed before step 1 runs, so
        that a failure at any moment after this is recoverable."""
        assert self.watch is not None
        self._attach(sync=True)
        self.engine.start(self.inc, self.watch)
        if self.every:
            self.engine.capture(0, self._tree)
            with self.progress.waiting_for("commit"):
                self.engine.wait_committed(0)

    def _point(self, phase: str) -> None:
        """A point of the step the coordinator sees progress at, and where a planned fault may fire."""
        self.progress.mark(self.step + 1, phase)
        self.ctx.faults.point(phase, self.step + 1)

    def _before_optimizer_step(self) -> None:
        """The state may change from here on, so the last snapshot's copy must be complete."""
        with self.progress.waiting_for("snapshot_copy"):
            self.engine.wait_copied()
        self.progress.mark(self.step + 1, "optimizer")

    def _one_step(self, train_step: Callable[[int], Any]) -> None:
        if self.watch is None or self.watch.aborted():
            raise GenerationAborted(f"generation {self.generation} was aborted by the coordinator")
        step = self.step + 1
        self._point("step_start")
        start, waited = time.monotonic(), self.engine.wait_s
        loss = train_step(step)
        self.step = step
        duration = time.monotonic() - start
        self.progress.record_step(duration)
        self.progress.mark(step, "step_end")
        value = None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        self.ctx.events.emit("step", step=step, loss=value, dur_s=duration, wait_s=self.engine.wait_s - waited,
                             replay=step <= self._frontier)
        if self.every and step % self.every == 0:
            self.engine.capture(step, self._tree)
        if self.calibrating and step >= CALIBRATION_STEPS:
            self._choose_interval()

    def _choose_interval(self) -> None:
        """`auto`: the densest interval whose snapshot cost stays within the budget; ranks take the max.

        Every rank decides at the same step (a collective), whatever it measured: a spare that just
        took over has measured little, and the others' costs decide.
        """
        assert self.watch is not None
        cost = statistics.median(self.engine.costs) if self.engine.costs else 0.0
        step_s = statistics.median(self.progress.step_times)
        mine = max(1, math.ceil(cost / (self.ctx.config.snapshot_budget * step_s)))
        chosen = torch.tensor([mine], dtype=torch.int64, device=self.device)
        with self.progress.waiting_for("all_reduce"):
            finish(dist.all_reduce(chosen, op=dist.ReduceOp.MAX, async_op=True), self.watch.aborted)
        self.every, self.calibrating = int(chosen.item()), False
        self.ctx.events.emit("snapshot_interval", every=self.every, cost_s=cost, step_s=step_s,
                             budget=self.ctx.config.snapshot_budget)
        if self.rank == 0:
            print(f"[deadpool] snapshot-every auto: a snapshot costs {cost * 1e3:.0f} ms, "
                  f"a step {step_s * 1e3:.0f} ms; snapshotting every {self.every} steps keeps it within "
                  f"{self.ctx.config.snapshot_budget:.1%}",
                  flush=True)

    def _finish(self) -> None:
        if self.every:
            with self.progress.waiting_for("commit"):
                self.engine.drain()
        # the training state: everything registered, the RNGs and the step, not DeadPool's own settings
        training = {name: obj for name, obj in self._tree.items() if name != "deadpool"}
        digests = {**state_sha256(training), "step": str(self.step)}
        whole = hashlib.sha256("".join(digests[k] for k in sorted(digests)).encode()).hexdigest()
        self.ctx.events.emit("finished", step=self.step, state_sha256=whole, entry_sha256=digests)
        if self.watch is not None:
            self.watch.close(last_words=FINISHED)
        self.leave()

    # ---- failures ------------------------------------------------------------------------

    def _attempt(self, action: Callable[[], None]) -> str | None:
        """Runs one unit of work; a failure of some rank comes back as text (so the exception, and the
        frames holding the old process group, are gone before recovery starts). Anything else is the
        script's own error and propagates."""
        try:
            action()
            return None
        except Exception as error:
            if not self._is_failure(error):
                raise
            return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def _is_failure(self, error: Exception) -> bool:
        """A failure of some rank (recover), or the script's own error (stop the job)?"""
        if isinstance(error, FAILURES) or is_communication_error(error):
            return True
        if isinstance(error, DeadPoolError):
            return False
        deadline = time.monotonic() + ABORT_GRACE_S  # a dying peer can surface as any error: give the abort a moment
        while self.watch is not None and time.monotonic() < deadline:
            if self.watch.aborted():
                return True
            time.sleep(self.ctx.config.poll_interval_s)
        return False

    def _recover(self, cause: str) -> None:
        """Leaves the failed generation and runs the recovery state machine into the next one."""
        started = time.monotonic()
        guard_exit()
        self._frontier = max(self._frontier, self.step)
        self.ctx.events.emit("failure_seen", cause=cause, step=self.step)
        self.leave()
        recovery = self._recovery or Recovery(self.ctx, self, self.inc.generation, self.step + 1)
        activated, self._recovery = self._recovery is not None, None
        try:
            done = recovery.run()
        except SwapAborted as error:
            raise WorkerFailure(f"{self.ctx.proc} cannot continue after '{cause}': {error}") from None
        assert done is not None
        self.inc, target = done
        if activated:
            self.ctx.events.emit("spare_activated", restored_step=target)
        print(f"[deadpool] rank {self.rank}: generation {self.generation}, rolled back to step {target} "
              f"(was at {self._frontier}) in {time.monotonic() - started:.2f} s", flush=True)

    # ---- the recovery state machine's view of this process (recovery.Member) ---------------

    def replicas(self) -> dict[int, list[Slot]]:
        return self._held or {}

    def take(self, slots: list[Slot]) -> None:
        self.engine.slots = slots

    def holdings(self) -> list[int]:
        intact = self.engine.intact_steps()
        for slot in self.engine.slots:
            if slot.step is not None and slot.step not in intact:
                self.ctx.events.emit("replica_rejected", of_rank=self.inc.rank, step=slot.step,
                                     error="checksum mismatch in host memory; never restored from")
        return intact

    def restore(self, step: int) -> None:
        """Loads snapshot `step` from this rank's slot into the live state."""
        skeleton, tensors, numpy_flags = self.engine.slot_for(step).tensors()
        load_into(self._tree, unflatten(skeleton, tensors, numpy_flags))
        self.engine.keep_only(step)
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        if self._model is not None:
            self._model.zero_grad(set_to_none=True)

    def rejoin(self, inc: Incarnation, step: int) -> None:
        """Enters generation `inc`: joins its group, checks every rank restored the same state, restarts snapshots."""
        self.inc = inc
        self.ctx.faults.rank = self.ctx.events.rank = inc.rank
        self.progress.mark(step, "rejoin")
        self._enter()
        assert self.watch is not None
        self._attach(sync=False)
        self._agree(step)
        self.ctx.store.set(inc.resumed_key(), str(step))
        self.engine.start(inc, self.watch)
        self._held = None

    def _agree(self, target: int) -> None:
        """All ranks must hold the same step and, data-parallel, bit-identical parameters."""
        assert self.watch is not None
        crc = 0
        if self._model is not None:
            for p in self._model.module.parameters():
                crc = zlib.crc32(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
        mine = torch.tensor([target, crc], dtype=torch.int64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        with self.progress.waiting_for("agree"):
            finish(dist.all_gather(everyone, mine, async_op=True), self.watch.aborted)
        if any(not torch.equal(other, mine) for other in everyone):
            raise ProtocolError(f"ranks disagree on the restored state: {[t.tolist() for t in everyone]}")


def _report_script_errors(session: Session) -> None:
    """Makes an uncaught exception of the script's own known to the coordinator before the traceback is
    printed, so that it stops the job instead of replaying the error on a spare."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if isinstance(error, Exception) and not isinstance(error, DeadPoolError) and not is_communication_error(error):
            first = str(error).splitlines()[0] if str(error) else ""
            report = {"rank": session.inc.rank, "step": session.progress.step, "gen": session.generation,
                      "error": f"{kind.__name__}: {first}"}
            try:
                session.ctx.store.set(session.ctx.keys.script_error(session.ctx.proc), json.dumps(report))
            except Exception:  # the coordinator is gone: the exit code still tells
                pass
        previous(kind, error, tb)

    sys.excepthook = hook
