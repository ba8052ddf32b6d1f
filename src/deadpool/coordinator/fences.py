"""Who the coordinator fences as hung: ranks whose heartbeat or progress stops in the steady state
(hangs.hang_verdict), and processes whose own beacon stops where no progress can be judged: idle spares,
which hold replicas the ranks wait on, and every process during a recovery (hangs.silent_processes).
Transitions of the coordinator's machine (machine.py), pure like it. A fence is a SIGKILL; the process's
exit follows as an input, and recovering from it is the ordinary path of a failure (machine.on_exit).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from deadpool.coordinator.hangs import SILENCE, Alive, Pulse, hang_timeout, hang_verdict, silent_processes
from deadpool.coordinator.policy import Decision
from deadpool.coordinator.state import (
    CoordinatorState,
    Effect,
    Emit,
    Fence,
    Hang,
    Heartbeat,
    Liveness,
    Phase,
    Say,
    Swap,
)

State = CoordinatorState
RECOVERING = (Phase.AWAIT_READY, Phase.AWAIT_RESUMED)  # no step runs: a process's beacon is all there is to judge


def _observe(seen: Liveness, beat: Heartbeat | None, gen: int, now: float) -> Liveness:
    """Any new heartbeat of this generation is a sign of life; a new (step, phase, marks) is progress."""
    if beat is None or beat == seen.beat:
        return seen
    if beat.gen != gen:
        return replace(seen, beat=beat)
    progress = (beat.step, beat.phase, beat.marks)
    if progress == seen.progress:
        return replace(seen, beat=beat, beat_t=now)
    return replace(seen, beat=beat, beat_t=now, progress=progress, progress_t=now)


def observe_beats(s: State, beats: Mapping[str, Heartbeat], arrived: Mapping[str, float], now: float) -> State:
    """Updates every rank's liveness (a beat dated by its arrival). Observing the same beat again changes nothing:
    the machine observes a tick's beats before its exits (a rank's last words and another's death may arrive
    in one tick: pool.done_training), and judges hangs from them after."""
    live = dict(s.live)
    for proc in _judged(s):
        live[proc] = _observe(live.get(proc) or Liveness(now, now), beats.get(proc), s.plan.generation,
                              arrived.get(proc, now))
    return replace(s, live=live)


def _judged(s: State) -> list[str]:
    return [p for p in s.plan.ranks if p not in s.fenced | s.lost]  # lost: failed after training ended


def look_for_hangs(s: State, beats: Mapping[str, Heartbeat], arrived: Mapping[str, float], now: float,
                   out: list[Effect]) -> State:
    """Updates every rank's liveness; fences the ranks the policy calls hung (their exit follows)."""
    gen = s.plan.generation
    s = observe_beats(s, beats, arrived, now)
    procs = _judged(s)
    pulses: dict[int, Pulse] = {}
    for proc in procs:
        seen = s.live[proc]
        if seen.beat is not None and seen.beat.gen == gen:
            pulses[s.plan.ranks.index(proc)] = Pulse(seen.beat_t, seen.progress_t, seen.beat.step, seen.beat.phase,
                                                     seen.beat.waiting)
    if len(pulses) < len(procs):
        return s  # detection starts once every rank of this generation has a heartbeat
    timeout = _timeout(s)
    silence_s = s.config.silence_timeout_s
    if abs((timeout.value or 0) - s.announced) > 0.2 * s.announced:  # say so when it moves by > 20 %
        out.append(Emit("hang_timeout", dict(timeout_s=timeout.value, reason=timeout.reason,
                                             silence_timeout_s=silence_s)))
        s = replace(s, announced=timeout.value or 0, announced_reason=timeout.reason)
    verdict = hang_verdict(now, pulses, timeout.value or float("inf"), silence_s)
    for rank, hung in sorted((verdict.value or {}).items()):
        proc, pulse = s.plan.ranks[rank], pulses[rank]
        last = min(pulse.beat_t, pulse.progress_t)
        out.append(Emit("hang_detected", dict(proc=proc, hung_rank=rank, step=pulse.step, phase=pulse.phase,
                                              last_progress_t=last, silent_s=now - last, rule=hung.rule,
                                              timeout_s=hung.timeout_s, reason=verdict.reason)))
        out.append(Say(f"rank {rank} ({proc}) is hung: {verdict.reason}; fencing it (SIGKILL)"))
        s = _fence(s, proc, rank, f"rank {rank} ({proc}) hung: {verdict.reason}", last, now, out)
    return s


