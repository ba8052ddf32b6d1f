"""The API a training script uses: init, wrap, register, run, and the loop that survives failures.

A worker's life is one loop over steps. A failed step (a peer died or hung, the coordinator aborted the
generation) unwinds to that loop, which runs the recovery state machine (recovery.py) and goes on; a
spare enters the same machine when it is given a rank. An exception of the script's own is not a
failure a spare can fix: it is reported to the coordinator, which stops the job.

    TRAINING --failure--> leave generation g --recover()--> restored, rejoined g+1 --> TRAINING
    TRAINING --script error--> report it, re-raise (traceback, exit 1; the job stops)
"""

from __future__ import annotations

import dis
import gc
import hashlib
import json
import math
import os
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

from deadpool.coordinator.protocol import ENV_DEVICE, torchrun_env
from deadpool.errors import ConfigError, DeadPoolError, ProtocolError, SwapAborted, WorkerFailure
from deadpool.events import EventLog
from deadpool.runtime.comms import (
    CollectiveAborted,
    DataParallel,
    abandon_group,
    finish,
    guard_exit,
    is_communication_error,
    join_group,
    leave_group,
    pick_backend,
)
from deadpool.runtime.context import Context
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.holding import Holdings
from deadpool.runtime.recovery import Recovery, State
from deadpool.runtime.sharded import ShardedModel, is_sharded
from deadpool.runtime.slots import Slot
from deadpool.runtime.snapshot import GenerationAborted, SnapshotEngine
from deadpool.runtime.state import Stateful, load_into, one_mesh, state_sha256, unflatten
from deadpool.runtime.watch import Progress, Watch

CALIBRATION_STEPS = 5  # `auto` snapshots every step until this step, then picks an interval
FAILURES = (GenerationAborted, CollectiveAborted, SwapAborted, TimeoutError)  # always a failure of some rank
FINISHED = "finished"  # the last phase a rank reports: the coordinator expects silence after it
ABORT_GRACE_S = 1.0  # an error of unknown origin counts as a failure if the generation is aborted this soon


class RNGState:
    """Every random number generator a step may draw from: Python, NumPy, torch and this rank's GPU.

    The GPU's generator is saved and restored by *this process's* device, not by index: a spare that
    takes over a rank may run on another GPU than the one the snapshot was taken on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


class StepVariables:
    """The variables a step function rebinds that outlive the call (the names it declares `nonlocal` or
    `global` and assigns): the script's own state, such as an iteration counter, the best metric or a
    prefetched batch. They are snapshotted and restored with the registered objects, so that a port
    needs no restructuring to be correct."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        stored = [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname in ("STORE_DEREF", "STORE_GLOBAL")]
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        self.cells = {name: cells[name] for op, name in sorted(set(stored)) if op == "STORE_DEREF" and name in cells}
        self.globals = sorted({name for op, name in stored if op == "STORE_GLOBAL"})
        self.namespace = fn.__globals__

    def names(self) -> list[str]:
        return [*self.cells, *self.globals]

    def state_dict(self) -> dict[str, Any]:
        state = {}
        for name, cell in self.cells.items():
            try:
                state[name] = cell.cell_contents
            except ValueError:  # not assigned yet
                pass
        state.update({name: self.namespace[name] for name in self.globals if name in self.namespace})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            current = self.cells[name].cell_contents if name in self.cells else self.namespace.get(name)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                value = value.to(current.device)  # restored from host memory onto the device it lived on
            if name in self.cells:
                self.cells[name].cell_contents = value
            else:
                self.namespace[name] = value


