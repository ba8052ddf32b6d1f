"""The coordinator's shell: reads each tick's inputs from the processes and the store, calls machine.advance
with the clock, and applies the effects it returns, in order. Every decision is in machine.py (pure, its
state diagram there); this is the only coordinator module that does I/O. It imports torch only with a disk
tier (deadpool.disk assembles checkpoints); the store it is given is any object with the TCPStore methods it calls.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from deadpool.config import JobConfig
from deadpool.coordinator.machine import advance, start
from deadpool.coordinator.policy import Durable
from deadpool.coordinator.protocol import Keys
from deadpool.coordinator.state import (
    Abort,
    CoordinatorState,
    Effect,
    Emit,
    ExitReport,
    Fence,
    Finalize,
    Heartbeat,
    Inputs,
    MarkRunning,
    OrderPersist,
    Phase,
    PublishPlan,
    PublishStatus,
    Relabel,
    Say,
    ScriptError,
    Spawn,
    Stop,
    WriteCommit,
    WriteTarget,
)
from deadpool.coordinator.status import write_status
from deadpool.errors import ProtocolError
from deadpool.events import EventLog
from deadpool.protocol.records import PersistReport


class Exit(Protocol):
    """A process that ended: launcher.agent.Child, or coordinator.nodes.Exited (which may say its node was lost)."""

    name: str
    returncode: int | None
    pid: int | None


class Processes(Protocol):
    """Who starts, watches and fences the job's processes: the launcher itself (launcher/agent.py) or one
    agent per node through the store (coordinator/nodes.py)."""

    def spawn(self, name: str, role: str, rank: int) -> Any: ...
    def poll(self) -> list[Any]: ...
    def fence(self, name: str) -> None: ...
    def alive(self) -> set[str]: ...
    def relabel(self, name: str, label: str) -> None: ...
    def stop_all(self, grace_s: float) -> None: ...
    def joined(self) -> dict[int, str]: ...


class Coordinator:
    def __init__(self, config: JobConfig, store: Any, events: EventLog, agent: Processes) -> None:
        self.config = config
        self.store = store
        self.keys = Keys(config.token)
        self.events = events
        self.agent = agent
        self.status_path = Path(config.run_dir) / "status.json"
        self.terminate = False  # set by the launcher's SIGTERM handler: the machine persists, then stops
        self.finalized: dict[int, bool] = {}  # checkpoints assembled since the last tick
        if config.persist_dir:  # torch's checkpoint modules take seconds to import: now, not at the first SIGTERM
            threading.Thread(target=importlib.import_module, args=("deadpool.disk",), name="deadpool-import",
                             daemon=True).start()

    def request_stop(self) -> None:
        """SIGTERM: the next tick persists the newest commit and stops the job (machine._stopping)."""
        self.terminate = True

    def run(self) -> int:
        """Starts the job and returns its exit code."""
        state, effects = start(self.config)
        while True:
            for effect in effects:
                self._apply(effect)
            if state.exit_code is not None:
                return state.exit_code
            time.sleep(self.config.poll_interval_s)
            inputs = self._gather(state)
            self.finalized = {}
            state, effects = advance(state, inputs, time.monotonic())

    # ---- inputs -----------------------------------------------------------------------------

    def _gather(self, state: CoordinatorState) -> Inputs:
        """Exits and joins always; the reports the state's phase waits for."""
        exits = tuple(self._exit(child) for child in self.agent.poll())
        starting = [name for joining in state.joining.values() for name in joining.procs]
        started = frozenset(name for name in starting if self.store.check([self.keys.started(name)]))
        return Inputs(exits=exits, joined=self.agent.joined(), started=started, terminate=self.terminate,
                      persist_reports=self._persist_reports(state), finalized=dict(self.finalized),
                      alive=self._alive(state), **self._reports(state))

    def _alive(self, state: CoordinatorState) -> dict[str, int]:
        """Every planned process's beacon count (runtime/watch.Beacon), but those known to be gone."""
        gone = state.fenced | state.lost | state.finished
        procs = [p for p in (*state.plan.ranks, *state.plan.spares) if p not in gone]
        return {p: int(raw) for p, raw in zip(procs, self.store.multi_get([self.keys.alive(p) for p in procs]))}

    def _persist_reports(self, state: CoordinatorState) -> dict[str, PersistReport]:
        """The writers' reports on the checkpoint being written; a malformed one counts as a failed part."""
        job = state.persisting
        if job is None or job.finalizing:
            return {}
        reports = {}
        for proc in dict.fromkeys(job.writers):
            key = self.keys.persisted(job.step, proc)
            if self.store.check([key]):
                try:
                    reports[proc] = PersistReport.from_json(self.store.get(key))
                except ProtocolError as error:
                    reports[proc] = PersistReport(job.step, proc, (), ok=False, error=str(error))
        return reports

    def _reports(self, state: CoordinatorState) -> dict[str, Any]:
        gen, world, keys = state.plan.generation, range(state.plan.world_size), self.keys
        if state.phase is Phase.STEADY:
            durable = self.store.multi_get([keys.durable(gen, r) for r in world])
            procs = [p for p in state.plan.ranks if p not in state.fenced]
            beats = self.store.multi_get([keys.heartbeat(p) for p in procs])
            return {"durable": {r: Durable.from_json(json.loads(raw)) for r, raw in enumerate(durable)},
                    "beats": {p: Heartbeat.from_json(raw) for p, raw in zip(procs, beats) if raw}}
        if state.phase is Phase.AWAIT_READY:
            present = [r for r in world if self.store.check([keys.ready(gen, r)])]
            return {"ready": {r: json.loads(self.store.get(keys.ready(gen, r))) for r in present}}
        if state.phase is Phase.AWAIT_RESUMED:
            return {"resumed": frozenset(r for r in world if self.store.check([keys.resumed(gen, r)]))}
        return {}

    def _exit(self, child: Exit) -> ExitReport:
        """An exit, with whether the process reached deadpool.init() and the error its script reported."""
        assert child.returncode is not None
        error_key = self.keys.script_error(child.name)
        error = ScriptError.from_json(self.store.get(error_key)) if self.store.check([error_key]) else None
        return ExitReport(child.name, child.returncode, child.pid, started=self.store.check([self.keys.started(
            child.name)]), script_error=error, lost_with_node=getattr(child, "lost_with_node", None))

    # ---- effects ----------------------------------------------------------------------------

    def _apply(self, effect: Effect) -> None:
        store, keys = self.store, self.keys
        if isinstance(effect, PublishPlan):
            self._publish(effect)
        elif isinstance(effect, Abort):
            store.set(keys.abort(effect.gen), effect.reason)
        elif isinstance(effect, WriteCommit):
            record = {"step": effect.step, "abandoned": list(effect.abandoned)}
            store.set(keys.committed(effect.gen), json.dumps(record))
        elif isinstance(effect, WriteTarget):
            store.set(keys.target(effect.gen), json.dumps(effect.step))  # null: begin afresh
        elif isinstance(effect, MarkRunning):
            store.set(keys.running(effect.gen), "1")
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
            store.set(keys.persist_order(), effect.order.to_json())
        elif isinstance(effect, Finalize):
            self._finalize(effect)
        elif isinstance(effect, PublishStatus):
            text = effect.status.to_json()
            write_status(self.status_path, effect.status)
            store.set(keys.status(), text)
        else:
            self._stop(effect)

    def _publish(self, effect: PublishPlan) -> None:
        """Empty durable reports first, then the plan and the generation number (the abort follows)."""
        plan = effect.plan
        for rank in range(plan.world_size):
            self.store.set(self.keys.durable(plan.generation, rank), json.dumps({"steps": [], "skipped": []}))
        self.store.set(self.keys.plan(plan.generation), plan.to_json())
        self.store.set(self.keys.generation(), str(plan.generation))
        self.events.generation = plan.generation

    def _spawn(self, effect: Spawn) -> None:
        self.store.set(self.keys.heartbeat(effect.name), "")
        self.store.set(self.keys.alive(effect.name), "0")
        child = self.agent.spawn(effect.name, effect.role, effect.rank)
        self.events.emit("process_spawned", proc=effect.name, pid=child.pid, role=effect.role,
                         rank=effect.rank if effect.role == "worker" else None, node=getattr(child, "node", None))

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
                         gbps=effect.nbytes / effect.write_s / 1e9 if effect.write_s else None)

    def _stop(self, effect: Stop) -> None:
        if effect.how in ("failed", "terminated"):
            for name in self.agent.alive():  # first, so that no process sees the shutdown and adds its own error
                self.agent.fence(name)
        self.store.set(self.keys.shutdown(), effect.how)
        self.agent.stop_all(grace_s=effect.grace_s)

