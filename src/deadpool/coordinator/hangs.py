"""Pure decisions about hangs: how long a rank may go without progress (hang_timeout), which ranks to fence
(hang_verdict), and which processes have gone silent (silent_processes: idle spares that hold replicas, and
every process of a recovery, which has no step to make progress in). No I/O, no threads, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from deadpool.coordinator.policy import Decision
from deadpool.protocol.kinds import Phase

HANG_FLOOR_S = 3.0      # never call a rank hung sooner: scheduling hiccups on a busy host last this long
HANG_STEP_MULTIPLE = 8  # ... nor before this many of its median steps have passed without progress
HANG_UNTIMED_S = 10.0   # before any step has been timed (start-up, compilation, first step)


@dataclass(frozen=True)
class Pulse:
    """What the coordinator knows of one rank's liveness: when its heartbeat last ticked, when its
    progress (step, phase) last changed, and whether it is waiting on its peers."""

    beat_t: float
    progress_t: float
    step: int
    phase: str
    waiting: bool


def hang_timeout(configured: float | None, step_s: list[float]) -> Decision[float]:
    """The user's --hang-timeout, else a multiple of the slowest rank's median step with a floor."""
    if configured is not None:
        return Decision(configured, f"--hang-timeout {configured:g} s")
    if not step_s:
        return Decision(HANG_UNTIMED_S, f"no step timed yet: {HANG_UNTIMED_S:g} s")
    slowest = max(step_s)
    value = max(HANG_FLOOR_S, HANG_STEP_MULTIPLE * slowest)
    return Decision(value, f"{HANG_STEP_MULTIPLE} x the slowest median step ({slowest:.3f} s), "
                           f"at least {HANG_FLOOR_S:g} s: {value:.1f} s")


SILENCE, PROGRESS = "silence", "progress"  # the two rules of hang_verdict


@dataclass(frozen=True)
class Hung:
    """Why one rank is fenced: the rule that fired and the timeout it outlasted."""

    rule: str
    timeout_s: float


def hang_verdict(now: float, pulses: Mapping[int, Pulse], timeout_s: float,
                 silence_s: float) -> Decision[Mapping[int, Hung]]:
    """Ranks to fence, each with the rule that fired: SILENCE for a rank whose heartbeat stopped for
    `silence_s` (SIGSTOP, a frozen machine: a rank beats every 0.1 s from a thread of its own, so
    a short silence is proof enough, whatever the step time); PROGRESS for a rank that beats but makes no
    progress for `timeout_s` while a peer waits for it (spinning in the script, a deadlock: only a multiple
    of the step time tells that apart from a slow step).

    A rank that waits in a collective is never the culprit while another rank is silent or stuck:
    it is the victim. If everyone waits and nobody is silent, no one is to blame here (the
    collective timeout ends it). A rank that reported "finished" is never hung: it is exiting. A rank still
    in its script's set-up ("start": loading data, building the model, before session.run) may take any
    time without progress; only its silence counts, and for the longer of both timeouts: set-up code may
    hold the GIL (unpickling a data set) while every process of the job sets up at once.
    """
    pulses = {r: p for r, p in pulses.items() if p.phase != Phase.FINISHED}  # done: its silence is its exit
    limits = {r: max(silence_s, timeout_s) if p.phase == Phase.START else silence_s for r, p in pulses.items()}
    silent = {r for r, p in pulses.items() if now - p.beat_t >= limits[r]}
    waiting = {r for r, p in pulses.items() if p.waiting}
    stuck = {r for r, p in pulses.items()
             if not p.waiting and p.phase != Phase.START and now - p.progress_t >= timeout_s and waiting - {r}} - silent
    if not silent | stuck:
        return Decision(None, "every rank progresses or waits on a live peer")
    parts = []
    for r in sorted(silent | stuck):
        p = pulses[r]
        if r in silent:
            parts.append(f"rank {r} silent (no heartbeat) for {now - p.beat_t:.1f} s in {p.phase} of step {p.step} "
                         f"(silence timeout {limits[r]:g} s)")
        else:
            parts.append(f"rank {r} made no progress for {now - p.progress_t:.1f} s in {p.phase} of step "
                         f"{p.step} (last heartbeat {now - p.beat_t:.1f} s ago; hang timeout {timeout_s:.1f} s)")
    victims = sorted(waiting - silent - stuck)
    reason = "; ".join(parts) + (f" while rank(s) {victims} wait for it" if victims else "")
    return Decision({r: Hung(SILENCE, limits[r]) if r in silent else Hung(PROGRESS, timeout_s)
                     for r in sorted(silent | stuck)}, reason)




@dataclass(frozen=True)
class Alive:
    """A process's own sign of life (runtime/watch.Beacon: a counter its thread adds to every 0.1 s from
    deadpool.init() until it exits, whatever it does, but while the process's heartbeat goes out), as the
    coordinator last saw it, on its clock."""

    beats: int    # 0: not started yet (no count before its first beat)
    since: float  # when the last sign arrived: `beats` changed, or a heartbeat came


def silent_processes(now: float, alive: Mapping[str, Alive], limit_s: float, during: str) -> Decision[tuple[str, ...]]:
    """The processes, of those given, whose heartbeat has not moved for `limit_s`: stopped (SIGSTOP) or frozen.

    Used where no progress can be judged: an idle spare, which only holds replicas (while it is stopped, the
    ranks replicating to it block at their next copy), and every process of a recovery (AWAIT_READY,
    AWAIT_RESUMED), where no step runs. The caller picks `limit_s`: the silence timeout for an idle spare;
    during a recovery the hang timeout as well (a taker runs its script's set-up then, which may hold the GIL,
    unpickling a data set). A process that never beat has not reached deadpool.init(): its start is not
    judged here (its exit is)."""
    silent = tuple(p for p, a in sorted(alive.items()) if a.beats > 0 and now - a.since >= limit_s)
    if not silent:
        return Decision(None, f"every process {during} beats")
    return Decision(silent, "; ".join(f"{p} silent (no heartbeat) for {now - alive[p].since:.1f} s {during} "
                                      f"(timeout {limit_s:g} s)" for p in silent))