def init(warmup: Callable[[], Any] | None = None) -> "Session":
    """Joins the job. A worker returns at once; a spare blocks here, holding other ranks' snapshots,
    until it is given a rank (or exits with the job if it never is).

    `warmup`: what a spare runs once while it waits, so that a swap does not pay for it: typically a
    throwaway model like the real one, compiled, through one forward and backward at the training
    shapes (torch.compile's code is kept per model class and reused by the model built after the
    spare is called). Workers do not run it."""
    ctx = Context.from_environment()
    ctx.store.set(ctx.keys.started(ctx.proc), "1")
    ctx.events.emit("process_start", argv=sys.argv)
    if ctx.role == "spare":
        from deadpool.spare import Standby

        inc, held = Standby(ctx, warmup).run()
        session = Session(ctx, inc, held=held)
        # Hand over, receive and report this rank's replicas and join the group now; the script then builds
        # its model, and session.run() restores into it with the same state machine as the survivors.
        session._recovery = Recovery(ctx, session, inc.generation - 1, failed_step=None, inc=inc)
        session._recovery.run(until=State.RESTORE)
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

    def __init__(self, ctx: Context, inc: Incarnation, held: Holdings | None = None) -> None:
        self.ctx = ctx
        self.inc = inc
        self.backend, self.device = pick_backend(ctx.config.backend, _device_index(ctx, inc))
        if self.device.type == "cuda":
            ctx.store.set(ctx.keys.device(ctx.proc), str(self.device.index))
            if ctx.config.deterministic:
                _use_deterministic_kernels()
        self.step = 0
        every = ctx.config.snapshot_every
        self.calibrating = every == "auto"
        self.every = 1 if self.calibrating else int(every)
        self.progress = Progress()
        self.engine = SnapshotEngine(ctx, self.device)
        self.watch: Watch | None = None
        self.held = held or Holdings(ctx)  # other ranks' replicas: a spare's, or a peer's when spares run short
        self._recovery: Recovery | None = None  # a spare's recovery into its rank, begun in init()
        self._registered: dict[str, Stateful] = {}
        self._tree: dict[str, Stateful] = {}  # everything a snapshot holds, named (built by run)
        self._model: DataParallel | ShardedModel | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._frontier = 0
        self._variables: StepVariables | None = None
        self._stop_requested = False  # session.stop() was called in this step
        self._stopped = False         # every rank agreed to end the run after this step
        self._check_next = False      # after a recovery, the next step is snapshotted (and its replicas compared)
        ctx.faults.rank = ctx.events.rank = inc.rank
        ctx.events.generation = inc.generation
        os.environ.update(torchrun_env(self.rank, self.world_size, ctx.config.nproc_per_node))
        # Unseeded Python and NumPy generators would make every run differ; a script that seeds them after
        # init() keeps its own seeds. torch's default generator has a fixed seed already.
        random.seed(ctx.config.seed + self.rank)
        np.random.seed((ctx.config.seed + self.rank) % 2**32)
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

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Use instead of DistributedDataParallel(model): the returned module survives group rebuilds.

        A model sharded with FSDP2 (`fully_shard(model)` last, on the root) is returned as it is: FSDP
        keeps communicating itself, and DeadPool rebinds it to each new generation's group."""
        if is_sharded(model):
            self._model = ShardedModel(model)  # each rank holds its own shards: nothing to compare across ranks
            model.register_forward_pre_hook(lambda *_: self._point("forward"))
            self._model.middle().register_forward_hook(self._mark_backward)
            return model
        model.to(self.device)
        self._model = DataParallel(model)
        self.engine.replicated = True  # every rank's parameters and optimizer state must stay identical
        self._model.register_forward_pre_hook(lambda *_: self._point("forward"))
        params = [p for p in model.parameters() if p.requires_grad]
        if params:  # a hook midway through the parameters fires in the middle of backward
            params[len(params) // 2].register_hook(lambda grad: self._point("backward"))
        return self._model

    def register(self, **objects: Stateful) -> None:
        """Declares the state a snapshot holds: optimizer, scheduler, data position, anything Stateful (may be
        called more than once). The model given to wrap(), RNG states, the step counter and the variables the
        step function rebinds are added by DeadPool."""
        for name, obj in objects.items():
            if name in ("rng", "deadpool", "variables") or name in self._registered:
                raise ConfigError(f"state name {name!r} is reserved by DeadPool or already registered; pick another")
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"{name!r} is not Stateful: it needs state_dict() and load_state_dict()")
            self._registered[name] = obj
            if isinstance(obj, torch.optim.Optimizer):
                self._optimizers.append(obj)
                obj.register_step_pre_hook(lambda *_: self._before_optimizer_step())
                obj.register_step_post_hook(lambda *_: self._point("after_optimizer"))

    def run(self, train_step: Callable[[int], Any], steps: int | None = None) -> None:
        """Calls train_step(step) for step = next..steps (or until session.stop()); returns when every step
        is done, recovering from failures on the way. train_step may return the loss (a tensor or a float).

        The variables train_step rebinds with `nonlocal` or `global` (a counter, a prefetched batch) are
        part of every snapshot, like the registered objects."""
        objects = dict(self._registered)
        model = self._model.module if isinstance(self._model, ShardedModel) else self._model
        if model is not None and not any(obj is model or obj is getattr(model, "module", None)
                                         for obj in objects.values()):
            objects = {"model" if "model" not in objects else "wrapped_model": model, **objects}
        if model is not None and not self._optimizers:
            raise ConfigError("register the optimizer before session.run(): session.register(optimizer=optimizer) "
                              "(DeadPool snapshots while the next step runs, and must know when the weights change)")
        self._variables = StepVariables(train_step)
        self._tree = {**objects, "rng": RNGState(self.device), "deadpool": self, "variables": self._variables}
        _count_compilation_as_waiting(self.progress, self.ctx.events)
        try:
            state_sha256({"variables": self._variables})  # values DeadPool cannot snapshot fail here, not mid-run
        except ConfigError as error:
            raise ConfigError(f"{error}. {train_step.__name__} rebinds it with nonlocal/global, so DeadPool "
                              "snapshots it: keep plain values there, or register the object instead") from None
        # Everything built so far (torch, the model, the data) lives as long as the run: freezing it keeps it
        # out of the gc.collect() in leave_group, which otherwise walks it all (0.2-0.4 s) while recovering.
        gc.freeze()
        cause = "activated as a spare" if self._recovery is not None else self._attempt(self._begin)
        while cause or not (self._stopped or (steps is not None and self.step >= steps)):
            if cause:
                self._recover(cause)
            cause = self._attempt(lambda: self._one_step(train_step))
        self._finish()

    def stop(self) -> None:
        """Ends the run after the current step, on every rank at that same step (early stopping, an
        evaluate-only run). Any rank may call it; the ranks agree at the end of the step."""
        self._stop_requested = True

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
        self.watch = Watch(self.ctx, self.inc, self.progress, on_abort=lambda: abandon_group(self.device))
        start = time.monotonic()
        join_group(self.ctx.store, self.inc.group_prefix(), self.backend, self.rank, self.world_size,
                   self.ctx.config.collective_timeout_s)
        self.ctx.events.emit("group_joined", duration_s=time.monotonic() - start, world_size=self.world_size,
                             device=str(self.device))

    def _attach(self, sync: bool) -> None:
        assert self.watch is not None
        if self._model is not None:
            self._model.attach(sync, self.watch.aborted, self.progress.waiting_for,
                               self.ctx.config.collective_timeout_s)

    def leave(self) -> None:
        """Tears down everything of the current generation (safe to call twice)."""
        if self._model is not None:
            self._model.detach()
        self.engine.stop()
        self.held.stop()
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
        self._hold()
        if self.every:
            self.engine.capture(0, self._tree)
            with self.progress.waiting_for("commit"):
                self.engine.wait_committed(0)

    def _hold(self) -> None:
        """Starts receiving the peers' snapshots this process holds in this generation (spares ran short)."""
        held = self.held.start(self.inc)
        if held:
            self.ctx.events.emit("holding", ranks=held)

    def _point(self, phase: str) -> None:
        """A point of the step the coordinator sees progress at, and where a planned fault may fire."""
        self.progress.mark(self.step + 1, phase)
        self.ctx.faults.point(phase, self.step + 1)

    def _mark_backward(self, _module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        """A forward hook: the gradient of this output is computed in the middle of backward."""
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._point("backward"))

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
        self._stop_requested = False
        start, waited = time.monotonic(), self.engine.wait_s
        loss = train_step(step)
        self.step = step
        duration = time.monotonic() - start
        self.progress.record_step(duration)
        self.progress.mark(step, "step_end")
        value = None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        self.ctx.events.emit("step", step=step, loss=value, dur_s=duration, wait_s=self.engine.wait_s - waited,
                             replay=step <= self._frontier)
        if self.every and (step % self.every == 0 or self._check_next):
            self.engine.capture(step, self._tree)
            self._check_next = False
        if self.calibrating and step >= CALIBRATION_STEPS:
            self._choose_interval()
        self._stopped = self._agree_to_stop()

    def _agree_to_stop(self) -> bool:
        """True on every rank if any rank called stop() in this step (one small all-reduce per step)."""
        assert self.watch is not None
        flag = torch.tensor([int(self._stop_requested)], dtype=torch.int64, device=self.device)
        with self.progress.waiting_for("stop"):
            finish(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), self.watch.aborted,
                   self.ctx.config.collective_timeout_s)
        stopped = bool(flag.item())
        if stopped and self.rank == 0:
            self.ctx.events.emit("stopped", step=self.step, reason="session.stop()")
        return stopped

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
            finish(dist.all_reduce(chosen, op=dist.ReduceOp.MAX, async_op=True), self.watch.aborted,
                   self.ctx.config.collective_timeout_s)
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
        # The training state: everything registered, the RNGs and the step, not DeadPool's own settings. The
        # step function's variables have their own digest but stay out of the whole: they may hold timings.
        training = {name: obj for name, obj in self._tree.items() if name != "deadpool"}
        digests = {**state_sha256(training), "step": str(self.step)}
        whole = hashlib.sha256("".join(digests[k] for k in sorted(digests) if k != "variables").encode()).hexdigest()
        self.ctx.events.emit("finished", step=self.step, state_sha256=whole, entry_sha256=digests)
        if self.watch is not None:
            self.watch.close(last_words=FINISHED)
            self.watch = None
        # The process group stays: the script may still use it (a final barrier, an evaluation) and destroy
        # it with dist.destroy_process_group(), as after DDP. Failures from here on are not recovered.
        self.engine.stop()
        self.held.stop()  # the last snapshot is committed: every holder has acknowledged every rank's copy

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
        activated = self._recovery is not None  # a spare whose recovery began in init(): it is in the group already
        if not activated:
            self._frontier = max(self._frontier, self.step)
            self.ctx.events.emit("failure_seen", cause=cause, step=self.step)
            self.leave()
        recovery = self._recovery or Recovery(self.ctx, self, self.inc.generation, self.step + 1)
        self._recovery = None
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

    def restore(self, step: int) -> None:
        """Loads snapshot `step` from this rank's slot into the live state."""
        skeleton, tensors, numpy_flags = self.engine.slot_for(step).tensors(self.device)
        load_into(self._tree, unflatten(skeleton, tensors, numpy_flags, one_mesh(self._tree)))
        self.engine.keep_only(step)
        self._stop_requested = self._stopped = False
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        if self._model is not None:
            self._model.zero_grad(set_to_none=True)

    def join(self, inc: Incarnation) -> None:
        """Becomes generation `inc`'s rank: its identity, its watch and its process group."""
        self.inc = inc
        self.ctx.faults.rank = self.ctx.events.rank = inc.rank
        os.environ.update(torchrun_env(self.rank, self.world_size, self.ctx.config.nproc_per_node))
        self.progress.mark(self.step, "rejoin")
        self._enter()

    def resume(self, step: int) -> None:
        """Checks that every rank restored the same state, then restarts snapshots, first sending the
        restored one to holders placed anew; the next step is snapshotted whatever the interval, so the
        replicas are compared right after a recovery."""
        assert self.watch is not None
        self._attach(sync=False)
        self._agree(step)
        self.held.keep_only(self.inc.plan.held_by(self.ctx.proc))
        self._hold()  # before sending: two peers may each hold the other's replica
        self.engine.start(self.inc, self.watch)
        fresh = self.inc.plan.fresh_for(self.rank)
        if fresh:
            with self.progress.waiting_for("resend"):
                self.engine.resend(step, fresh)
        self.ctx.store.set(self.inc.resumed_key(), str(step))
        self._check_next = True

    def _agree(self, target: int) -> None:
        """All ranks must hold the same step and, data-parallel, bit-identical parameters (sharded, each
        rank's own shards: those are checked against the snapshot's checksum when it is restored)."""
        assert self.watch is not None
        crc = 0
        if isinstance(self._model, DataParallel):
            for p in self._model.module.parameters():
                crc = zlib.crc32(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
        mine = torch.tensor([target, crc], dtype=torch.int64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        with self.progress.waiting_for("agree"):
            finish(dist.all_gather(everyone, mine, async_op=True), self.watch.aborted,
                   self.ctx.config.collective_timeout_s)
        if any(not torch.equal(other, mine) for other in everyone):
            raise ProtocolError(f"ranks disagree on the restored state: {[t.tolist() for t in everyone]}")


def _device_index(ctx: Context, inc: Incarnation) -> int | None:
    """This process's GPU: its own (the launcher's placement, coordinator/policy.place_devices) or, for a
    spare that has none, the GPU of the process that held its rank before: that process is dead (it was
    replaced), so its device is free. None: train on the CPU."""
    own = os.environ.get(ENV_DEVICE, "")
    if own:
        return int(own)
    for gen in range(inc.generation - 1, -1, -1):  # the latest earlier owner that had a device
        previous = ctx.plan(gen).ranks[inc.my_rank()]
        if ctx.store.check([ctx.keys.device(previous)]):
            return int(ctx.store.get(ctx.keys.device(previous)))
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


def _count_compilation_as_waiting(progress: Progress, events: EventLog) -> None:
    """torch.compile's first step can take minutes, one rank finishing before another: a rank compiling
    is marked as waiting, so the hang detector does not fence it (its heartbeat still shows it alive).
    Each compilation is logged: one on a spare after `spare_activated` means its warm-up did not match
    training (TORCH_LOGS=recompiles says which guard failed)."""
    if "torch._dynamo" not in sys.modules:  # imported by creating an optimizer, so present in practice
        return
    from torch._dynamo import callback

    saved: list[tuple[str, bool, float]] = []

    def start(_: Any) -> None:
        saved.append((progress.phase, progress.waiting, time.monotonic()))
        progress.phase, progress.waiting = "compile", True

    def end(_: Any) -> None:
        if saved:
            progress.phase, progress.waiting, started = saved.pop()
            events.emit("compiled", step=progress.step, duration_s=time.monotonic() - started)

    callback.on_compile_start(start)
    callback.on_compile_end(end)


def _report_script_errors(session: Session) -> None:
    """Makes an uncaught exception of the script's own known to the coordinator before the traceback is
    printed, so that it stops the job instead of replaying the error on a spare."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        yours = isinstance(error, ConfigError) or not isinstance(error, DeadPoolError)
        if isinstance(error, Exception) and yours and not is_communication_error(error):
            first = str(error).splitlines()[0] if str(error) else ""
            report = {"rank": session.inc.rank, "step": session.progress.step, "gen": session.generation,
                      "error": f"{kind.__name__}: {first}"}
            try:
                session.ctx.store.set(session.ctx.keys.script_error(session.ctx.proc), json.dumps(report))
            except Exception:  # the coordinator is gone: the exit code still tells
                pass
        previous(kind, error, tb)

    sys.excepthook = hook
