"""When committed snapshots go to disk, and who writes them: pure, like machine.py (no I/O, no clock).

    a commit --persist_due--> OrderPersist(step, writers) --every writer reported its part--> Finalize(step)
    --the checkpoint is complete (manifest renamed into place)--> persisted = step

Writers are the idle holders of each rank's replica where there are any (a spare has every committed
snapshot of the ranks it holds in memory and nothing else to do), else the rank itself. An order that a
writer cannot carry out (its process died, the snapshot moved on) is dropped; the next commit orders again.
"""

from __future__ import annotations

from dataclasses import replace

from deadpool.config import JobConfig
from deadpool.coordinator.policy import Decision
from deadpool.coordinator.state import CoordinatorState, Effect, Emit, Finalize, Inputs, OrderPersist, Persisting, Say
from deadpool.protocol.plan import Plan
from deadpool.protocol.records import PersistOrder

State = CoordinatorState


def writers_of(plan: Plan, lost: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """rank -> the process that writes its snapshot: its first live holder that is an idle spare, else itself,
    else (it was lost) its first live holder."""
    def writer(owner: str, holders: tuple[str, ...]) -> str:
        live = [h for h in holders if h not in lost]
        idle = next((h for h in live if h in plan.spares), None)
        return idle or (live[0] if owner in lost and live else owner)
    return tuple(writer(owner, holders) for owner, holders in zip(plan.ranks, plan.holders))


def persist_due(config: JobConfig, committed: int | None, persisted: int | None, commits: int,
                since_t: float | None, now: float) -> Decision:
    """Whether the newest commit should be written now: every --persist-every commits, or once
    --persist-interval seconds passed since the last checkpoint (or the job's first commit)."""
    if not config.persist_dir or committed is None or committed == persisted:
        return Decision(None, "nothing new to persist")
    if config.persist_every and commits >= config.persist_every:
        return Decision(True, f"{commits} commits since the last checkpoint (--persist-every {config.persist_every})")
    if config.persist_interval_s and since_t is not None and now - since_t >= config.persist_interval_s:
        return Decision(True, f"{now - since_t:.1f} s since the last checkpoint "
                              f"(--persist-interval {config.persist_interval_s:g})")
    return Decision(None, "not due yet")


def order(s: State, step: int, reason: str, now: float, out: list[Effect], plan: Plan | None = None) -> State:
    """Orders checkpoint `step` from the writers of `plan` (the current one by default) that are not lost; it must
    be complete within the deadline."""
    writers = writers_of(plan or s.plan, s.lost)
    out.append(OrderPersist(PersistOrder(step, s.plan.generation, writers, reason)))
    out.append(Emit("persist_ordered", dict(step=step, writers=list(writers), reason=reason)))
    return replace(s, persisting=Persisting(step, writers, now, now + s.config.collective_timeout_s, reason))


def stop(s: State, cause: str, plan: Plan, now: float, out: list[Effect], failure: str | None = None) -> State:
    """The job is to stop once its newest commit is on disk (machine._stopping waits, up to --stop-grace): on
    SIGTERM, or, with `failure`, because it cannot go on. `plan`'s processes hold the commit in memory."""
    config = s.config
    s = replace(s, stopping_t=now, stop_failure=failure)
    in_flight = s.persisting is not None and s.persisting.step == s.committed
    if config.persist_dir and s.committed is not None and s.committed != s.persisted and not in_flight:
        out.append(Say(f"{cause}: writing step {s.committed} to {config.persist_dir} before stopping "
                       f"(--stop-grace {config.stop_grace_s:g} s)"))
        s = order(s, s.committed, f"the job is stopping ({cause})", now, out, plan)
    return s


def tick(s: State, inputs: Inputs, now: float, out: list[Effect], may_order: bool) -> State:
    """Follows the order in flight (reports in, then the checkpoint finalized) or places the next one."""
    job = s.persisting
    if job is None:
        if not may_order:
            return s
        due = persist_due(s.config, s.committed, s.persisted, s.commits_since_persist, s.persisted_t, now)
        return order(s, s.committed, due.reason, now, out) if due.value and s.committed is not None else s
    if job.finalizing:
        outcome = inputs.finalized.get(job.step)
        if outcome is None:
            return s
        if outcome:  # the shell emitted checkpoint_persisted with the path
            return replace(s, persisting=None, persisted=job.step, commits_since_persist=0, persisted_t=now)
        return replace(s, persisting=None, persisted_t=now)  # the shell said why; the next commit tries again
    reports = {proc: r for proc, r in inputs.persist_reports.items() if r.step == job.step}
    failed = [r for r in reports.values() if not r.ok]
    if failed or now > job.deadline:
        why = "; ".join(f"{r.proc}: {r.error}" for r in failed) or (
            f"writers {sorted(set(job.writers) - set(reports))} did not report within "
            f"{s.config.collective_timeout_s:g} s")
        out.append(Emit("persist_failed", dict(step=job.step, reason=why)))
        return replace(s, persisting=None, persisted_t=now)
    if set(job.writers) <= set(reports):
        out.append(Finalize(job.step, job.ordered_t, sum(r.nbytes for r in reports.values()),
                            max(r.seconds for r in reports.values())))
        return replace(s, persisting=replace(job, finalizing=True))
    return s
