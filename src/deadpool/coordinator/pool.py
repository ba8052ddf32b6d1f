"""What replaces lost processes, and the pool of spares over time: spare nodes that join, enter the pool, or are
awaited when none is left. Transitions of the coordinator's machine (machine.py), pure like it."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from deadpool.coordinator import persist
from deadpool.coordinator.policy import (
    NO_SPARE,
    SPARE_AWAITED,
    extend_pool,
    lost_by_node,
    node_spares,
    plan_after_failures,
    plan_after_join,
    wait_for_spare,
)
from deadpool.coordinator.state import CoordinatorState, Effect, Emit, Joining, Phase, Refill, Say, Spawn
from deadpool.coordinator.transitions import drop_joining, fail, finalize_last, publish
from deadpool.protocol.kinds import Phase as Progress
from deadpool.protocol.kinds import Role

State = CoordinatorState


def decide(s: State, now: float, out: list[Effect]) -> State:
    """The settled set of failures: a plan that replaces them (published), a wait for a spare node, or the end."""
    failed = s.swap.failed if s.swap else ()
    done = done_training(s)
    if done and any(f.rank is not None for f in failed):
        return _failed_after_training(s, done, out)
    decision = plan_after_failures(s.steady, s.plan.generation, s.lost, disk_step=s.persisted)
    if decision.value is None:
        waited = 0.0 if s.awaiting_since is None else now - s.awaiting_since
        wait = wait_for_spare(s.steady, s.lost, waited, s.config.spare_wait_s)
        if wait.value == SPARE_AWAITED:
            return _begin_spare_wait(s, wait.reason, now, out)
        if wait.value == NO_SPARE and s.config.nproc_per_node:
            return _no_spare(s, wait.reason, waited, now, out)
        lost = "; ".join(f"{f.who} {f.exit}" for f in failed)
        pool_empty = all(p in s.lost for p in s.steady.spares)
        advice = " Add spares (--spares) to survive more failures." if pool_empty else ""
        message = f"{lost}: {decision.reason}. Last committed step: {s.committed}.{advice}"
        return _stop(s, message, now, out) if wait.value == NO_SPARE else fail(s, message, out)
    plan = decision.value
    s = replace(s, awaiting_since=None)
    if plan.generation == s.plan.generation:  # a lost spare that held nothing: nobody rolls back
        out.append(Emit("pool_shrunk", dict(spares=list(plan.spares), reason=decision.reason)))
        return replace(s, steady=plan, plan=plan, swap=None, root_cause=None, lost=frozenset(), phase=Phase.STEADY,
                       deadline=float("inf"))
    s = publish(s, plan, out)
    return replace(s, phase=Phase.AWAIT_READY, deadline=now + s.config.recovery_timeout_s)


def admit(s: State, started: frozenset[str], now: float, out: list[Effect]) -> tuple[State, dict[str, int]]:
    """Orders the spares of spare nodes that joined the running job; returns those (process -> node) of
    the nodes whose spares have all started, which may now enter the pool."""
    config, joining = s.config, dict(s.joining)
    for node, host in s.joins.items():
        procs = node_spares(node, config.workers, config.nproc_per_node)
        joining[node] = Joining(host, procs, now + config.connect_timeout_s)
        out += [Emit("spare_node_joined", dict(node=node, host=host, procs=list(procs))),
                Say(f"spare node {node} ({host}) joined the job; starting {', '.join(procs)}")]
        out += [Spawn(name, Role.SPARE, rank) for name, rank in procs.items()]
    s = replace(s, joins={}, joining=joining)
    ready: dict[str, int] = {}
    for node, entry in joining.items():
        if all(name in started for name in entry.procs):
            ready.update(dict.fromkeys(entry.procs, node))
            s = replace(s, joining={n: j for n, j in s.joining.items() if n != node})
        elif now > entry.deadline:
            s = drop_joining(s, node, f"its spares did not start within {config.connect_timeout_s:g} s", out)
    return s, ready


def refill(s: State, new: Mapping[str, int], now: float, out: list[Effect]) -> State:
    """Spares that started on nodes that joined enter the pool; placing replicas on them takes a new
    generation (everyone restores the last commit), published as after a lost holder."""
    if not new:
        return s
    decision = plan_after_join(s.steady, s.plan.generation, new)
    assert decision.value is not None  # there are new spares: there is a plan
    s = replace(s, steady=extend_pool(s.steady, new))  # a failure during the new generation's recovery may use them
    nodes = tuple(sorted(set(new.values())))
    plan = decision.value
    if plan.generation == s.plan.generation:  # nothing to place (snapshots off): nobody rolls back
        out.append(Emit("pool_refilled", dict(nodes=list(nodes), procs=list(new), spares=list(plan.spares),
                                              holders=[list(h) for h in plan.holders], restored_step=None,
                                              took_s=0.0)))
        return replace(s, steady=plan, plan=plan)
    s = publish(replace(s, refill=Refill(now, nodes, tuple(new))), plan, out)
    return replace(s, phase=Phase.AWAIT_READY, deadline=now + s.config.recovery_timeout_s)


def await_spare(s: State, started: frozenset[str], now: float, out: list[Effect]) -> State:
    """No spare is left for a lost rank: spare nodes that join are admitted at once, and the failures are
    decided again as soon as their spares have started, or when --spare-wait is over."""
    s, new = admit(s, started, now, out)
    if new:
        s = replace(s, steady=extend_pool(s.steady, new),
                    refill=Refill(now, tuple(sorted(set(new.values()))), tuple(new)))
        return decide(s, now, out)
    return decide(s, now, out) if now >= s.deadline else s


def done_training(s: State) -> list[int]:
    """The ranks that have left session.run(): exited with code 0, or said so in their last heartbeat (their
    last words, before the script's own code after run()). A rank leaves only once its last step is committed,
    which needs every rank's snapshot of it: from then on training is complete on every rank."""
    def left(proc: str) -> bool:
        seen = s.live.get(proc)
        return proc in s.finished or (seen is not None and seen.beat is not None
                                      and seen.beat.phase == Progress.FINISHED)
    return [r for r, proc in enumerate(s.plan.ranks) if left(proc)]


def _failed_after_training(s: State, done: list[int], out: list[Effect]) -> State:
    """A rank failed in the script's own code after session.run() (its final evaluation, its save): no rank
    trains any more, so there is nothing to take over and no group to recover into. The ranks still running
    that code finish it (rank 0 may be saving the model); then the job fails, saying why."""
    failed = s.swap.failed if s.swap else ()
    message = (f"{', '.join(f'{f.who} {f.exit}' for f in failed)} after ranks {done} had finished training: a "
               f"failure in the script's code after session.run() is not recovered. Training is complete on every "
               f"rank: its last step, {s.committed}, is committed.")
    s = replace(s, phase=Phase.STEADY, deadline=float("inf"), swap=None, after_training=message)
    running = still_running(s)
    if not running:
        return ended_after_training(s, out)
    out.append(Say(f"{message} Ranks {running} are still running their own code after session.run(): the job "
                   "ends when they do.", error=True))
    return s


def still_running(s: State) -> list[int]:
    """The ranks that neither finished (exit 0) nor were lost: what a job with a failure after training waits for."""
    return [r for r, proc in enumerate(s.plan.ranks) if proc not in s.finished | s.lost]


def ended_after_training(s: State, out: list[Effect]) -> State:
    """No rank runs any more after a failure past training: the last checkpoint is assembled, the job fails."""
    assert s.after_training is not None
    finalize_last(s, out)
    return fail(s, s.after_training, out)


def _begin_spare_wait(s: State, reason: str, now: float, out: list[Effect]) -> State:
    """Says once what is awaited and how to provide it; the deadline runs from the first failure it
    could not place."""
    if s.awaiting_since is None:
        s = replace(s, awaiting_since=now)
        by_node = lost_by_node(s.steady, s.lost)
        out += [Emit("spare_awaited", dict(nodes=list(by_node), ranks=sorted(r for g in by_node.values() for r in g),
                                           committed=s.committed, spare_wait_s=s.config.spare_wait_s,
                                           reason=reason)),
                Say(f"{reason}: start {_join_command(s)} on a healthy machine")]
    assert s.awaiting_since is not None
    return replace(s, phase=Phase.AWAIT_SPARE, deadline=s.awaiting_since + s.config.spare_wait_s)


def _no_spare(s: State, reason: str, waited_s: float, now: float, out: list[Effect]) -> State:
    """A lost rank has no spare to go to and none came: the job stops, naming what was lost and what
    would have kept it going."""
    by_node = lost_by_node(s.steady, s.lost)
    out.append(Emit("no_spare", dict(nodes=list(by_node), ranks=sorted(r for g in by_node.values() for r in g),
                                     committed=s.committed, waited_s=waited_s, spare_wait_s=s.config.spare_wait_s,
                                     reason=reason)))
    join = _join_command(s)
    advice = (f"start {join} on a healthy machine within --spare-wait" if s.config.spare_wait_s else
              f"pass --spare-wait SECONDS and start {join} on a healthy machine when a node is lost")
    return _stop(s, f"{reason}. Last committed step: {s.committed}. To go on from a lost node, {advice}, "
                    "or run with more --spare-nodes.", now, out)


def _stop(s: State, message: str, now: float, out: list[Effect]) -> State:
    """No spare for a lost rank: with a disk tier, the newest commit goes to disk first (from the survivors' slots
    and the lost ranks' holders: the steady plan's), so that `--resume auto` goes on from it; then the job fails."""
    if s.config.persist_dir and s.committed is not None:
        return persist.stop(s, "no spare left", s.steady, now, out, failure=message)
    return fail(s, message, out)


def _join_command(s: State) -> str:
    """What a new machine runs to join as a spare node: it needs a copy of the secret's file (the path is
    the coordinator's; the secret itself is never printed)."""
    return (f"`deadpool agent --coordinator {s.config.store_host}:{s.config.store_port} "
            f"--secret-file {s.config.secret_file or 'RUN_DIR/secret'} --spare`")
