"""The coordinator's one loop: gather exits and reports, call the policies, apply and log their decisions.

    STEADY --a rank's process exits--> decide (policy.plan_after_failure) --publish plan g+1-->
    AWAIT_READY --all ranks report intact steps--> choose target (policy.choose_restore_step) -->
    AWAIT_RESUMED --all ranks agreed and rejoined--> STEADY

A failure while recovering starts the next generation at once; a deadline missed, or a decision
with no answer, ends the job with the earliest failure as its root cause.
"""

from __future__ import annotations

import enum
import json
import sys
import time
from dataclasses import dataclass, field

from deadpool.config import JobConfig
from deadpool.coordinator.policy import choose_restore_step, describe_exit, initial_plan, plan_after_failure
from deadpool.coordinator.protocol import Keys, Plan
from deadpool.events import EventLog
from deadpool.launcher.agent import Agent, Child


class Phase(enum.Enum):
    STEADY = "steady"
    AWAIT_READY = "await_ready"
    AWAIT_RESUMED = "await_resumed"


@dataclass
class _Swap:
    """The recovery in flight, for its event and its printed line."""

    cause: str
    detected_t: float
    replaced: dict[int, str] = field(default_factory=dict)  # rank -> spare


class Coordinator:
    def __init__(self, config: JobConfig, store: object, events: EventLog, agent: Agent) -> None:
        self.config = config
        self.store = store
        self.keys = Keys(config.token)
        self.events = events
        self.agent = agent
        spares = tuple(f"s{i}" for i in range(config.spares))
        self.plan = initial_plan(config.workers, spares, replicate=config.snapshot_every != 0)
        self.phase = Phase.STEADY
        self.deadline = float("inf")
        self.finished: set[str] = set()
        self.swap: _Swap | None = None
        self.root_cause: str | None = None

    def run(self) -> int:
        """Starts the job and returns its exit code."""
        self._publish(self.plan)
        for rank, name in enumerate(self.plan.ranks):
            child = self.agent.spawn(name, "worker")
            self.events.emit("process_spawned", proc=name, pid=child.pid, role="worker", rank=rank)
        for name in self.plan.spares:
            child = self.agent.spawn(name, "spare")
            self.events.emit("process_spawned", proc=name, pid=child.pid, role="spare", rank=None)
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

    def _on_exit(self, child: Child) -> int | None:
        code = child.returncode
        rank = self.plan.rank_of(child.name)
        if rank is not None and code == 0:
            self.finished.add(child.name)
            return self._end() if self.finished >= set(self.plan.ranks) else None
        if rank is None and child.name not in self.plan.spares:
            return None  # already replaced: its exit changes nothing
        how = describe_exit(code)
        who = f"rank {rank} ({child.name}, pid {child.pid})" if rank is not None else f"spare {child.name} (pid {child.pid})"
        self.events.emit("failure_detected", proc=child.name, failed_rank=rank, exit=how, returncode=code)
        self._say(f"{who} {how}")
        self.root_cause = self.root_cause or f"{who} {how}"
        if self.swap is None:
            self.swap = _Swap(cause=f"{who} {how}", detected_t=time.monotonic())
        decision = plan_after_failure(self.plan, child.name, self.agent.alive())
        if not decision.ok:
            return self._fail(f"{who} {how}; {decision.reason}. Last committed step: {self._committed()}. "
                              "Add spares (--spares) to survive more failures.")
        if rank is not None:
            self.swap.replaced[rank] = decision.value.ranks[rank]
        if decision.value.generation == self.plan.generation:  # a spare that held nothing: no one rolls back
            self.plan, self.swap, self.root_cause = decision.value, None, None
            self.events.emit("pool_shrunk", spares=list(self.plan.spares), reason=decision.reason)
            return None
        self._publish(decision.value)
        return None

    def _tick(self) -> int | None:
        """Advances a recovery when every rank has reported, or fails it at its deadline."""
        if self.phase is Phase.STEADY:
            return None
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
            holdings = {r: json.loads(self.store.get(self.keys.ready(gen, r))) for r in world}
            decision = choose_restore_step(self._committed(), holdings)
            self.events.emit("restore_decided", target=decision.value, reason=decision.reason, holdings=holdings)
            if not decision.ok:
                return self._fail(f"cannot recover from memory: {decision.reason}")
            self.store.set(self.keys.committed(), json.dumps({"step": decision.value, "gen": gen}))
            self.store.set(self.keys.target(gen), str(decision.value))
            self.phase, self.deadline = Phase.AWAIT_RESUMED, time.monotonic() + self.config.recovery_timeout_s
            return None
        swap, self.swap = self.swap, None
        target = int(self.store.get(self.keys.target(gen)))
        took = time.monotonic() - swap.detected_t
        self.events.emit("swap_complete", restored_step=target, replaced=swap.replaced, cause=swap.cause,
                         detect_to_resume_s=took)
        self._say(f"generation {gen} running: restored step {target}; "
                  + ", ".join(f"{s} is now rank {r}" for r, s in swap.replaced.items())
                  + f" ({took:.2f} s after detection)")
        self.phase, self.deadline = Phase.STEADY, float("inf")
        self.root_cause = None  # recovered: a later failure is its own root cause
        return None

    # ---- effects ----------------------------------------------------------------------------

    def _publish(self, plan: Plan) -> None:
        """Plan first, then the generation number, then the abort of the old one: whoever sees the
        abort can always read the plan that replaces it."""
        self.plan = plan
        self.store.set(self.keys.plan(plan.generation), plan.to_json())
        self.store.set(self.keys.generation(), str(plan.generation))
        self.events.generation = plan.generation
        if plan.generation > 0:
            self.store.set(self.keys.abort(plan.generation - 1), plan.reason)
            self.phase, self.deadline = Phase.AWAIT_READY, time.monotonic() + self.config.recovery_timeout_s
            self._say(f"generation {plan.generation}: {plan.reason}")
        for rank, name in enumerate(plan.ranks):
            if name in self.agent.children and name.startswith("s"):
                self.agent.children[name].label = f"{name}=r{rank}"
        self.events.emit("plan_published", ranks=list(plan.ranks), holders=[list(h) for h in plan.holders],
                         spares=list(plan.spares), reason=plan.reason)

    def _committed(self) -> int:
        key = self.keys.committed()
        return json.loads(self.store.get(key))["step"] if self.store.check([key]) else -1

    def _end(self) -> int:
        self.store.set(self.keys.shutdown(), "done")
        self.agent.stop_all(grace_s=10.0)
        self.events.emit("job_finished", generation=self.plan.generation)
        return 0

    def _fail(self, message: str) -> int:
        cause = self.root_cause or message
        self.events.emit("job_failed", reason=message, root_cause=cause)
        self.store.set(self.keys.shutdown(), "failed")
        for name in self.agent.alive():
            self.agent.fence(name)
        self.agent.stop_all(grace_s=5.0)
        self._say(f"job failed: {message}", stream=sys.stderr)
        if cause != message:
            self._say(f"root cause: {cause}", stream=sys.stderr)
        return 1

    def _say(self, text: str, stream=sys.stdout) -> None:
        print(f"[coordinator] {text}", file=stream, flush=True)
