"""Pure decisions of the coordinator: each returns what to do and why. No I/O, no threads, no torch."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from deadpool.coordinator.protocol import Plan


@dataclass(frozen=True)
class Decision:
    """A policy's answer: `value` is None when there is nothing that can be done, and `reason` says why."""

    value: object
    reason: str

    @property
    def ok(self) -> bool:
        return self.value is not None


def describe_exit(returncode: int) -> str:
    """Says how a process ended, the way a user reads it (Popen gives -N for signal N)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def place_replicas(world_size: int, spares: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Rank r's snapshots go to spare r mod S: each spare holds about world/S ranks, and with no
    spare nobody holds a replica (a failure is then unrecoverable from memory)."""
    if not spares:
        return tuple(() for _ in range(world_size))
    return tuple((spares[r % len(spares)],) for r in range(world_size))


def initial_plan(world_size: int, spares: tuple[str, ...], replicate: bool = True) -> Plan:
    """Worker r is rank r; with snapshots off (replicate=False) spares hold nothing."""
    ranks = tuple(f"w{r}" for r in range(world_size))
    holders = place_replicas(world_size, spares if replicate else ())
    return Plan(generation=0, ranks=ranks, holders=holders, spares=spares, replicate=replicate)


def plan_after_failure(plan: Plan, failed_proc: str, alive: set[str]) -> Decision:
    """Replaces a failed rank with a spare that holds its replica, and re-places all replicas.

    A failed idle spare shrinks the pool; if it held replicas, a new generation re-places them on
    the others (the workers roll back to the last commit); if it held none, the generation stays.
    """
    spares = tuple(s for s in plan.spares if s in alive and s != failed_proc)
    place = spares if plan.replicate else ()
    rank = plan.rank_of(failed_proc)
    if rank is None:
        held = bool(plan.held_by(failed_proc))
        new = Plan(generation=plan.generation + held, ranks=plan.ranks, holders=place_replicas(plan.world_size, place),
                   spares=spares, reason=f"spare {failed_proc} lost; {len(spares)} left", replicate=plan.replicate)
        return Decision(new, new.reason)
    candidates = [s for s in plan.holders[rank] if s in spares]
    if not candidates:
        why = "no spare left in the pool" if not spares else f"no live spare holds rank {rank}'s snapshot"
        return Decision(None, why)
    spare = candidates[0]
    ranks = tuple(spare if r == rank else p for r, p in enumerate(plan.ranks))
    pool = tuple(s for s in spares if s != spare)
    new = Plan(generation=plan.generation + 1, ranks=ranks,
               holders=place_replicas(plan.world_size, pool if plan.replicate else ()), spares=pool,
               reason=f"{failed_proc} (rank {rank}) failed; spare {spare} takes rank {rank}", replicate=plan.replicate)
    return Decision(new, new.reason)


def choose_restore_step(committed: int, holdings: dict[int, list[int]]) -> Decision:
    """The newest step, no newer than the last commit, that every rank holds intact.

    `holdings` maps each rank of the new generation to the snapshot steps it can restore
    (a survivor's local slots, or the activated spare's verified replica slots).
    """
    common = set.intersection(*(set(steps) for steps in holdings.values())) if holdings else set()
    usable = sorted(s for s in common if s <= committed)
    if not usable:
        listing = ", ".join(f"rank {r}: {sorted(s)}" for r, s in sorted(holdings.items()))
        return Decision(None, f"no snapshot at or before committed step {committed} is intact on every rank ({listing})")
    step = usable[-1]
    why = f"restore committed step {step}" if step == committed else (
        f"committed step {committed} is not intact everywhere; fall back to step {step}")
    return Decision(step, why)
