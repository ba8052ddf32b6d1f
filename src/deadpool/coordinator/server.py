"""The coordinator's one loop: gather exits, heartbeats and reports, call the policies, apply and log them.

    STEADY --a process fails, or is fenced as hung--> SETTLING (gather the failures that arrive together)
    SETTLING --window over: policy.plan_after_failures, publish plan g+1, abort g--> AWAIT_READY
    AWAIT_READY --every rank reported its intact steps: policy.choose_restore_step--> AWAIT_RESUMED
    AWAIT_RESUMED --every rank agreed and rejoined--> STEADY
    any recovery phase --another failure--> SETTLING (the new set is planned from the last steady plan)
    SETTLING --no spare left, a spare node awaited (policy.wait_for_spare)--> AWAIT_SPARE
    AWAIT_SPARE --a spare node's spares started, or --spare-wait is over--> decided again, as from SETTLING
    STEADY --a spare node's spares started: policy.plan_after_join, publish g+1--> AWAIT_READY

In STEADY the loop also checks that data-parallel replicas agree (policy.check_replicas), commits snapshots
(policy.commit_step), looks for hangs (policy.hang_verdict) and admits spare nodes that joined the running
job (a join in any other phase waits in the store until then).
A script error ends the job at once without a swap; a deadline missed, or a decision with no answer,
ends it with the earliest failure as its root cause. This module never imports torch: the store it is
given is any object with the TCPStore methods it calls.
"""

from __future__ import annotations

import enum
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from deadpool.config import JobConfig
from deadpool.coordinator.policy import (
    DIVERGENCE_CAUSES,
    FINISHED,
    NO_SPARE,
    SCRIPT_ERROR,
    SPARE_AWAITED,
    Divergence,
    Durable,
    Pulse,
    abandoned_steps,
    check_replicas,
    choose_restore_step,
    classify_exit,
    commit_step,
    extend_pool,
    hang_timeout,
    hang_verdict,
    initial_plan,
    lost_by_node,
    node_map,
    node_spares,
    plan_after_failures,
    plan_after_join,
    wait_for_spare,
)
from deadpool.coordinator.protocol import Keys, Plan
from deadpool.events import EventLog


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


class Phase(enum.Enum):
    STEADY = "steady"
    SETTLING = "settling"
    AWAIT_READY = "await_ready"
    AWAIT_RESUMED = "await_resumed"
    AWAIT_SPARE = "await_spare"


@dataclass
class _Swap:
    """The recovery in flight, from its first failure to the generation that completes it."""

    detected_t: float
    cause: str
    failed: list[dict[str, Any]] = field(default_factory=list)  # one entry per lost process
    hang: dict[str, Any] | None = None                         # the verdict, when a hang started it


@dataclass
class _Joining:
    """A spare node that joined the running job, while its spares start."""

    host: str
    procs: dict[str, int]  # its spares -> their placeholder ranks
    deadline: float        # by when they must have started (--connect-timeout)


@dataclass
class _Refill:
    """Spare nodes entering the pool, from their spares' start to the generation that places replicas on them."""

    t: float
    nodes: list[int]
    procs: list[str]


@dataclass
class _Liveness:
    """The coordinator's view of one rank's heartbeat, on its own clock."""

    raw: str = ""        # the last heartbeat read: any change (the beat counter moves) is a sign of life
    beat_t: float = 0.0
    progress: tuple[int, str, int] = (-1, "", 0)  # step, phase, marks: any change is progress
    progress_t: float = 0.0
    pulse: dict[str, Any] = field(default_factory=dict)


