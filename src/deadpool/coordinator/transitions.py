"""Transitions every phase of the coordinator's machine shares: publish a plan, end or fail the job, drop a
joining node, and the job-status record derived from the state. Pure, like machine.py."""

from __future__ import annotations

from dataclasses import replace

from deadpool.coordinator.state import (
    Abort,
    CoordinatorState,
    Effect,
    Emit,
    Fence,
    Finalize,
    PublishPlan,
    PublishStatus,
    Relabel,
    Say,
    Stop,
)
from deadpool.protocol.kinds import Ending, Outcome, Role
from deadpool.protocol.plan import Plan
from deadpool.protocol.status import JobStatus, Member

State = CoordinatorState


def publish(s: State, plan: Plan, out: list[Effect]) -> State:
    """Reports and commit keys first, then the plan, the generation number, and the abort of the old
    one: whoever sees the abort can always read the plan that replaces it."""
    gen = plan.generation
    out.append(PublishPlan(plan))
    if gen > 0:
        out += [Abort(gen - 1, plan.reason), Say(f"generation {gen}: {plan.reason}")]
    out += [Relabel(name, f"{name}=r{rank}") for rank, name in enumerate(plan.ranks) if Role.of(name) is Role.SPARE]
    out.append(Emit("plan_published", dict(ranks=list(plan.ranks), holders=[list(h) for h in plan.holders],
                                           spares=list(plan.spares), sources=list(plan.sources),
                                           reason=plan.reason)))
    return replace(s, plan=plan)


def end(s: State, out: list[Effect]) -> State:
    """Every rank finished: the job is done."""
    finalize_last(s, out)
    out += [Stop(Ending.DONE, grace_s=10.0), Emit("job_finished", dict(generation=s.plan.generation))]
    return replace(s, exit_code=0)


def finalize_last(s: State, out: list[Effect]) -> None:
    """As training ends: with a disk tier, each rank wrote its part of the last commit as it finished
    (runtime/persist.py): it becomes a complete checkpoint before the job stops, if every part is there."""
    if s.config.persist_dir and s.committed is not None and s.committed != s.persisted:
        out.append(Finalize(s.committed, None, None, None))


def terminated(s: State, out: list[Effect]) -> State:
    """Stopped with the newest commit on disk if it could be written in time, saying how to go on from it: by
    SIGTERM, exit 143 (128 + 15) as a scheduler expects; or, as the job could not go on (`stop_failure`: no
    spare left), failed, exit 1."""
    config = s.config
    if not config.persist_dir:
        saved = "nothing was persisted (give --persist-dir to make a stopped job resumable)"
    elif s.persisted is None:
        saved = f"no complete checkpoint in {config.persist_dir}"
    else:
        saved = (f"step {s.persisted} is on disk in {config.persist_dir}; go on from it with the same command "
                 "and --resume auto")
    by = "SIGTERM" if s.stop_failure is None else "no spare"
    out.append(Emit("job_stopped", dict(by=by, persisted=s.persisted, committed=s.committed)))
    if s.stop_failure is not None:
        return fail(s, f"{s.stop_failure} {saved[0].upper()}{saved[1:]}.", out)
    out += [Stop(Ending.TERMINATED, grace_s=0.0), Say(f"stopped by SIGTERM: {saved}", error=True)]
    return replace(s, exit_code=143, failure=f"stopped by SIGTERM: {saved}")


def fail(s: State, message: str, out: list[Effect]) -> State:
    """The job cannot go on: it stops, naming the earliest failure as the root cause."""
    cause = s.root_cause or message
    out += [Emit("job_failed", dict(reason=message, root_cause=cause)), Stop(Ending.FAILED, grace_s=5.0),
            Say(f"job failed: {message}", error=True)]
    if cause != message:
        out.append(Say(f"root cause: {cause}", error=True))
    return replace(s, exit_code=1, failure=message)


def refuse(s: State, message: str, out: list[Effect]) -> State:
    """The job was given what cannot work (a checkpoint of another job to resume): it stops with exit 2, as
    a bad command line does, saying why in one line."""
    out += [Emit("job_failed", dict(reason=message, root_cause=message)), Stop(Ending.FAILED, grace_s=5.0),
            Say(message, error=True)]
    return replace(s, exit_code=2, failure=message)


def drop_joining(s: State, node: int, why: str, out: list[Effect]) -> State:
    """A spare node that joined but cannot enter the pool: its other spares are fenced."""
    joining = s.joining[node]
    out += [Fence(name) for name in joining.procs]
    out += [Emit("spare_node_dropped", dict(node=node, procs=list(joining.procs), reason=why)),
            Say(f"spare node {node} ({joining.host}) does not enter the pool: {why}")]
    return replace(s, joining={n: j for n, j in s.joining.items() if n != node})


def status_of(s: State) -> JobStatus:
    """What `deadpool status` shows of this state."""
    plan, holds = s.plan, dict[str, list[int]]()
    for rank, holders in enumerate(plan.holders):  # one pass: this runs every tick, at any scale
        for holder in holders:
            holds.setdefault(holder, []).append(rank)
    members = tuple(Member(proc, rank, plan.nodes.get(proc), tuple(holds.get(proc, ())))
                    for rank, proc in [*enumerate(plan.ranks), *((None, p) for p in plan.spares)])
    outcome = Outcome.RUNNING if s.exit_code is None else Outcome.FINISHED if s.exit_code == 0 else Outcome.FAILED
    return JobStatus(generation=plan.generation, phase=s.phase.value, outcome=outcome, reason=s.failure,
                     exit_code=s.exit_code, members=members, committed=s.committed, recoveries=s.recoveries,
                     hang_timeout_s=s.announced or None, hang_timeout_reason=s.announced_reason)


def with_status(s: State, out: list[Effect]) -> tuple[State, tuple[Effect, ...]]:
    """The tick's effects, with the job status when it changed: before the job stops, if it does, so that a
    reader sees the outcome while the processes are being stopped."""
    status = status_of(s)
    if status == s.status:
        return s, tuple(out)
    stop = next((i for i, e in enumerate(out) if isinstance(e, Stop)), len(out))
    return replace(s, status=status), (*out[:stop], PublishStatus(status), *out[stop:])
