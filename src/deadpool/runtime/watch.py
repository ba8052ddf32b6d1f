"""One generation's watch: sees the coordinator abort it, and tells the coordinator this rank is alive.

A thread waits in the store for `abort/{g}` to be written (the store wakes it at once), so `aborted()` is a
free check for the training thread, the snapshot engine and any collective being waited on; when the
abort comes it also runs `on_abort` (comms.abandon_group: on NCCL it aborts the communicator, on gloo it
shuts the group's connections down, which releases a training thread blocked in a kernel, a host sync or
a synchronous collective of the script's own, where no Python check can run). A second thread publishes
this rank's heartbeat every BEAT_EVERY_S: a beat counter and the training thread's progress (step, phase,
whether it waits on peers). The coordinator fences a rank whose beat stops (SIGSTOP) or whose progress
stops while it does not wait (spinning in the script). A rank that half the recovery timeout after its
abort has not reported ready in the next generation is stuck, in the old generation where neither reaches
or in leaving it and recovering: a thread started at the abort then logs every thread's stack
(`abort_unheeded`), so the job that fails at the recovery deadline says where.

A Watch lives for one generation of a rank; a Beacon lives as long as the process, from deadpool.init() on,
and beats whatever the process does: holding replicas as an idle spare, or recovering between two
generations, when no Watch runs. The coordinator fences a process that shows no sign of life in those
times, and takes either kind of beat as one: so the Beacon rests while the Watch's heartbeat goes out
(one store request a period instead of two; at 4 ranks, 40 fewer a second).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

from deadpool.protocol.kinds import Phase
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Heartbeat, Published
from deadpool.runtime.context import Context, connect
from deadpool.runtime.generation import Incarnation

# The heartbeat's period. The coordinator judges silence over 1.5 s and a stalled step over >= 3 s, so a
# pulse every 0.1 s costs nothing in detection; looking at the progress every 20 ms, as this thread once did,
# woke it 50 times a second and cost each rank ~10 ms of CPU a second (3M x 4 ranks, 2 cores).
BEAT_EVERY_S = 0.1
ABORT_SLICE_S = 0.25  # how long the abort wait blocks in the store before asking whether the watch closed


class Progress:
    """What the training thread is doing, written by it and read by the watch thread (plain attributes:
    a torn read costs nothing worse than one stale heartbeat)."""

    def __init__(self) -> None:
        self.step, self.phase, self.waiting = 0, Phase.START.value, False
        self.marks = 0  # every mark is progress, even of the same phase (rank 0 evaluating: forward after forward)
        self.step_times: list[float] = []

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase, self.waiting = step, phase, False
        self.marks += 1

    @contextmanager
    def waiting_for(self, what: str) -> Iterator[None]:
        """Marks a wait on peers (a collective, a commit): the waiting rank is never the hung one."""
        before = self.phase, self.waiting
        self.phase, self.waiting = what, True
        try:
            yield
        finally:
            self.phase, self.waiting = before

    def record_step(self, duration: float) -> None:
        self.step_times = (self.step_times + [duration])[-20:]

    def pulse(self, gen: int, beat: int) -> Heartbeat:
        step_s = statistics.median(self.step_times) if self.step_times else None
        return Heartbeat(gen, beat, self.step, self.phase, self.marks, self.waiting, step_s)


class Beacon:
    """The process's own sign of life: a thread that adds one to `alive/{proc}` every BEAT_EVERY_S until the
    process exits (a SIGSTOP stops it with every other thread), but for the periods in which a Watch
    published a heartbeat, which the coordinator takes as the same sign. It ends quietly when the store
    goes away."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        threading.Thread(target=self._run, name="deadpool-beacon", daemon=True).start()

    def _run(self) -> None:
        key = self.ctx.keys.alive(self.ctx.proc)
        try:
            plane = self.ctx.own_plane()  # never queued behind another thread's call
            while True:
                if time.monotonic() - self.ctx.heartbeat_t > 2 * BEAT_EVERY_S:  # no heartbeat of late
                    plane.count(key)
                time.sleep(BEAT_EVERY_S)
        except Exception:  # the store is gone: the job ended, and this process exits with it
            return