class Coordinator:
    def __init__(self, config: JobConfig, store: Any, events: EventLog, agent: Processes) -> None:
        self.config = config
        self.store = store
        self.keys = Keys(config.token)
        self.events = events
        self.agent = agent
        spares = tuple(f"s{i}" for i in range(config.spares))
        self.steady = initial_plan(config.workers, spares, replicate=config.snapshot_every != 0,
                                   replicas=config.replicas, nodes=node_map(config.workers, config.spares,
                                                                            config.nproc_per_node))
        self.plan = self.steady           # the newest published plan (== steady unless recovering)
        self.phase = Phase.STEADY
        self.deadline = float("inf")
        self.lost: set[str] = set()       # processes lost since the steady plan
        self.fenced: set[str] = set()
        self.finished: set[str] = set()
        self.committed: int | None = None
        self.abandoned: list[int] = []
        self.agreed: int | None = None    # the newest step whose replicas were checked equal
        self.warned = -1                  # the generation in which a divergence was last reported
        self.swap: _Swap | None = None
        self.root_cause: str | None = None
        self.live: dict[str, _Liveness] = {}
        self.announced = 0.0  # the hang timeout last written to the events
        self.joining: dict[int, _Joining] = {}  # spare nodes that joined, whose spares are starting
        self.refill: _Refill | None = None      # spares entering the pool in the generation being published
        self.awaiting_since: float | None = None  # when the coordinator began to wait for a spare node

    def run(self) -> int:
        """Starts the job and returns its exit code."""
        for name in (*self.plan.ranks, *self.plan.spares):
            self.store.set(self.keys.heartbeat(name), "")
        self._publish(self.plan)
        for rank, name in enumerate(self.plan.ranks):
            child = self.agent.spawn(name, "worker", rank)
            self.events.emit("process_spawned", proc=name, pid=child.pid, role="worker", rank=rank,
                             node=getattr(child, "node", None))
        for i, name in enumerate(self.plan.spares):
            child = self.agent.spawn(name, "spare", self.plan.world_size + i)
            self.events.emit("process_spawned", proc=name, pid=child.pid, role="spare", rank=None,
                             node=getattr(child, "node", None))
        while True:
            for child in self.agent.poll():
                outcome = self._on_exit(child)
                if outcome is not None:
                    return outcome
            outcome = self._tick()
            if outcome is not None:
                return outcome
            time.sleep(self.config.poll_interval_s)

    # ---- inputs -----------------------------------------------------------------------------

    def _on_exit(self, child: Exit) -> int | None:
        code, name = child.returncode, child.name
        assert code is not None
        error_key = self.keys.script_error(name)
        script_error = json.loads(self.store.get(error_key)) if self.store.check([error_key]) else None
        verdict = classify_exit(code, fenced=name in self.fenced, started=self.store.check([self.keys.started(name)]),
                                script_error=script_error and script_error["error"],
                                lost_with_node=getattr(child, "lost_with_node", None))
        rank = self.plan.rank_of(name)
        joining = next((node for node, j in self.joining.items() if name in j.procs), None)
        if joining is not None:  # before it entered the pool: the pool stays as it is
            self._drop_joining(joining, f"{name} {verdict.reason}")
            return None
        if verdict.value == FINISHED:
            if rank is not None:
                self.finished.add(name)
                return self._end() if self.finished >= set(self.plan.ranks) else None
            return None
        if verdict.value == SCRIPT_ERROR:
            return self._script_error(child, verdict.reason, script_error)
        if name in self.lost or (rank is None and name not in self.plan.spares and name not in self.steady.spares):
            return None  # already replaced: its exit changes nothing
        who = f"rank {rank} ({name}, pid {child.pid})" if rank is not None else f"spare {name} (pid {child.pid})"
        self.events.emit("failure_detected", proc=name, failed_rank=rank, exit=verdict.reason, returncode=code,
                         during=self.phase.value)
        self._say(f"{who} {verdict.reason}")
        self.root_cause = self.root_cause or f"{who} {verdict.reason}"
        if self.swap is None:
            self.swap = _Swap(detected_t=time.monotonic(), cause=f"{who} {verdict.reason}")
        self.swap.failed.append({"proc": name, "rank": rank, "exit": verdict.reason, "who": who})
        self.lost.add(name)
        if self.phase is not Phase.SETTLING:
            self.phase, self.deadline = Phase.SETTLING, time.monotonic() + self.config.settle_s
        return None

    def _tick(self) -> int | None:
        if self.phase is Phase.STEADY:
            outcome = self._commit()
            self._look_for_hangs()
            if outcome is None and self.swap is None and not self.finished:
                self._refill(self._admit())
            return outcome
        if self.phase is Phase.AWAIT_SPARE:
            return self._await_spare()
        if self.phase is Phase.SETTLING:
            return self._decide() if time.monotonic() >= self.deadline else None
        gen, world = self.plan.generation, range(self.plan.world_size)
        key = self.keys.ready if self.phase is Phase.AWAIT_READY else self.keys.resumed
        missing = [r for r in world if not self.store.check([key(gen, r)])]
        if missing:
            if time.monotonic() > self.deadline:
                what = "report their snapshots" if self.phase is Phase.AWAIT_READY else "rejoin"
                return self._fail(f"ranks {missing} did not {what} within {self.config.recovery_timeout_s} s "
                                  f"of generation {gen}")
            return None
        if self.phase is Phase.AWAIT_READY:
            return self._choose_target()
        self._complete()
        return None

    # ---- steady state -----------------------------------------------------------------------

    def _commit(self) -> int | None:
        """Checks that data-parallel replicas agree, then commits the newest step every rank holds durably;
        the one writer of g{gen}/committed. A step is checked before it can be committed."""
        gen = self.plan.generation
        raw = self.store.multi_get([self.keys.durable(gen, r) for r in range(self.plan.world_size)])
        reports = {r: Durable.from_json(json.loads(v)) for r, v in enumerate(raw)}
        check = check_replicas(self.agreed, reports)
        self.agreed = check.agreed
        if check.divergence is not None:
            outcome = self._diverged(check.divergence, check.reason)
            if outcome is not None:
                return outcome
        decision = commit_step(self.committed, reports)
        committed = decision.value if decision.ok else self.committed
        abandoned = abandoned_steps(committed, reports)
        if committed == self.committed and abandoned == self.abandoned:
            return None
        self.committed, self.abandoned = committed, abandoned
        self._write_committed(gen)
        if decision.ok:
            self.events.emit("commit", step=committed, reason=decision.reason)
        return None

    def _diverged(self, divergence: Divergence, reason: str) -> int | None:
        """Replicas that must be identical are not: the run is no longer the one the user started."""
        self.events.emit("divergence", step=divergence.step, groups=[list(g) for g in divergence.groups],
                         agreed=divergence.agreed, action=self.config.on_divergence)
        self.agreed = divergence.step  # then go on checking the next steps
        if self.config.on_divergence == "warn":
            if self.warned != self.plan.generation:  # said once per generation; every step is in the events
                self.warned = self.plan.generation
                self._say(f"warning: replicas diverged {reason}. Usual causes: {DIVERGENCE_CAUSES}. "
                          "Going on (--on-divergence warn).", stream=sys.stderr)
            return None
        self.root_cause = None
        return self._fail(f"replicas diverged {reason}. Data-parallel replicas must stay bit-identical; these no "
                          f"longer are, so the run is not the one you started. Usual causes: {DIVERGENCE_CAUSES}. "
                          "Fix the script (or pass --on-divergence warn to go on anyway).")

    def _write_committed(self, gen: int) -> None:
        self.store.set(self.keys.committed(gen), json.dumps({"step": self.committed, "abandoned": self.abandoned}))

    def _look_for_hangs(self) -> None:
        """Reads every rank's heartbeat; fences the ranks the policy calls hung (their exit follows)."""
        now, gen = time.monotonic(), self.plan.generation
        procs = [p for p in self.plan.ranks if p not in self.fenced]
        pulses: dict[int, Pulse] = {}
        for proc, raw in zip(procs, self.store.multi_get([self.keys.heartbeat(p) for p in procs])):
            seen = self.live.setdefault(proc, _Liveness(beat_t=now, progress_t=now))
            text = raw.decode() if isinstance(raw, bytes) else raw
            if text and text != seen.raw:
                pulse = json.loads(text)
                seen.raw, seen.pulse = text, pulse
                if pulse["gen"] == gen:
                    seen.beat_t = now
                    progress = (pulse["step"], pulse["phase"], pulse["marks"])
                    if progress != seen.progress:
                        seen.progress, seen.progress_t = progress, now
            if seen.pulse.get("gen") == gen:
                pulses[self.plan.ranks.index(proc)] = Pulse(seen.beat_t, seen.progress_t, seen.pulse["step"],
                                                            seen.pulse["phase"], seen.pulse["waiting"])
        if len(pulses) < len(procs):
            return  # detection starts once every rank of this generation has a heartbeat
        timeout = hang_timeout(self.config.hang_timeout_s,
                               [s.pulse["step_s"] for s in self.live.values() if s.pulse.get("step_s")])
        if abs((timeout.value or 0) - self.announced) > 0.2 * self.announced:  # say so when it moves by > 20 %
            self.announced = timeout.value or 0
            self.events.emit("hang_timeout", timeout_s=timeout.value, reason=timeout.reason)
        verdict = hang_verdict(now, pulses, timeout.value or float("inf"))
        if not verdict.ok:
            return
        for rank in sorted(verdict.value or ()):
            proc, pulse = self.plan.ranks[rank], pulses[rank]
            last = min(pulse.beat_t, pulse.progress_t)
            self.events.emit("hang_detected", proc=proc, hung_rank=rank, step=pulse.step, phase=pulse.phase,
                             last_progress_t=last, silent_s=now - last, timeout_s=timeout.value,
                             reason=verdict.reason)
            self._say(f"rank {rank} ({proc}) is hung: {verdict.reason}; fencing it (SIGKILL)")
            self.fenced.add(proc)
            if self.swap is None:
                self.swap = _Swap(detected_t=now, cause=f"rank {rank} ({proc}) hung: {verdict.reason}",
                                  hang={"rank": rank, "proc": proc, "last_progress_t": last, "verdict_t": now})
            self.root_cause = self.root_cause or self.swap.cause
            self.agent.fence(proc)

    # ---- recovery ---------------------------------------------------------------------------

    def _decide(self) -> int | None:
        ranks_lost = self.swap is not None and any(f["rank"] is not None for f in self.swap.failed)
        if self.finished and ranks_lost:  # the ranks that finished have left: no group is left to recover into
            lost = ", ".join(f"{f['who']} {f['exit']}" for f in self.swap.failed) if self.swap else "a process"
            done = sorted(r for r, p in enumerate(self.plan.ranks) if p in self.finished)
            return self._fail(f"{lost} after ranks {done} had "
                              f"finished training; the run is complete on those ranks, not on the failed one. "
                              f"Last committed step: {self.committed}.")
        decision = plan_after_failures(self.steady, self.plan.generation, frozenset(self.lost))
        if not decision.ok or decision.value is None:
            waited = 0.0 if self.awaiting_since is None else time.monotonic() - self.awaiting_since
            wait = wait_for_spare(self.steady, frozenset(self.lost), waited, self.config.spare_wait_s)
            if wait.value == SPARE_AWAITED:
                self._begin_spare_wait(wait.reason)
                return None
            if wait.value == NO_SPARE and self.config.nproc_per_node:
                return self._no_spare(wait.reason, waited)
            lost = "; ".join(f"{f['who']} {f['exit']}" for f in self.swap.failed) if self.swap else ""
            pool_empty = all(s in self.lost for s in self.steady.spares)
            advice = " Add spares (--spares) to survive more failures." if pool_empty else ""
            return self._fail(f"{lost}: {decision.reason}. Last committed step: {self.committed}.{advice}")
        plan, self.awaiting_since = decision.value, None
        if plan.generation == self.plan.generation:  # a lost spare that held nothing: nobody rolls back
            self.steady = self.plan = plan
            self.swap, self.root_cause, self.lost = None, None, set()
            self.phase, self.deadline = Phase.STEADY, float("inf")
            self.events.emit("pool_shrunk", spares=list(plan.spares), reason=decision.reason)
            return None
        self._publish(plan)
        self.phase, self.deadline = Phase.AWAIT_READY, time.monotonic() + self.config.recovery_timeout_s
        return None

    def _choose_target(self) -> int | None:
        gen, world = self.plan.generation, range(self.plan.world_size)
        holdings = {r: json.loads(self.store.get(self.keys.ready(gen, r))) for r in world}
        decision = choose_restore_step(self.committed, holdings)
        self.events.emit("restore_decided", target=decision.value, reason=decision.reason, holdings=holdings)
        if not decision.ok:
            return self._fail(f"cannot recover from memory: {decision.reason}")
        self.committed, self.abandoned = decision.value, []
        self.agreed = decision.value  # the replayed steps are checked again
        self._write_committed(gen)
        self.store.set(self.keys.target(gen), str(decision.value))
        self.phase, self.deadline = Phase.AWAIT_RESUMED, time.monotonic() + self.config.recovery_timeout_s
        return None

    def _complete(self) -> None:
        swap, refill, self.swap, self.refill = self.swap, self.refill, None, None
        assert swap is not None or refill is not None
        if swap is not None:
            self._swapped(swap)
        if refill is not None:
            took = time.monotonic() - refill.t
            self.events.emit("pool_refilled", nodes=refill.nodes, procs=refill.procs, spares=list(self.plan.spares),
                             holders=[list(h) for h in self.plan.holders], restored_step=self.committed, took_s=took)
            self._say(f"generation {self.plan.generation} running: spare node(s) {refill.nodes} joined the pool "
                      f"({', '.join(refill.procs)}); idle spares now: {', '.join(self.plan.spares) or 'none'}")
        self.steady, self.lost, self.live = self.plan, set(), {}
        self.store.set(self.keys.running(self.plan.generation), "1")
        self.phase, self.deadline = Phase.STEADY, float("inf")
        self.root_cause = None  # recovered: a later failure is its own root cause

    def _swapped(self, swap: _Swap) -> None:
        gen, target = self.plan.generation, self.committed
        replaced = {r: p for r, p in enumerate(self.plan.ranks) if p != self.steady.ranks[r]}
        took = time.monotonic() - swap.detected_t
        cause = swap.cause if len(swap.failed) < 2 else "; ".join(f"{f['who']} {f['exit']}" for f in swap.failed)
        self.events.emit("swap_complete", restored_step=target, replaced=replaced, cause=cause,
                         failed=swap.failed, hang=swap.hang, detected_t=swap.detected_t, detect_to_resume_s=took)
        self._say(f"generation {gen} running: restored step {target}; "
                  + ", ".join(f"{s} is now rank {r}" for r, s in replaced.items())
                  + f" ({took:.2f} s after detection)")

    # ---- the pool over time -----------------------------------------------------------------

    def _admit(self) -> dict[str, int]:
        """Orders the spares of spare nodes that joined the running job; returns those (process -> node) of
        the nodes whose spares have all started, which may now enter the pool."""
        now = time.monotonic()
        for node, host in self.agent.joined().items():
            procs = node_spares(node, self.config.workers, self.config.nproc_per_node)
            self.joining[node] = _Joining(host, procs, now + self.config.connect_timeout_s)
            self.events.emit("spare_node_joined", node=node, host=host, procs=list(procs))
            self._say(f"spare node {node} ({host}) joined the job; starting {', '.join(procs)}")
            for name, rank in procs.items():
                self.store.set(self.keys.heartbeat(name), "")
                child = self.agent.spawn(name, "spare", rank)
                self.events.emit("process_spawned", proc=name, pid=child.pid, role="spare", rank=None, node=node)
        ready: dict[str, int] = {}
        for node, joining in list(self.joining.items()):
            if self.store.check([self.keys.started(name) for name in joining.procs]):
                ready.update(dict.fromkeys(joining.procs, node))
                del self.joining[node]
            elif now > joining.deadline:
                self._drop_joining(node, f"its spares did not start within {self.config.connect_timeout_s:g} s")
        return ready

    def _drop_joining(self, node: int, why: str) -> None:
        """A spare node that joined but cannot enter the pool: its other spares are fenced."""
        joining = self.joining.pop(node)
        for name in joining.procs:
            self.agent.fence(name)
        self.events.emit("spare_node_dropped", node=node, procs=list(joining.procs), reason=why)
        self._say(f"spare node {node} ({joining.host}) does not enter the pool: {why}")

    def _refill(self, new: dict[str, int]) -> None:
        """Spares that started on nodes that joined enter the pool; placing replicas on them takes a new
        generation (everyone restores the last commit), published as after a lost holder."""
        if not new:
            return
        decision = plan_after_join(self.steady, self.plan.generation, new)
        assert decision.value is not None  # there are new spares: there is a plan
        self.steady = extend_pool(self.steady, new)  # a failure during the new generation's recovery may use them
        nodes = sorted(set(new.values()))
        if decision.value.generation == self.plan.generation:  # nothing to place (snapshots off): nobody rolls back
            self.steady = self.plan = decision.value
            self.events.emit("pool_refilled", nodes=nodes, procs=list(new), spares=list(self.plan.spares),
                             holders=[list(h) for h in self.plan.holders], restored_step=None, took_s=0.0)
            return
        self.refill = _Refill(time.monotonic(), nodes, list(new))
        self._publish(decision.value)
        self.phase, self.deadline = Phase.AWAIT_READY, time.monotonic() + self.config.recovery_timeout_s

    def _await_spare(self) -> int | None:
        """No spare is left for a lost rank: spare nodes that join are admitted at once, and the failures are
        decided again as soon as their spares have started, or when --spare-wait is over."""
        new = self._admit()
        if new:
            self.steady = extend_pool(self.steady, new)
            self.refill = _Refill(time.monotonic(), sorted(set(new.values())), list(new))
            return self._decide()
        return self._decide() if time.monotonic() >= self.deadline else None

    def _begin_spare_wait(self, reason: str) -> None:
        """Says once what is awaited and how to provide it; the deadline runs from the first failure it
        could not place."""
        if self.awaiting_since is None:
            self.awaiting_since = time.monotonic()
            by_node = lost_by_node(self.steady, frozenset(self.lost))
            self.events.emit("spare_awaited", nodes=list(by_node), ranks=sorted(r for g in by_node.values() for r in g),
                             committed=self.committed, spare_wait_s=self.config.spare_wait_s, reason=reason)
            self._say(f"{reason}: start `deadpool agent --coordinator {self._address()} --spare` on a healthy "
                      "machine")
        self.phase, self.deadline = Phase.AWAIT_SPARE, self.awaiting_since + self.config.spare_wait_s

    def _no_spare(self, reason: str, waited_s: float) -> int:
        """A lost rank has no spare to go to and none came: the job stops, naming what was lost and what
        would have kept it going."""
        by_node = lost_by_node(self.steady, frozenset(self.lost))
        self.events.emit("no_spare", nodes=list(by_node), ranks=sorted(r for g in by_node.values() for r in g),
                         committed=self.committed, waited_s=waited_s, spare_wait_s=self.config.spare_wait_s,
                         reason=reason)
        join = f"`deadpool agent --coordinator {self._address()} --spare`"
        advice = (f"start {join} on a healthy machine within --spare-wait" if self.config.spare_wait_s else
                  f"pass --spare-wait SECONDS and start {join} on a healthy machine when a node is lost")
        return self._fail(f"{reason}. Last committed step: {self.committed}. To go on from a lost node, {advice}, "
                          "or run with more --spare-nodes.")

    def _address(self) -> str:
        return f"{self.config.store_host}:{self.config.store_port}"

    # ---- effects ----------------------------------------------------------------------------

    def _publish(self, plan: Plan) -> None:
        """Reports and commit keys first, then the plan, the generation number, and the abort of the old
        one: whoever sees the abort can always read the plan that replaces it."""
        gen = plan.generation
        for rank in range(plan.world_size):
            self.store.set(self.keys.durable(gen, rank), json.dumps({"steps": [], "skipped": []}))
        if gen == 0:
            self._write_committed(gen)
        self.plan = plan
        self.store.set(self.keys.plan(gen), plan.to_json())
        self.store.set(self.keys.generation(), str(gen))
        self.events.generation = gen
        if gen > 0:
            self.store.set(self.keys.abort(gen - 1), plan.reason)
            self._say(f"generation {gen}: {plan.reason}")
        for rank, name in enumerate(plan.ranks):
            if name.startswith("s"):
                self.agent.relabel(name, f"{name}=r{rank}")
        self.events.emit("plan_published", ranks=list(plan.ranks), holders=[list(h) for h in plan.holders],
                         spares=list(plan.spares), sources=list(plan.sources), reason=plan.reason)

    def _end(self) -> int:
        self.store.set(self.keys.shutdown(), "done")
        self.agent.stop_all(grace_s=10.0)
        self.events.emit("job_finished", generation=self.plan.generation)
        return 0

    def _script_error(self, child: Exit, reason: str, report: dict[str, Any] | None) -> int:
        """A bug in the script: replaying it on a spare would raise it again, so the job stops here."""
        where = child.name
        if report and report["rank"] is not None:
            where = f"rank {report['rank']} ({child.name}) at step {report['step']}"
        message = (f"error in the training script on {where}: {reason.removeprefix('the training script ')}. "
                   "This is a bug in the script, not a node failure, so no spare was used; the traceback is "
                   f"above (and in logs/{child.name}.log). Fix the script and run again.")
        self.events.emit("script_error", proc=child.name, rank=report and report["rank"],
                         step=report and report["step"], error=reason)
        self.root_cause = None
        return self._fail(message)

    def _fail(self, message: str) -> int:
        cause = self.root_cause or message
        self.events.emit("job_failed", reason=message, root_cause=cause)
        for name in self.agent.alive():  # first, so that no process sees the shutdown and adds its own error
            self.agent.fence(name)
        self.store.set(self.keys.shutdown(), "failed")
        self.agent.stop_all(grace_s=5.0)
        self._say(f"job failed: {message}", stream=sys.stderr)
        if cause != message:
            self._say(f"root cause: {cause}", stream=sys.stderr)
        return 1

    def _say(self, text: str, stream: TextIO = sys.stdout) -> None:
        print(f"[coordinator] {text}", file=stream, flush=True)
