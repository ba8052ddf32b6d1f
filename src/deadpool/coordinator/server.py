"""The coordinator's shell: reads each tick's inputs from the processes and the store, calls machine.advance
with the clock, and applies the effects it returns, in order. Every decision is in machine.py (pure, its
state diagram there); this is the only coordinator module that does I/O. It imports torch only with a disk
tier (deadpool.disk assembles checkpoints); it reads and writes the job's records through the ControlPlane it
is given (protocol/plane.py), over the store's own table: the coordinator always runs beside its store.

A tick comes at once when something the machine waits on happens (a report written to the store, a process's
exit, SIGTERM), else every poll interval while anything is in flight, or every QUIET_TICK_S while the job only
trains and only liveness can change (machine.next_tick): beats are dated by when the store received them, not
when a tick read them, and a tick comes when a verdict could fall due. (A tick every 20 ms whatever happened
cost ~0.5 ms each, 28 ms of CPU a second, on a loaded host; one every 50 ms, 11.) In the steady state a rank's
durable report wakes it only with the others it needs (policy.awaited_reports): with a snapshot every step
the ranks' reports of a step come over ~20 ms, and a tick for each cost 3 ticks a commit where 1 does.

The job status goes to the store at once (`deadpool status` reads it live) and to run_dir/status.json, the
copy left when the job is gone. A status that differs from the file's only in its last commit waits up to
STATUS_FILE_EVERY_S: with a snapshot every step a commit comes every step, and a run directory on a shared
file system can take milliseconds per rename, on the coordinator's thread.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from deadpool.config import JobConfig
from deadpool.coordinator.machine import advance, next_tick, start
from deadpool.coordinator.policy import Durable, awaited_reports
from deadpool.coordinator.state import (
    Abort,
    CoordinatorState,
    Effect,
    Emit,
    ExitReport,
    Fence,
    Finalize,
    Inputs,
    MarkRunning,
    OrderPersist,
    Phase,
    PublishPlan,
    PublishStatus,
    Relabel,
    Say,
    Spawn,
    Stop,
    WriteCommit,
    WriteTarget,
)
from deadpool.errors import ProtocolError
from deadpool.events import EventLog
from deadpool.protocol import records
from deadpool.protocol.keys import Keys
from deadpool.protocol.kinds import Ending, Role
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import (
    Commit,
    Heartbeat,
    PersistReport,
    Published,
    Ready,
    Running,
    ScriptError,
    Shutdown,
    Target,
)
from deadpool.protocol.status import JobStatus, write_status
from deadpool.protocol.store import Table

QUIET_TICK_S = 0.25  # the longest wait between two ticks while the job only trains (machine.next_tick)
STATUS_FILE_EVERY_S = 1.0  # status.json rewritten for a new commit alone at most this often (module docstring)


class Exit(Protocol):
    """A process that ended: launcher.agent.Child, or coordinator.nodes.Exited (which may say its node was lost)."""

    name: str
    returncode: int | None
    pid: int | None


class Processes(Protocol):
    """Who starts, watches and fences the job's processes: the launcher itself (launcher/agent.py) or one
    agent per node through the store (coordinator/nodes.py)."""

    def spawn(self, name: str, role: Role, rank: int) -> Any: ...
    def poll(self) -> list[Any]: ...
    def fence(self, name: str) -> None: ...
    def alive(self) -> set[str]: ...
    def relabel(self, name: str, label: str) -> None: ...
    def stop_all(self, grace_s: float) -> None: ...
    def joined(self) -> dict[int, str]: ...
    def on_exit(self, wake: Callable[[], None]) -> None: ...


def resumed_in_place(config: JobConfig) -> int | None:
    """The step of the checkpoint this job resumed from, if it is one of --persist-dir's: it counts as persisted
    (not written again; a rank lost with every holder can be restored from it at once). None otherwise."""
    if not (config.resume and config.persist_dir):
        return None
    resumed = Path(config.resume).resolve()
    if resumed.parent != Path(config.persist_dir).resolve():
        return None
    return int(json.loads((resumed / "manifest.json").read_text())["step"])


class Coordinator:
    def __init__(self, config: JobConfig, plane: ControlPlane, events: EventLog, agent: Processes) -> None:
        self.config = config
        self.plane = plane
        self.keys = Keys(config.token)
        self.events = events
        self.agent = agent
        self.status_path = Path(config.run_dir) / "status.json"
        self.status_file: JobStatus | None = None  # what status.json holds, written at status_file_t
        self.status_file_t = -float("inf")
        self.status_pending: JobStatus | None = None  # newer than the file, waiting for STATUS_FILE_EVERY_S
        self.terminate = False  # set by the launcher's SIGTERM handler: the machine persists, then stops
        self.finalized: dict[int, bool] = {}  # checkpoints assembled since the last tick
        if not isinstance(plane.store, Table):
            raise TypeError("the coordinator runs beside its store: give it a ControlPlane over the store's Table")
        self.table = plane.store
        self.woken = threading.Event()  # set by a report written, an exit, SIGTERM: the next tick comes at once
        self.thread: int | None = None  # the thread that runs the loop: its own writes wake nobody
        # steady: the durable reports that wake the loop once all are written, of all this generation's (None: any)
        self.awaited: frozenset[str] | None = None
        self.durables: frozenset[str] = frozenset()
        self.reported: set[str] = set()  # reports written since the last tick's gather began (under the table's lock)
        self.seen: tuple[int, Mapping[int, Durable]] | None = None  # the last gather's (generation, durable reports)
        self.table.on_write = self._written
        agent.on_exit(self.woken.set)
        if config.persist_dir:  # torch's checkpoint modules take seconds to import: now, not at the first SIGTERM
            threading.Thread(target=importlib.import_module, args=("deadpool.disk",), name="deadpool-import",
                             daemon=True).start()

    def request_stop(self) -> None:
        """SIGTERM: the next tick persists the newest commit and stops the job (machine._stopping)."""
        self.terminate = True
        self.woken.set()

    def _written(self, key: str) -> None:
        """Every write to the store (under its lock): a report the machine waits on wakes the coordinator; in
        the steady state a durable report, once every awaited one is written (module docstring)."""
        if threading.get_ident() == self.thread or not self.keys.is_report(key):
            return
        self.reported.add(key)
        if self.awaited is None or key not in self.durables or self.awaited <= self.reported:
            self.woken.set()

    def _arm(self, state: CoordinatorState) -> None:
        """After a tick: which durable reports the next one waits for, from the reports it gathered (if it
        gathered them in this generation's steady state; else any report wakes it)."""
        awaited, gen = None, state.plan.generation
        if state.phase is Phase.STEADY and self.seen is not None and self.seen[0] == gen:
            awaited = frozenset(self.keys.durable(gen, r) for r in awaited_reports(self.seen[1],
                                                                                    state.plan.world_size))
        with self.table.lock:
            self.awaited = awaited
            self.durables = frozenset(self.keys.durable(gen, r) for r in range(state.plan.world_size))
            if awaited is not None and awaited <= self.reported:  # all written since the gather: tick at once
                self.woken.set()

    def run(self) -> int:
        """Starts the job and returns its exit code."""
        self.thread = threading.get_ident()
        state, effects = start(self.config, resumed_in_place(self.config))
        while True:
            for effect in effects:
                self._apply(effect)
            self._write_status_file(time.monotonic(), due_only=state.exit_code is None)
            if state.exit_code is not None:
                return state.exit_code
            self._arm(state)
            self.woken.wait(next_tick(state, time.monotonic(), self.config.poll_interval_s, QUIET_TICK_S))
            self.woken.clear()
            inputs = self._gather(state)
            self.finalized = {}
            state, effects = advance(state, inputs, time.monotonic())

    # ---- inputs -----------------------------------------------------------------------------

    def _gather(self, state: CoordinatorState) -> Inputs:
        """Exits and joins always; the reports the state's phase waits for."""
        with self.table.lock:
            self.reported, self.seen = set(), None
        exits = tuple(self._exit(child) for child in self.agent.poll())
        starting = [name for joining in state.joining.values() for name in joining.procs]
        started = frozenset(n for n, ok in zip(starting, self.plane.present([self.keys.started(n) for n in starting]))
                            if ok)
        return Inputs(exits=exits, joined=self.agent.joined(), started=started, terminate=self.terminate,
                      persist_reports=self._persist_reports(state), finalized=dict(self.finalized),
                      **self._alive(state), **self._reports(state))

    def _alive(self, state: CoordinatorState) -> dict[str, Any]:
        """Every planned process's beacon count (runtime/watch.Beacon; 0 before its first beat), and when its
        last sign of life arrived: its beacon's or its heartbeat's (the beacon rests while heartbeats go
        out), but those known to be gone."""
        gone = state.fenced | state.lost | state.finished
        procs = [p for p in (*state.plan.ranks, *state.plan.spares) if p not in gone]
        keys = [self.keys.alive(p) for p in procs]
        signs = zip(self.table.arrivals(keys), self.table.arrivals([self.keys.heartbeat(p) for p in procs]))
        last = {p: max(t for t in both if t is not None) for p, both in zip(procs, signs) if any(both)}
        return {"alive": dict(zip(procs, self.plane.counters(keys))), "alive_t": last}

    def _arrivals(self, procs: list[str], keys: list[str]) -> dict[str, float]:
        return {p: t for p, t in zip(procs, self.table.arrivals(keys)) if t is not None}

    def _persist_reports(self, state: CoordinatorState) -> dict[str, PersistReport]:
        """The writers' reports on the checkpoint being written (a report on an earlier one is not yet an answer);
        a malformed one counts as a failed part."""
        job = state.persisting
        if job is None or job.finalizing:
            return {}
        reports = {}
        for proc in dict.fromkeys(job.writers):
            try:
                report = self.plane.poll(self.keys.persisted(proc), PersistReport)
            except ProtocolError as error:
                report = PersistReport(job.step, proc, (), ok=False, error=str(error))
            if report is not None and report.step == job.step:
                reports[proc] = report
        return reports

    def _reports(self, state: CoordinatorState) -> dict[str, Any]:
        gen, world, keys, plane = state.plan.generation, range(state.plan.world_size), self.keys, self.plane
        if state.phase is Phase.STEADY:
            polled = plane.poll_all([keys.durable(gen, r) for r in world], records.Durable)
            durable = {r: Durable() if d is None else Durable(d.steps, d.skipped, d.fingerprints, d.audits)
                       for r, d in enumerate(polled)}  # no report yet: nothing held
            self.seen = (gen, durable)
            procs = [p for p in state.plan.ranks if p not in state.fenced]
            beat_keys = [keys.heartbeat(p) for p in procs]
            beats = plane.poll_all(beat_keys, Heartbeat)
            return {"durable": durable,
                    "beats": {p: beat for p, beat in zip(procs, beats) if beat is not None},
                    "beats_t": self._arrivals(procs, beat_keys)}
        if state.phase is Phase.AWAIT_READY:
            ready = plane.poll_all([keys.ready(gen, r) for r in world], Ready)
            return {"ready": {r: list(got.steps) for r, got in enumerate(ready) if got is not None}}
        if state.phase is Phase.AWAIT_RESUMED:
            resumed = plane.present([keys.resumed(gen, r) for r in world])
            return {"resumed": frozenset(r for r in world if resumed[r])}
        return {}

    def _exit(self, child: Exit) -> ExitReport:
        """An exit, with whether the process reached deadpool.init() and the error its script reported."""
        assert child.returncode is not None
        error = self.plane.poll(self.keys.script_error(child.name), ScriptError)
        return ExitReport(child.name, child.returncode, child.pid, started=self.plane.has(self.keys.started(
            child.name)), script_error=error, lost_with_node=getattr(child, "lost_with_node", None))

    # ---- effects ----------------------------------------------------------------------------

    def _apply(self, effect: Effect) -> None:
        plane, keys = self.plane, self.keys
        if isinstance(effect, PublishPlan):
            self._publish(effect)
        elif isinstance(effect, Abort):
            plane.put(keys.abort(effect.gen), records.Abort(effect.gen, effect.reason))
        elif isinstance(effect, WriteCommit):
            plane.put(keys.committed(effect.gen), Commit(effect.gen, effect.step, effect.abandoned))
        elif isinstance(effect, WriteTarget):
            plane.put(keys.target(effect.gen), Target(effect.gen, effect.step))  # step None: begin afresh
        elif isinstance(effect, MarkRunning):
            plane.put(keys.running(effect.gen), Running(effect.gen))
        elif isinstance(effect, Spawn):
            self._spawn(effect)
        elif isinstance(effect, Fence):
            self.agent.fence(effect.name)
        elif isinstance(effect, Relabel):
            self.agent.relabel(effect.name, effect.label)
        elif isinstance(effect, Emit):
            self.events.emit(effect.event, **effect.fields)
        elif isinstance(effect, Say):
            print(f"[coordinator] {effect.text}", file=sys.stderr if effect.error else sys.stdout, flush=True)
        elif isinstance(effect, OrderPersist):
            plane.put(keys.persist_order(), effect.order)
        elif isinstance(effect, Finalize):
            self._finalize(effect)
        elif isinstance(effect, PublishStatus):
            plane.put(keys.status(), effect.status)
            self.status_pending = effect.status
            self._write_status_file(time.monotonic())
        else:
            self._stop(effect)

    def _write_status_file(self, now: float, due_only: bool = True) -> None:
        """Writes the pending status to status.json unless it differs from the file's only in its last commit
        and the file is younger than STATUS_FILE_EVERY_S (module docstring); `due_only=False` writes it anyway."""
        status, written = self.status_pending, self.status_file
        if status is None:
            return
        news = written is None or replace(status, committed=written.committed) != written
        if news or not due_only or now - self.status_file_t >= STATUS_FILE_EVERY_S:
            write_status(self.status_path, status)
            self.status_file, self.status_file_t, self.status_pending = status, now, None

    def _publish(self, effect: PublishPlan) -> None:
        """The plan, then the generation number (the abort follows)."""
        plan = effect.plan
        self.plane.put(self.keys.plan(plan.generation), plan)
        self.plane.put(self.keys.generation(), Published(plan.generation))
        self.events.generation = plan.generation

    def _spawn(self, effect: Spawn) -> None:
        role = Role(effect.role)
        child = self.agent.spawn(effect.name, role, effect.rank)
        self.events.emit("process_spawned", proc=effect.name, pid=child.pid, role=role.value,
                         rank=effect.rank if role is Role.WORKER else None, node=getattr(child, "node", None))

    def _finalize(self, effect: Finalize) -> None:
        """Assembles the parts of a checkpoint into one, visible only once complete (deadpool/disk)."""
        from deadpool.disk import finalize  # torch: imported only by jobs with a disk tier

        start = time.monotonic()
        try:
            path = finalize(Path(self.config.persist_dir), effect.step, self.config.workers, None, self.config.keep)
        except Exception as error:  # a full disk, a part gone: the job goes on, the next checkpoint may succeed
            path, why = None, f"{type(error).__name__}: {error}"
        else:
            why = "parts of some ranks are missing"
        self.finalized[effect.step] = path is not None
        if path is None:
            self.events.emit("persist_failed", step=effect.step, reason=why)
            return
        now = time.monotonic()
        total_s = None if effect.ordered_t is None else now - effect.ordered_t
        self.events.emit("checkpoint_persisted", step=effect.step, path=str(path), nbytes=effect.nbytes,
                         write_s=effect.write_s, finalize_s=now - start, total_s=total_s,
                         gbps=effect.nbytes / effect.write_s / 1e9 if effect.nbytes and effect.write_s else None)

    def _stop(self, effect: Stop) -> None:
        if effect.how in (Ending.FAILED, Ending.TERMINATED):
            for name in self.agent.alive():  # first, so that no process sees the shutdown and adds its own error
                self.agent.fence(name)
        self.plane.put(self.keys.shutdown(), Shutdown(effect.how))
        self.agent.stop_all(grace_s=effect.grace_s)