class Watch:
    """Lives exactly as long as one generation of this process; `close()` ends it."""

    def __init__(self, ctx: Context, inc: Incarnation, progress: Progress | None,
                 on_abort: Callable[[], None] = lambda: None) -> None:
        self.ctx, self.inc, self.progress, self.on_abort = ctx, inc, progress, on_abort
        self._aborted = threading.Event()
        self._closed = threading.Event()
        self._beating = threading.Lock()  # one pulse at a time: a stale one never lands after a fresher one
        self._beat = 0
        self._thread = threading.Thread(target=self._run, name=f"deadpool-watch-g{inc.generation}", daemon=True)
        self._thread.start()
        threading.Thread(target=self._await_abort, name=f"deadpool-abort-g{inc.generation}", daemon=True).start()

    def aborted(self) -> bool:
        return self._aborted.is_set()

    def close(self, last_words: str | None = None) -> None:
        """Ends the watch; `last_words` is a final phase published at once (e.g. "finished": the
        coordinator then knows the silence that follows is not a hang)."""
        self._closed.set()
        self._thread.join(1.0)
        if last_words is not None and self.progress is not None:
            self.progress.mark(self.progress.step, last_words)
            self._publish(self.ctx.plane, self.progress.pulse(self.inc.generation, -1))

    def beat_now(self) -> None:
        """Publishes this rank's progress at once, from the calling thread: a planned hang (SIGSTOP) is about
        to stop the watch thread too, and the verdict must name the point it stopped at, not one up to a poll
        interval older."""
        if self.progress is not None:
            with self._beating:
                self._beat += 1
                self._publish(self.ctx.plane, self.progress.pulse(self.inc.generation, self._beat))

    def _ended(self, error: Exception) -> None:
        """One of the watch's threads lost the store before the watch was closed."""
        if not self._closed.is_set():
            self.ctx.events.emit("watch_ended", error=str(error).splitlines()[0] if str(error) else "")

    def _await_abort(self) -> None:
        """Blocks in the store until this generation's abort is written (not a poll: a few requests a second
        per rank instead of one per poll interval, and the abort is seen at once). A watch closed meanwhile
        ends it within ABORT_SLICE_S; an abort that comes after the close is not this watch's to act on."""
        try:
            client = connect(self.ctx.config)  # a blocking wait: on a connection of its own, closed when it ends
        except Exception as error:  # the store went away (or was replaced) before this thread got to it
            self._ended(error)
            return
        try:
            plane = ControlPlane(client)
            plane.wait([self.inc.abort_key()], float("inf"), give_up=self._closed.is_set, slice_s=ABORT_SLICE_S)
            if not self._closed.is_set():
                self._aborted.set()
                # before on_abort: a rank stuck even there still says where
                threading.Thread(target=self._report_if_unheeded, name=f"deadpool-stuck-g{self.inc.generation}",
                                 daemon=True).start()
                self.on_abort()
        except InterruptedError:  # closed
            pass
        except Exception as error:  # the store is gone (the coordinator ended the job): nothing to watch
            self._ended(error)
        finally:
            client.close()

    def _report_if_unheeded(self) -> None:
        """After an abort, a rank leaves the generation (member.leave) and reports ready in the next one
        (recovery.py), which the coordinator awaits until the recovery deadline. One that has not, half the
        recovery timeout after the abort, while a later generation's plan is out (so it is not merely waiting
        for the coordinator), is stuck: where neither the abort's checks nor abandon_group reach, or in
        leaving or recovering, and the job will fail at that deadline. Every thread's stack goes to the
        events and to stderr first, so that the failed run says where."""
        after_s = self.ctx.config.recovery_timeout_s / 2
        time.sleep(after_s)
        if self.ctx.ready_gen > self.inc.generation or not self._later_plan_out():
            return
        stacks = thread_stacks()
        phase = None if self.progress is None else self.progress.phase
        left = self._closed.is_set()
        self.ctx.events.emit("abort_unheeded", after_s=after_s, phase=phase, left=left, threads=stacks)
        where = "left it but has not reported ready in the next" if left else "has not left it"
        lines = [f"[deadpool] {self.ctx.proc}: generation {self.inc.generation} was aborted {after_s:g} s ago "
                 f"and this process {where} (phase {phase}); its threads:"]
        for name, stack in stacks.items():
            lines += [f"  thread {name}:", *(f"    {line}" for line in stack)]
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _later_plan_out(self) -> bool:
        """Whether the coordinator has published a generation after this one (on a client of this thread's
        own; False once the store is gone: the job is over)."""
        try:
            client = connect(self.ctx.config)
        except Exception:
            return False
        try:
            published = ControlPlane(client).poll(self.ctx.keys.generation(), Published)
            return published is not None and published.gen > self.inc.generation
        except Exception:
            return False
        finally:
            client.close()

    def _run(self) -> None:
        """The heartbeat: a new beat with the progress as it is, every BEAT_EVERY_S (a planned hang publishes
        its exact point at once: beat_now)."""
        if self.progress is None:
            return
        plane = self.ctx.own_plane()  # never queued behind another thread's call
        try:
            while not self._closed.wait(BEAT_EVERY_S):
                with self._beating:
                    self._beat += 1
                    self._publish(plane, self.progress.pulse(self.inc.generation, self._beat))
        except Exception as error:  # the store is gone (the coordinator ended the job): nothing to watch
            self._ended(error)

    def _publish(self, plane: ControlPlane, pulse: Heartbeat) -> None:
        """Puts the heartbeat, and notes when for the Beacon, which rests while heartbeats go out."""
        plane.put(self.ctx.keys.heartbeat(self.ctx.proc), pulse)
        self.ctx.heartbeat_t = time.monotonic()


def thread_stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, innermost call last, by thread name ("name (ident)" when names repeat)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks = {}
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, str(ident))
        key = name if name not in stacks else f"{name} ({ident})"
        stacks[key] = [line.rstrip() for entry in traceback.format_stack(frame) for line in entry.splitlines()]
    return stacks