def look_for_silence(s: State, alive: Mapping[str, int], arrived: Mapping[str, float], now: float,
                     out: list[Effect]) -> State:
    """Notes every sign of life (in every phase), dated by its arrival: a beacon that moved, or a later beacon
    or heartbeat (`arrived`; a Beacon rests while its process's heartbeat goes out, and a rank that has not
    yet left an aborted generation still beats); fences the idle spares (steady), and during a recovery any
    process of the plan, that showed none for the longer of the silence and hang timeouts. A spare is judged
    like a rank in its set-up, not by the silence timeout alone: it imports, runs the script's warm-up and
    starts its receivers while it idles, and may hold the GIL for seconds then (on a loaded machine a spare
    starting up went 1.5 s without a beat)."""
    seen = dict(s.alive)
    for proc, beats in alive.items():
        sign = arrived.get(proc)
        if proc not in seen or seen[proc].beats != beats or (sign is not None and sign > seen[proc].since):
            seen[proc] = Alive(beats, now if sign is None else sign)
    s = replace(s, alive=seen)
    limit = max(s.config.silence_timeout_s, _timeout_s(s))
    if s.phase is Phase.STEADY:
        judged, during = s.plan.spares, "while holding replicas"
    elif s.phase in RECOVERING:
        judged, during = (*s.plan.ranks, *s.plan.spares), f"while generation {s.plan.generation} recovers"
    else:
        return s
    gone = s.fenced | s.lost | s.finished
    verdict = silent_processes(now, {p: seen[p] for p in judged if p in seen and p not in gone}, limit, during)
    for proc in verdict.value or ():
        rank, since = s.plan.rank_of(proc), seen[proc].since
        who = f"rank {rank} ({proc})" if rank is not None else f"spare {proc}"
        out.append(Emit("hang_detected", dict(proc=proc, hung_rank=rank, step=None, phase=s.phase.value,
                                              last_progress_t=since, silent_s=now - since, rule=SILENCE,
                                              timeout_s=limit, reason=verdict.reason)))
        out.append(Say(f"{who} is hung: {verdict.reason}; fencing it (SIGKILL)"))
        s = _fence(s, proc, rank, f"{who} hung: {verdict.reason}", since, now, out)
    return s


def next_verdict_t(s: State) -> float:
    """The earliest moment a steady state's hang or silence verdict could fall due if nobody beat again: each
    rank's last beat + the silence timeout and last progress + the hang timeout, each idle spare's last beacon
    + the longer of both (a lower bound: the rules themselves decide). The shell sleeps no longer than that."""
    silence, timeout = s.config.silence_timeout_s, _timeout_s(s)
    ranks = [min(v.beat_t + silence, v.progress_t + timeout) for p, v in s.live.items()
             if v.beat is not None and p in s.plan.ranks and p not in s.fenced]
    spares = [s.alive[p].since + max(silence, timeout) for p in s.plan.spares
              if p in s.alive and s.alive[p].beats > 0 and p not in s.fenced]
    return min(ranks + spares, default=float("inf"))


def _fence(s: State, proc: str, rank: int | None, cause: str, last: float, now: float, out: list[Effect]) -> State:
    """Kills a hung process; its exit starts (or joins) the recovery. A recovery in flight keeps its cause."""
    swap = s.swap or Swap(detected_t=now, cause=cause, hang=Hang(rank, proc, last, now))
    out.append(Fence(proc))
    return replace(s, fenced=s.fenced | {proc}, swap=swap, root_cause=s.root_cause or swap.cause)


def _timeout(s: State) -> Decision[float]:
    """The hang timeout in force: the user's, or from the ranks' step times as last seen in the steady state."""
    return hang_timeout(s.config.hang_timeout_s, [v.beat.step_s for v in s.live.values() if v.beat and v.beat.step_s])


def _timeout_s(s: State) -> float:
    """_timeout's seconds: hang_timeout always has a value (the user's, the step-based one, or the untimed one)."""
    value = _timeout(s).value
    assert value is not None
    return value
