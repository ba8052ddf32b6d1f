"""The step loop: runs the script's steps, snapshots them, and turns a failed step into a recovery.

A failed step (a peer died or hung, the coordinator aborted the generation: runtime/failures.py decides)
unwinds to this loop, which runs the recovery state machine (recovery.py) and goes on; a spare enters the
same machine when it is given a rank. An exception of the script's own is not a failure a spare can fix:
it propagates (session.py reports it to the coordinator, which stops the job).

    TRAINING --failure--> leave generation g --recover()--> restored, rejoined g+1 --> TRAINING
    SET-UP (_begin) --failure before the first commit--> recover() --> rejoined g+1 --> SET-UP again
    TRAINING --script error--> re-raise (traceback, exit 1; the job stops)
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from deadpool.errors import GenerationAborted, SwapAborted, WorkerFailure
from deadpool.events import EventLog
from deadpool.protocol.kinds import Phase
from deadpool.protocol.records import Commit
from deadpool.runtime.agree import agree_on_interval, agree_to_stop
from deadpool.runtime.cadence import (
    CALIBRATION_GAP,
    PRICED_STEPS,
    agrees_after,
    behind,
    behind_window,
    longest_gap,
    snapshots_after,
)
from deadpool.runtime.comms import guard_exit
from deadpool.runtime.failures import RECOVERABLE, Verdict, classify
from deadpool.runtime.member import Member
from deadpool.runtime.persist import check_fits, describe_misfit, load_from_disk
from deadpool.runtime.recovery import Recovery
from deadpool.runtime.replay import InputFingerprints
from deadpool.runtime.state import state_sha256
from deadpool.runtime.watch import Progress


class StepLoop:
    """Stateful as the snapshot's "deadpool" entry: the step counter and the snapshot interval."""

    def __init__(self, member: Member) -> None:
        self.member = member
        every = member.ctx.config.snapshot_every
        self.auto = self.calibrating = every == "auto"
        self.every = 1 if self.calibrating else int(every)
        # the most steps between two snapshots in this run: how far back a replay's inputs are kept
        self.widest = CALIBRATION_GAP if self.calibrating else self.every
        self.steps: int | None = None  # session.run(steps=...): the ranks must agree on it
        self.stop_requested = False  # session.stop() was called in this step
        self.stopped = False         # every rank agreed to end the run after this step
        self.check_next = False      # after a recovery, the next step is snapshotted (and its replicas compared)
        self.step_ends: dict[int, float] = {}  # `auto`: when each recent step ended (cadence.py)
        self.snapshotted: set[int] = set()     # `auto`: the recent steps after which a snapshot was taken
        self.logged_loss: Any = None  # the last loss= the script gave session.log in this step
        self.recent: list[tuple[float, float]] = []  # the last steps' (wait for the snapshot engine, duration)
        self.told_behind = False  # the user was told that snapshots slow training (once per process)
        self.inputs = InputFingerprints()  # what the model was fed, step by step: a replay must be fed the same
        self.recovery: Recovery | None = None  # a spare's recovery into its rank, begun in init()
        self.fatal: BaseException | None = None  # the error this loop let through: it must stop the job
        self.keep_compile_counted: Callable[[], None] = lambda: None  # set by run()

    @property
    def replaying(self) -> bool:
        """The step being run (member.step + 1) was run once already, before a failure rolled it back."""
        return self.member.step < self.member.frontier

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.member.step, "every": self.every, "calibrating": self.calibrating}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loaded only by a recovery's restore: the run goes on from the restored step, and its next step
        is snapshotted whatever the interval, so that the replicas are compared right after a recovery."""
        self.member.step, self.every, self.calibrating = state["step"], state["every"], state["calibrating"]
        # `auto`: the steps from here are run (and timed) again, and the first one's predecessor ended before
        # the failure
        self.step_ends = {s: t for s, t in self.step_ends.items() if s < self.member.step}
        self.snapshotted = {s for s in self.snapshotted if s <= self.member.step}
        self.stop_requested = self.stopped = False
        self.check_next = True

    def run(self, train_step: Callable[[int], Any], steps: int | None) -> None:
        """Runs steps until `steps` or an agreed stop, recovering from failures on the way."""
        self.keep_compile_counted = _count_compilation_as_waiting(self.member.progress, self.member.ctx.events)
        self.steps = steps
        cause = "joined in a later generation" if self.recovery is not None else self._attempt(self._begin)
        while cause or not (self.stopped or (steps is not None and self.member.step >= steps)):
            if cause and self._recover(cause):  # nothing was committed: the job's start is done again
                cause = self._attempt(self._begin)
                continue
            cause = self._attempt(lambda: self._one_step(train_step))
        self._finish()

    # ---- steady state --------------------------------------------------------------------

    def _begin(self) -> None:
        """A fresh job: rank 0's initial weights win (or, resuming, every rank loads its state from the
        checkpoint), and the first snapshot is committed before the next step runs, so that a failure at any
        moment after this is recoverable."""
        member = self.member
        assert member.watch is not None
        member.attach(sync=True)
        if member.ctx.config.resume:
            self._resume()
        member.engine.start(member.inc, member.watch)
        member.hold()
        member.ctx.faults.point("setup", 0)
        if self.every:
            member.engine.capture(member.step, member.tree)
            with member.progress.waiting_for("commit"):
                member.engine.wait_committed(member.step)

    def _resume(self) -> None:
        """`deadpool run --resume`: this rank's state, RNGs and step counter come from the checkpoint."""
        member, path = self.member, self.member.ctx.config.resume
        check_fits(Path(path), member.tree)
        loaded = member.engine.slots[0]
        with member.progress.waiting_for("resume"):
            step = load_from_disk(Path(path), member.rank, loaded, member.world_size)
        try:
            member.restore(step)
        except Exception as error:
            raise describe_misfit(path, error) from None
        loaded.step = None  # the state is live now; its first snapshot, taken next, is the one holders get
        every = member.ctx.config.snapshot_every  # this job's interval, not the one the checkpoint's job used
        self.calibrating, self.every, self.check_next = every == "auto", 1 if every == "auto" else int(every), False
        member.ctx.events.emit("resumed_from_disk", step=step, path=path)
        print(f"[deadpool] rank {member.rank}: resumed from {path} at step {step}", flush=True)

    def point(self, phase: str) -> None:
        """A point of the step the coordinator sees progress at, and where a planned fault may fire."""
        self.member.progress.mark(self.member.step + 1, phase)
        watch = self.member.watch
        self.member.ctx.faults.point(phase, self.member.step + 1, before_stop=watch.beat_now if watch else lambda: None)

    def mark_backward(self, _module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        """A forward hook: the gradient of this output is computed in the middle of backward."""
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self.point("backward"))

    def before_optimizer_step(self) -> None:
        """The state may change from here on, so the last snapshot's copy must be complete."""
        with self.member.progress.waiting_for("snapshot_copy"):
            self.member.engine.wait_copied()
        self.member.progress.mark(self.member.step + 1, "optimizer")

    def _tell_if_behind(self, waited: float, duration: float) -> None:
        """Tells the user, once, when training waits for the snapshot engine (cadence.behind says when; the
        first two intervals, which fill the slots and holders, are not judged)."""
        self.recent = (self.recent + [(waited, duration)])[-behind_window(self.every):]
        found = behind([w for w, _ in self.recent], [d for _, d in self.recent], list(self.member.engine.costs),
                       self.every)
        if found is not None:
            self.told_behind = True
            self.member.ctx.events.emit("snapshots_behind", step=self.member.step, waited_share=found.waited_share,
                                        engine_s=found.engine_s, step_s=found.step_s, every=found.every,
                                        advice_every=found.advice_every)
            if self.member.rank == 0:
                print(f"[deadpool] {found.message()}", file=sys.stderr, flush=True)

    def _snapshots_after(self, step: int) -> bool:
        if self.auto:
            return snapshots_after(step, None if self.calibrating else self.every)
        return step % self.every == 0

    def _one_step(self, train_step: Callable[[int], Any]) -> None:
        member = self.member
        if member.watch is None or member.watch.aborted():
            raise GenerationAborted(f"generation {member.inc.generation} was aborted by the coordinator")
        step = member.step + 1
        self.keep_compile_counted()
        self.point("step_start")
        self.stop_requested = False
        start, waited, replay = time.monotonic(), member.engine.wait_s, self.replaying
        self.logged_loss = None
        self.inputs.drop_partial()
        loss = train_step(step)
        self.inputs.end_step(step, replay, member.rank, self.widest)
        if loss is None:  # the step function need not return its loss: session.log(loss=...) tells it too
            loss = self.logged_loss
        member.step = step
        duration = time.monotonic() - start
        member.progress.record_step(duration)
        member.progress.mark(step, "step_end")
        value = None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        # thread_cpu_s: the training thread's CPU so far (what a benchmark compares across variants)
        member.ctx.events.emit("step", step=step, loss=value, dur_s=duration, wait_s=member.engine.wait_s - waited,
                               replay=replay, thread_cpu_s=time.thread_time())
        if not self.auto and self.every and not self.told_behind and step > 2 * self.every:
            self._tell_if_behind(member.engine.wait_s - waited, duration)  # (`auto` prices its snapshots itself)
        if self.auto:  # a step's whole time, snapshot capture and agreements included, as users see it
            self.step_ends[step] = time.monotonic()
        if self.every and (self._snapshots_after(step) or self.check_next):
            member.engine.capture(step, member.tree)
            if self.auto:
                self.snapshotted.add(step)
            self.check_next = False
        if self.auto and agrees_after(step):
            self._agree_on_interval(step)
        self.stopped = agree_to_stop(member, self.stop_requested, self.steps)
        if self.stopped and member.rank == 0:
            member.ctx.events.emit("stopped", step=step, reason="session.stop()")

    def _agree_on_interval(self, step: int) -> None:
        """`auto`: the interval from the blocks of the recent steps (the first agreement ends the calibration)."""
        ends = self.step_ends = {s: t for s, t in self.step_ends.items() if s >= step - PRICED_STEPS}
        self.snapshotted = {s for s in self.snapshotted if s >= step - PRICED_STEPS}
        durations = {s: ends[s] - ends[s - 1] for s in ends if s - 1 in ends}
        current = None if self.calibrating else self.every
        self.every = agree_on_interval(self.member, step, durations, self.snapshotted, current)
        self.calibrating, self.widest = False, max(self.widest, longest_gap(self.every))

    def _finish(self) -> None:
        member = self.member
        if self.every:
            with member.progress.waiting_for("commit"):
                member.engine.drain()
            # with --persist-dir: the job's last commit becomes a checkpoint
            member.persist(member.ctx.plane.get(member.inc.committed_key(), Commit).step)
        # The training state: everything registered, the RNGs and the step, not DeadPool's own settings. The
        # step function's variables have their own digest but stay out of the whole: they may hold timings.
        training = {name: obj for name, obj in member.tree.items() if name != "deadpool"}
        digests = {**state_sha256(training), "step": str(member.step)}
        whole = hashlib.sha256("".join(digests[k] for k in sorted(digests) if k != "variables").encode()).hexdigest()
        member.ctx.events.emit("finished", step=member.step, state_sha256=whole, entry_sha256=digests)
        if member.watch is not None:
            member.watch.close(last_words=Phase.FINISHED)
            member.watch = None
        # The process group stays: the script may still use it (a final barrier, an evaluation) and destroy
        # it with dist.destroy_process_group(), as after DDP. Failures from here on are not recovered.
        member.engine.stop()
        member.held.stop()  # the last snapshot is committed: every holder has acknowledged every rank's copy
        member.persister.close()  # its part of the last commit is written: no more orders to look for

    # ---- failures ------------------------------------------------------------------------

    def _attempt(self, action: Callable[[], None]) -> str | None:
        """Runs one unit of work; a failure of some rank comes back as text (so the exception, and the
        frames holding the old process group, are gone before recovery starts). Anything else is the
        script's own error (or a bug of DeadPool's) and propagates."""
        try:
            action()
            return None
        except Exception as error:
            verdict = self._judge(error)
            if not verdict.failure:
                self.fatal = error
                raise
            first = str(error).splitlines()[0] if str(error) else ""
            return f"{type(error).__name__}: {first}"

    def _judge(self, error: Exception) -> Verdict:
        """failures.classify, with this generation's abort and the job's end; the rank counts as waiting
        meanwhile (it waits on the coordinator, and must not be fenced as hung)."""
        ctx, watch = self.member.ctx, self.member.watch
        with self.member.progress.waiting_for("judging_error"):
            verdict = classify(error, aborted=lambda: watch is not None and watch.aborted(),
                               ended=lambda: ctx.plane.has(ctx.keys.shutdown()),
                               plan_wait_s=ctx.config.plan_wait_s, poll_s=ctx.config.poll_interval_s)
        if not isinstance(error, RECOVERABLE):  # judged by where it came from and what followed: say how
            ctx.events.emit("error_judged", error=type(error).__name__, failure=verdict.failure, reason=verdict.reason)
        return verdict

    def _recover(self, cause: str) -> bool:
        """Leaves the failed generation and runs the recovery state machine into the next one. True: nothing
        was committed, so nothing was restored, and the job's start must be done again (_begin)."""
        member, started, was = self.member, time.monotonic(), self.member.step
        guard_exit()
        activated = self.recovery is not None  # its recovery began in init() (a spare, or a worker whose
        # generation 0 failed in start-up): it is in the group already
        if not activated:
            member.frontier = max(member.frontier, member.step)
            member.ctx.events.emit("failure_seen", cause=cause, step=member.step)
            member.leave()
        recovery = self.recovery or Recovery(member.ctx, member, member.inc.generation, member.step + 1)
        self.recovery = None
        try:
            done = recovery.run()
        except SwapAborted as error:
            raise WorkerFailure(f"{member.ctx.proc} cannot continue after '{cause}': {error}") from None
        except WorkerFailure:  # fenced out: the coordinator replaced this process already
            raise
        except Exception as error:  # a bug, in the recovery or the restored state: it stops the job
            self.fatal = error
            raise
        assert done is not None
        _, target = done
        spare = member.ctx.role == "spare"
        if activated and spare:
            member.ctx.events.emit("spare_activated", restored_step=target)
        where = ("begins afresh (a rank died before the first commit)" if target is None else
                 f"took this rank over at step {target}" if activated and spare else f"resumed at step {target}"
                 if target == was else f"rolled back to step {target} (was at {was})")
        print(f"[deadpool] rank {member.rank}: generation {member.inc.generation}, {where} "
              f"in {time.monotonic() - started:.2f} s", flush=True)
        return target is None


def _count_compilation_as_waiting(progress: Progress, events: EventLog) -> Callable[[], None]:
    """torch.compile's first step can take minutes, one rank finishing before another: a rank compiling
    is marked as waiting, so the hang detector does not fence it (its heartbeat still shows it alive).
    Each compilation is logged: one on a spare after `spare_activated` means its warm-up did not match
    training (TORCH_LOGS=recompiles says which guard failed). Returns what keeps it so, for every step:
    torch._dynamo.reset() drops every compile callback, and torch.compile may be loaded only later."""
    saved: list[tuple[str, bool, float]] = []

    def start(_: Any) -> None:
        saved.append((progress.phase, progress.waiting, time.monotonic()))
        progress.phase, progress.waiting = "compile", True

    def end(_: Any) -> None:
        if saved:
            progress.phase, progress.waiting, started = saved.pop()
            events.emit("compiled", step=progress.step, duration_s=time.monotonic() - started)

    def keep() -> None:
        callback = sys.modules.get("torch._dynamo.callback")  # loaded with torch.compile (an optimizer loads it)
        if callback is not None and start not in callback.callback_handler.start_callbacks:
            callback.callback_handler.register_start_callback(start)
            callback.callback_handler.register_end_callback(end)

    keep()
    return keep
