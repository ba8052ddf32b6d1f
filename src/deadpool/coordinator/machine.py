"""The coordinator as a pure function: advance(state, inputs, now) -> (state, effects). No I/O, no clock, no torch.

    STEADY --a process fails, or is fenced as hung--> SETTLING (gather the failures that arrive together)
    SETTLING --window over: policy.plan_after_failures, publish plan g+1, abort g--> AWAIT_READY
    AWAIT_READY --every rank reported its intact steps: policy.choose_restore_step--> AWAIT_RESUMED
    AWAIT_RESUMED --every rank agreed and rejoined--> STEADY
    any recovery phase --another failure--> SETTLING (the new set is planned from the last steady plan)
    SETTLING --no spare left, a spare node awaited (policy.wait_for_spare)--> AWAIT_SPARE
    AWAIT_SPARE --a spare node's spares started, or --spare-wait is over--> decided again, as from SETTLING
    STEADY --a spare node's spares started: policy.plan_after_join, publish g+1--> AWAIT_READY
    SETTLING --a rank failed once some rank left session.run() (pool.done_training)--> STEADY, no plan: the
        job fails once the other ranks end their own code after run()

In STEADY the machine also checks that data-parallel replicas agree (divergence.check_replicas), commits
snapshots (policy.commit_step), looks for hangs (fences.look_for_hangs) and admits spare nodes that joined
the running job (a join in any other phase waits in the state until then). In STEADY and during a recovery
it fences processes whose own heartbeat stopped (fences.look_for_silence: an idle spare, anyone recovering).
A script error ends the job at once without a swap; a deadline missed, or a decision with no answer,
ends it with the earliest failure as its root cause. The shell (server.py) gathers the inputs, calls
`advance` with its clock, and applies the effects in order; exits come first, then the phase's tick.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Mapping

from deadpool.config import JobConfig
from deadpool.coordinator import persist
from deadpool.coordinator.divergence import DIVERGENCE_CAUSES, Divergence, check_replicas
from deadpool.coordinator.fences import look_for_hangs, look_for_silence, next_verdict_t, observe_beats
from deadpool.coordinator.policy import (
    FINISHED,
    SCRIPT_ERROR,
    Decision,
    Durable,
    abandoned_steps,
    choose_restore_step,
    classify_exit,
    commit_step,
    initial_plan,
    node_map,
)
from deadpool.coordinator.pool import admit, await_spare, decide, ended_after_training, refill, still_running
from deadpool.coordinator.state import (
    CoordinatorState,
    Effect,
    Emit,
    ExitReport,
    Failure,
    Finalize,
    Inputs,
    MarkRunning,
    Phase,
    Say,
    Spawn,
    Swap,
    WriteCommit,
    WriteTarget,
)
from deadpool.coordinator.transitions import (
    drop_joining,
    end,
    fail,
    publish,
    refuse,
    terminated,
    with_status,
)
from deadpool.protocol.kinds import Role
from deadpool.protocol.status import Recovery

State = CoordinatorState
FRESH_START = ("nothing was committed yet (a death in start-up): every rank begins afresh, from the script's own "
               "initial state, as at the job's start")


def start(config: JobConfig, persisted: int | None = None) -> tuple[State, tuple[Effect, ...]]:
    """Generation 0: step 0 counts as committed before anything runs, the plan, then every process. `persisted`:
    the step of the checkpoint a resumed job starts from, when it lies in --persist-dir (not written again)."""
    spares = tuple(f"s{i}" for i in range(config.spares))
    plan = initial_plan(config.workers, spares, replicate=config.snapshot_every != 0, replicas=config.replicas,
                        nodes=node_map(config.workers, config.spares, config.nproc_per_node))
    out: list[Effect] = [WriteCommit(0, None, ())]
    s = publish(State(config=config, steady=plan, plan=plan, persisted=persisted), plan, out)
    out += [Spawn(name, Role.WORKER, rank) for rank, name in enumerate(plan.ranks)]
    out += [Spawn(name, Role.SPARE, plan.world_size + i) for i, name in enumerate(plan.spares)]
    return with_status(s, out)


def advance(s: State, inputs: Inputs, now: float) -> tuple[State, tuple[Effect, ...]]:
    """One tick: the exits first (any of them may end the job), then what the phase waits for."""
    assert s.exit_code is None, "the job has ended"
    out: list[Effect] = []
    if inputs.joined:
        s = replace(s, joins={**s.joins, **inputs.joined})
    if s.phase is Phase.STEADY and inputs.exits:  # a rank's last words may come in the tick of another's exit
        s = observe_beats(s, inputs.beats, inputs.beats_t, now)
    for exit_ in inputs.exits:
        s = on_exit(s, exit_, now, out)
        if s.exit_code is not None:
            return with_status(s, out)
    if inputs.terminate or s.stopping_t is not None:
        return with_status(_stopping(s, inputs, now, out), out)
    return with_status(_tick(s, inputs, now, out), out)


def next_tick(s: State, now: float, busy_s: float, quiet_s: float) -> float:
    """How long the shell may wait for its next tick if nothing wakes it (a report, an exit, SIGTERM): `busy_s`
    while a recovery, checkpoint, stop or joining node is under way; else, while the job only trains and only
    liveness can change, `quiet_s`, but no longer than until a hang or silence verdict could fall due, and
    never less than `busy_s` (a rank that finished, or has not joined yet, stays overdue without a verdict:
    a shorter wait would spin)."""
    quiet = (s.phase is Phase.STEADY and s.swap is None and s.persisting is None and s.stopping_t is None
             and not s.joining and s.exit_code is None)
    return min(quiet_s, max(busy_s, next_verdict_t(s) - now)) if quiet else busy_s


# ---- exits --------------------------------------------------------------------------------

def on_exit(s: State, x: ExitReport, now: float, out: list[Effect]) -> State:
    """A process ended: a rank finished, the script has a bug (the job stops), or a failure joins the set
    being settled (a recovery in flight is planned again with it)."""
    verdict = classify_exit(x.returncode, fenced=x.name in s.fenced, started=x.started,
                            script_error=x.script_error.error if x.script_error else None,
                            lost_with_node=x.lost_with_node)
    rank = s.plan.rank_of(x.name)
    joining = next((node for node, j in s.joining.items() if x.name in j.procs), None)
    if joining is not None:  # before it entered the pool: the pool stays as it is
        return drop_joining(s, joining, f"{x.name} {verdict.reason}", out)
    if verdict.value == FINISHED:
        if rank is None:
            return s
        s = replace(s, finished=s.finished | {x.name})
        if s.after_training is not None and not still_running(s):
            return ended_after_training(s, out)
        return end(s, out) if s.finished >= set(s.plan.ranks) else s
    if verdict.value == SCRIPT_ERROR:
        return _script_error(s, x, verdict.reason, out)
    if x.name in s.lost or (rank is None and x.name not in s.plan.spares and x.name not in s.steady.spares):
        return s  # already replaced: its exit changes nothing
    who = f"rank {rank} ({x.name}, pid {x.pid})" if rank is not None else f"spare {x.name} (pid {x.pid})"
    out.append(Emit("failure_detected", dict(proc=x.name, failed_rank=rank, exit=verdict.reason,
                                             returncode=x.returncode, during=s.phase.value)))
    out.append(Say(f"{who} {verdict.reason}"))
    swap = s.swap or Swap(detected_t=now, cause=f"{who} {verdict.reason}")
    s = replace(s, root_cause=s.root_cause or f"{who} {verdict.reason}", lost=s.lost | {x.name},
                swap=replace(swap, failed=(*swap.failed, Failure(x.name, rank, verdict.reason, who))))
    if s.phase is not Phase.SETTLING:
        s = replace(s, phase=Phase.SETTLING, deadline=now + s.config.settle_s)
    return s


def _script_error(s: State, x: ExitReport, reason: str, out: list[Effect]) -> State:
    """A bug in the script: replaying it on a spare would raise it again, so the job stops here."""
    report, where = x.script_error, x.name
    if report and report.refused:  # --resume with a checkpoint of another job: refused like a bad command line
        return refuse(s, report.error.partition(": ")[2], out)
    used = ", so no spare was used"
    if report and report.taking_over is not None:
        where = (f"spare {x.name}, in the script's set-up as it took over rank {report.rank} at step "
                 f"{report.taking_over}")
        used = ("; a spare was used for the failure before it, and no other is tried (a called spare runs the "
                "script's set-up then, reading the script's own files as they are at that moment)")
    elif report and report.rank is not None:
        where = f"rank {report.rank} ({x.name}) at step {report.step}"
    message = (f"error in the training script on {where}: {reason.removeprefix('the training script ')}. "
               f"This is a bug in the script, not a node failure{used}; the traceback is "
               f"above (and in logs/{x.name}.log). Fix the script and run again.")
    out.append(Emit("script_error", dict(proc=x.name, rank=report.rank if report else None,
                                         step=report.step if report else None, error=reason)))
    return fail(replace(s, root_cause=None), message, out)


# ---- the phases ---------------------------------------------------------------------------

def _tick(s: State, inputs: Inputs, now: float, out: list[Effect]) -> State:
    """What the phase waits for: reports to commit and hangs (steady), a window or a deadline, or every rank.
    In every phase, silent processes are looked for (fences.look_for_silence)."""
    s = look_for_silence(s, inputs.alive, inputs.alive_t, now, out)
    if s.phase is Phase.STEADY:
        s = _commit(s, inputs.durable, now, out)
        if s.exit_code is not None:
            return s
        s = persist.tick(s, inputs, now, out, may_order=True)
        s = look_for_hangs(s, inputs.beats, inputs.beats_t, now, out)
        if s.swap is None and not s.finished and s.after_training is None:
            s, new = admit(s, inputs.started, now, out)
            s = refill(s, new, now, out)
        return s
    if s.persisting is not None:  # an order placed before a failure: its writers may still complete it
        s = persist.tick(s, inputs, now, out, may_order=False)
    if s.phase is Phase.AWAIT_SPARE:
        return await_spare(s, inputs.started, now, out)
    if s.phase is Phase.SETTLING:
        return decide(s, now, out) if now >= s.deadline else s
    gen, world = s.plan.generation, range(s.plan.world_size)
    reported = set(inputs.ready) if s.phase is Phase.AWAIT_READY else inputs.resumed
    missing = [r for r in world if r not in reported]
    if missing:
        if now > s.deadline:
            what = "report their snapshots" if s.phase is Phase.AWAIT_READY else "rejoin"
            where = ("; a rank that did not report logged where it was stuck (its abort_unheeded event)"
                     if s.phase is Phase.AWAIT_READY else "")
            return fail(s, f"ranks {missing} did not {what} within {s.config.recovery_timeout_s} s "
                           f"of generation {gen}{where}", out)
        return s
    if s.phase is Phase.AWAIT_READY:
        return _choose_target(s, inputs.ready, now, out)
    return _complete(s, now, out)


def _commit(s: State, reports: Mapping[int, Durable], now: float, out: list[Effect]) -> State:
    """Checks that data-parallel replicas agree, then commits the newest step every rank holds durably;
    the one writer of g{gen}/committed. A step is checked before it can be committed."""
    check = check_replicas(s.agreed, reports)
    s = replace(s, agreed=check.agreed)
    if check.divergence is not None:
        s = _diverged(s, check.divergence, check.reason, out)
        if s.exit_code is not None:
            return s
    decision = commit_step(s.committed, reports)
    committed = decision.value if decision.ok else s.committed
    abandoned = tuple(abandoned_steps(committed, reports))
    if committed == s.committed and abandoned == s.abandoned:
        return s
    out.append(WriteCommit(s.plan.generation, committed, abandoned))
    if decision.ok and committed != s.committed:
        out.append(Emit("commit", dict(step=committed, reason=decision.reason)))
        since = 0 if committed == s.persisted else s.commits_since_persist + 1  # a resumed job's first: on disk
        s = replace(s, commits_since_persist=since,
                    persisted_t=now if s.persisted_t is None else s.persisted_t)
    return replace(s, committed=committed, abandoned=abandoned)


def _diverged(s: State, divergence: Divergence, reason: str, out: list[Effect]) -> State:
    """Replicas that must be identical are not: the run is no longer the one the user started."""
    action = s.config.on_divergence
    out.append(Emit("divergence", dict(step=divergence.step, groups=[list(g) for g in divergence.groups],
                                       agreed=divergence.agreed, action=action)))
    s = replace(s, agreed=divergence.step)  # then go on checking the next steps
    if action == "warn":
        if s.warned != s.plan.generation:  # said once per generation; every step is in the events
            out.append(Say(f"warning: replicas diverged {reason}. Usual causes: {DIVERGENCE_CAUSES}. "
                           "Going on (--on-divergence warn).", error=True))
            s = replace(s, warned=s.plan.generation)
        return s
    return fail(replace(s, root_cause=None), f"replicas diverged {reason}. Data-parallel replicas must stay "
                f"bit-identical; these no longer are, so the run is not the one you started. Usual causes: "
                f"{DIVERGENCE_CAUSES}. Fix the script (or pass --on-divergence warn to go on anyway).", out)


def _stopping(s: State, inputs: Inputs, now: float, out: list[Effect]) -> State:
    """The newest commit goes to disk first, within --stop-grace (persist.stop), then the job stops, saying how
    to go on: on SIGTERM (a scheduler's stop; exit 143, training goes on meanwhile), or when a lost rank has
    no spare to take it (pool.decide; exit 1). A failure meanwhile is not recovered."""
    config = s.config
    if s.stopping_t is None:  # SIGTERM, in this tick
        out.append(Emit("stop_requested", dict(signal="SIGTERM", committed=s.committed, persisted=s.persisted)))
        s = persist.stop(s, "SIGTERM", s.plan, now, out)
    since = s.stopping_t if s.stopping_t is not None else now
    if s.persisting is not None:
        s = persist.tick(s, inputs, now, out, may_order=False)
    if s.persisting is not None and now < since + config.stop_grace_s:
        return s
    if s.last_try:
        return terminated(replace(s, persisted=s.committed) if inputs.finalized.get(s.committed or -1) else s, out)
    if config.persist_dir and s.committed is not None and s.persisted != s.committed:
        # The order failed or ran out of time; ranks that got the SIGTERM too (scancel signals every process)
        # wrote their own parts as they exited: whatever is complete on disk is assembled now.
        out.append(Finalize(s.committed, None, None, None))
        return replace(s, last_try=True)
    return terminated(s, out)


# ---- recovery -----------------------------------------------------------------------------

def _choose_target(s: State, holdings: Mapping[int, list[int]], now: float, out: list[Effect]) -> State:
    gen = s.plan.generation
    if s.committed is None:  # a death in start-up: no step ran anywhere, so nothing is lost by starting again
        decided = dict(target=None, reason=FRESH_START, holdings=dict(holdings), from_disk=False)
        out += [Emit("restore_decided", decided), WriteCommit(gen, None, ()), WriteTarget(gen, None)]
        return replace(s, phase=Phase.AWAIT_RESUMED, deadline=now + s.config.recovery_timeout_s)
    decision = choose_restore_step(s.committed, holdings)
    from_disk = decision.value is None and s.persisted is not None  # memory first, disk second, in one recovery
    if from_disk:
        decision = Decision(s.persisted, f"cannot recover from memory ({decision.reason}); every rank restores "
                                         f"step {s.persisted} from disk, in place")
    out.append(Emit("restore_decided", dict(target=decision.value, reason=decision.reason, holdings=dict(holdings),
                                            from_disk=from_disk)))
    if decision.value is None:
        return fail(s, f"cannot recover from memory: {decision.reason}", out)
    out += [WriteCommit(gen, decision.value, ()), WriteTarget(gen, decision.value)]
    return replace(s, committed=decision.value, abandoned=(), agreed=decision.value,  # replayed steps: checked again
                   phase=Phase.AWAIT_RESUMED, deadline=now + s.config.recovery_timeout_s)


def _complete(s: State, now: float, out: list[Effect]) -> State:
    swap, refilled = s.swap, s.refill
    assert swap is not None or refilled is not None
    gen = s.plan.generation
    if swap is not None:
        s = _swapped(s, swap, now, out)
    if refilled is not None:
        out.append(Emit("pool_refilled", dict(nodes=list(refilled.nodes), procs=list(refilled.procs),
                                              spares=list(s.plan.spares), holders=[list(h) for h in s.plan.holders],
                                              restored_step=s.committed, took_s=now - refilled.t)))
        out.append(Say(f"generation {gen} running: spare node(s) {list(refilled.nodes)} joined the pool "
                       f"({', '.join(refilled.procs)}); idle spares now: {', '.join(s.plan.spares) or 'none'}"))
    out.append(MarkRunning(gen))
    return replace(s, swap=None, refill=None, steady=s.plan, lost=frozenset(), live={}, phase=Phase.STEADY,
                   deadline=float("inf"), root_cause=None)  # recovered: a later failure is its own root cause


def _swapped(s: State, swap: Swap, now: float, out: list[Effect]) -> State:
    gen, target = s.plan.generation, s.committed
    replaced = {r: p for r, p in enumerate(s.plan.ranks) if p != s.steady.ranks[r]}
    took = now - swap.detected_t
    cause = swap.cause if len(swap.failed) < 2 else "; ".join(f"{f.who} {f.exit}" for f in swap.failed)
    out.append(Emit("swap_complete", dict(restored_step=target, replaced=replaced, cause=cause,
                                          failed=[asdict(f) for f in swap.failed],
                                          hang=asdict(swap.hang) if swap.hang else None,
                                          detected_t=swap.detected_t, detect_to_resume_s=took)))
    restored = "began afresh" if target is None else f"restored step {target}"
    out.append(Say(f"generation {gen} running: {restored}; "
                   + ", ".join(f"{p} is now rank {r}" for r, p in replaced.items())
                   + f" ({took:.2f} s after detection)"))
    done = Recovery(gen, cause, target, took, {str(r): p for r, p in replaced.items()})
    return replace(s, recoveries=(*s.recoveries, done))
