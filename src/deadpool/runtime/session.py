"""The API a training script uses: init, wrap, register, run, stop, log.

A Session is a thin front: the process's membership in each generation and its part in recovery live in
member.py, the step loop that survives failures in loop.py, the collective decisions in agree.py, and the
rule that tells a peer's failure from the script's own error in failures.py.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from deadpool.errors import ConfigError, PeerFailure, UsageError
from deadpool.protocol.kinds import Role
from deadpool.protocol.records import ScriptError, Started
from deadpool.runtime import standalone
from deadpool.runtime.comms import DataParallel
from deadpool.runtime.context import Context
from deadpool.runtime.failures import end_quietly_after_errors, report_script_errors
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.heap import keep_heap
from deadpool.runtime.holding import Holdings
from deadpool.runtime.implicit import RNGState, StepVariables
from deadpool.runtime.loop import StepLoop
from deadpool.runtime.member import Member
from deadpool.runtime.persist import Persister
from deadpool.runtime.recovery import Recovery, State
from deadpool.runtime.sharded import ShardedModel, is_sharded
from deadpool.runtime.state import Stateful, one_mesh, state_sha256
from deadpool.runtime.terminate import on_termination
from deadpool.runtime.watch import Beacon

RESERVED = ("rng", "deadpool", "variables")  # the names of the state DeadPool adds to every snapshot


def init(warmup: Callable[[], Any] | None = None) -> "Session":
    """Joins the job. A worker returns at once; a spare blocks here, holding other ranks' snapshots,
    until it is given a rank (or exits with the job if it never is).

    `warmup`: what a spare runs once while it waits, so that a swap does not pay for it: typically a
    throwaway model like the real one, compiled, through one forward and backward at the training
    shapes (torch.compile's code is kept per model class and reused by the model built after the
    spare is called). Workers do not run it."""
    if not standalone.launched():
        standalone.join()  # `python train.py` or plain torchrun: a job of its own, without spares
    ctx = Context.from_environment()
    joined: list[Session] = []  # set once this process has a rank

    def last_words() -> None:  # SIGTERM: a rank's newest commit goes to disk before the process exits
        for session in joined:
            session.member.persist_newest()

    if ctx.config.persist_dir:  # else SIGTERM ends the process at once, as it always did
        on_termination(ctx, last_words)
    ctx.plane.put(ctx.keys.started(ctx.proc), Started(ctx.proc))
    Beacon(ctx)  # from here on the coordinator can tell this process stopped, whatever it is doing
    heap = keep_heap()  # before the script allocates its model: every step after this reuses its pages
    ctx.events.emit("process_start", argv=sys.argv, heap=heap)
    if ctx.role == Role.SPARE:
        from deadpool.spare import Standby

        standby = Standby(ctx, warmup)
        inc, held = standby.run()
        session = Session(ctx, inc, held=held, persister=standby.persister)
        # Hand over, receive and report this rank's replicas and join the group now; the script then builds
        # its model, and session.run() restores into it with the same state machine as the survivors.
        recovery = session.loop.recovery = Recovery(ctx, session.member, inc.generation - 1, failed_step=None,
                                                    inc=inc)
        recovery.run(until=State.RESTORE)
        joined.append(session)
        return session
    ctx.wait_key(ctx.keys.plan(0), time.monotonic() + ctx.config.connect_timeout_s)
    session = Session(ctx, Incarnation.of(ctx.plan(0), ctx.proc, ctx.keys))
    ctx.faults.point("init", 0)
    try:
        session.member.enter()  # the script may use torch.distributed from here on
    except PeerFailure:
        # A rank died in start-up, so generation 0 never formed: this worker goes on in the generation that
        # replaces it, as a spare does (nothing was committed, so every rank begins afresh in session.run).
        recovery = session.loop.recovery = Recovery(ctx, session.member, 0, failed_step=None)
        recovery.run(until=State.RESTORE)
    joined.append(session)
    return session


class Session:
    """One process's membership in the job, as the script sees it."""

    def __init__(self, ctx: Context, inc: Incarnation, held: Holdings | None = None,
                 persister: Persister | None = None) -> None:
        self.ctx = ctx
        self.member = Member(ctx, inc, held, persister)
        self.loop = StepLoop(self.member)
        self._registered: dict[str, Stateful] = {}
        self._ran = False
        # Unseeded generators would make every run differ (torch too: it draws a fresh seed per process), and a
        # spare that builds random data in its set-up would get other data than the rank it replaces. Seeding
        # here, once the rank is known (a spare's too, on activation), makes both reproducible; a script that
        # seeds after init() keeps its own seeds.
        seed = ctx.config.seed + self.rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        report_script_errors(
            publish=lambda report: ctx.plane.put(ctx.keys.script_error(ctx.proc), ScriptError(**report)),
            whose=lambda: {"rank": self.member.inc.rank, "step": self.member.progress.step, "gen": self.generation,
                           "taking_over": self.loop.recovery.target if self.loop.recovery else None},
            judged=lambda error: error is self.loop.fatal)
        end_quietly_after_errors()

    @property
    def rank(self) -> int:
        return self.member.rank

    @property
    def world_size(self) -> int:
        return self.member.world_size

    @property
    def generation(self) -> int:
        return self.member.inc.generation

    @property
    def step(self) -> int:
        """The last step completed (rolled back by a recovery)."""
        return self.member.step

    @property
    def replaying(self) -> bool:
        """True while the step being run was run once already, before a failure rolled this job back to an
        earlier snapshot (the same on every rank, a spare's too): a script skips logging, printing or
        checkpointing it again."""
        return self.loop.replaying

    @property
    def device(self) -> torch.device:
        """Where this rank's model and batches live: its GPU, or the CPU."""
        return self.member.device

    def wrap(self, model: torch.nn.Module, bucket_cap_mb: float | None = None) -> torch.nn.Module:
        """Use instead of DistributedDataParallel(model): the returned module survives group rebuilds, and
        reduces gradients in buckets of DDP's sizes (`bucket_cap_mb` as DDP's) while backward runs.

        A model sharded with FSDP2 (`fully_shard(model)` last, on the root) is returned as it is: FSDP
        keeps communicating itself, and DeadPool rebinds it to each new generation's group."""
        member, loop = self.member, self.loop
        _refuse_ddp(model, "session.wrap got")
        if is_sharded(model):
            member.model = ShardedModel(model)  # each rank holds its own shards: nothing to compare across ranks
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
            member.model.middle().register_forward_hook(loop.mark_backward)
            return model
        model.to(member.device)
        member.model = DataParallel(model, bucket_cap_mb)
        member.engine.replicated = True  # every rank's parameters and optimizer state must stay identical
        member.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        params = [p for p in model.parameters() if p.requires_grad]
        if params:  # a hook midway through the parameters fires in the middle of backward
            params[len(params) // 2].register_hook(lambda grad: loop.point("backward"))
        return member.model

    def _before_forward(self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.loop.point("forward")
        self.loop.inputs.saw(args, kwargs)

    def register(self, **objects: Stateful) -> None:
        """Declares the state a snapshot holds: optimizer, scheduler, data position, anything Stateful (may be
        called more than once). The model given to wrap(), RNG states, the step counter and the variables the
        step function rebinds are added by DeadPool."""
        for name, obj in objects.items():
            if name in RESERVED or name in self._registered:
                raise ConfigError(f"state name {name!r} is reserved by DeadPool or already registered; pick another")
            _refuse_ddp(obj, f"{name!r} is")
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"{name!r} is not Stateful: it needs state_dict() and load_state_dict()")
            self._registered[name] = obj
            if isinstance(obj, torch.optim.Optimizer):
                self.member.optimizers.append(obj)
                obj.register_step_pre_hook(lambda *_: self.loop.before_optimizer_step())
                obj.register_step_post_hook(lambda *_: self.loop.point("after_optimizer"))

    def run(self, train_step: Callable[[int], Any], steps: int | None = None) -> None:
        """Calls train_step(step) for step = next..steps (or until session.stop()); returns when every step
        is done, recovering from failures on the way. train_step may return the loss (a tensor or a float) for
        the step events and summary.json; if it returns None, the last `session.log(..., loss=x)` of the step
        counts instead.

        The variables train_step rebinds with `nonlocal` or `global` (a counter, a prefetched batch) are
        part of every snapshot, like the registered objects."""
        if self._ran:
            raise UsageError("session.run() was called a second time: call it once, with steps= the whole run "
                             "(a loop around it, or a second phase of training, goes inside the step function)")
        self._ran = True
        objects = dict(self._registered)
        member = self.member
        model = member.model.module if isinstance(member.model, ShardedModel) else member.model
        if model is None:
            raise UsageError("nothing trainable: session.run() found no model. Pass the model to session.wrap "
                             "(instead of DistributedDataParallel) before run(): DeadPool snapshots it and keeps "
                             "the ranks' copies in step")
        if not any(obj is model or obj is getattr(model, "module", None) for obj in objects.values()):
            objects = {"model" if "model" not in objects else "wrapped_model": model, **objects}
        if not member.optimizers:
            raise UsageError("register the optimizer before session.run(): session.register(optimizer=optimizer) "
                             "(DeadPool snapshots while the next step runs, and must know when the weights change)")
        variables = StepVariables(train_step)
        member.tree = {**objects, "rng": RNGState(member.device), "deadpool": self.loop, "variables": variables}
        try:
            state_sha256({"variables": variables})  # values DeadPool cannot snapshot fail here, not mid-run
        except ConfigError as error:
            raise ConfigError(f"{error}. {train_step.__name__} rebinds it with nonlocal/global, so DeadPool "
                              "snapshots it: keep plain values there, or register the object instead") from None
        one_mesh(member.tree)  # shards DeadPool could not restore are refused now, not at a recovery
        # Everything built so far (torch, the model, the data) lives as long as the run: freezing it keeps it
        # out of the gc.collect() in leave_group, which otherwise walks it all (0.2-0.4 s) while recovering.
        gc.freeze()
        self.loop.run(train_step, steps)

    def stop(self) -> None:
        """Ends the run after the current step, on every rank at that same step (early stopping, an
        evaluate-only run). Any rank may call it; the ranks agree at the end of the step."""
        self.loop.stop_requested = True

    def log(self, event: str, **fields: Any) -> None:
        """Appends an event of the script's own to the run's events.jsonl (JSON-serialisable fields). A `loss`
        field is the step's loss in summary.json when the step function returns none."""
        if "loss" in fields:
            self.loop.logged_loss = fields["loss"]
        self.ctx.events.emit(event, **fields)


def _refuse_ddp(obj: object, what: str) -> None:
    """torch's DDP cannot be handed to DeadPool: its process group dies with the first failure, and its hooks
    hide the model's phases from the fault plan and the hang detector. session.wrap does its job instead."""
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        raise UsageError(f"{what} a torch DistributedDataParallel: pass the plain module to session.wrap instead "
                         "(model = session.wrap(module), without DDP(...)), which averages the gradients as DDP does "
                         "and survives a swap")
