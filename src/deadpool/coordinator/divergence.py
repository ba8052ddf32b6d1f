"""The divergence check (pure): data-parallel replicas must stay bit-identical, and the ranks' durable reports say
whether they did. Whole snapshots carry each rank's fingerprint of its replicated state; sliced ones
(runtime/pieces.py) carry the hash of the rank's own piece and an audit of another rank's piece."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from deadpool.coordinator.policy import Durable


@dataclass(frozen=True)
class Divergence:
    """Data-parallel replicas that should be bit-identical are not: at `step`, each group of ranks holds
    one fingerprint of its parameters and optimizer state; `agreed` is the last step checked equal."""

    step: int
    groups: tuple[tuple[int, ...], ...]  # the largest group first
    agreed: int | None


@dataclass(frozen=True)
class ReplicaCheck:
    agreed: int | None  # the newest step whose fingerprints every rank reported equal
    divergence: Divergence | None
    reason: str


DIVERGENCE_CAUSES = (
    "state the training step keeps outside what DeadPool snapshots (a Python counter driving the learning "
    "rate, a prefetched batch: assign it in the step function with `nonlocal`/`global`, or register it), "
    "randomness from a generator DeadPool does not know, or an update that depends on the rank")


def check_replicas(agreed: int | None, reports: Mapping[int, Durable]) -> ReplicaCheck:
    """Compares, step by step after `agreed`, what every rank reported of its replicated state; stops at the
    first step where they differ. Whole fingerprints must all be equal; sliced (runtime/pieces.py), every
    rank's hash of the piece audited at that step must equal its owner's (compare_audits)."""
    if not reports or any(not r.fingerprints for r in reports.values()):
        return ReplicaCheck(agreed, None, "no fingerprints to compare")
    common = sorted(set.intersection(*(set(r.fingerprints) for r in reports.values())))
    for step in (s for s in common if agreed is None or s > agreed):
        sliced = any(step in r.audits for r in reports.values())  # else whole: all fingerprints must be equal
        groups = compare_audits(step, reports) if sliced else _grouped(
            {rank: report.fingerprints[step] for rank, report in reports.items()})
        if len(groups) > 1:
            others = " and ".join(f"ranks {list(g)}" for g in groups[1:])
            return ReplicaCheck(agreed, Divergence(step, groups, agreed),
                                f"at step {step}, {others} hold different parameters and optimizer state "
                                f"than ranks {list(groups[0])} (last checked equal: step {agreed})")
        agreed = step
    return ReplicaCheck(agreed, None, f"replicas equal up to step {agreed}")


def _grouped(hashes: Mapping[int, int]) -> tuple[tuple[int, ...], ...]:
    """Ranks grouped by the hash they hold, the largest group first."""
    groups: dict[int, list[int]] = {}
    for rank in sorted(hashes):
        groups.setdefault(hashes[rank], []).append(rank)
    return tuple(tuple(g) for g in sorted(groups.values(), key=lambda g: (-len(g), g)))


def compare_audits(step: int, reports: Mapping[int, Durable]) -> tuple[tuple[int, ...], ...]:
    """Sliced: at each snapshot every rank but its owner hashes the same piece of its live replicated state, so
    the N opinions of that piece (the owner's piece hash and the N-1 audits) group the ranks as whole
    fingerprints did: a majority names the odd ranks out. One group of every rank if they all agree (or the
    step carries no audit: a resent snapshot)."""
    opinions: dict[int, dict[int, int]] = {}  # piece -> rank -> its hash of that piece
    for rank in sorted(reports):
        audit = reports[rank].audits.get(step)
        if audit is not None and audit[0] in reports and step in reports[audit[0]].fingerprints:
            piece, seen = audit
            opinions.setdefault(piece, {piece: reports[piece].fingerprints[step]})[rank] = seen
    for piece in sorted(opinions):
        groups = _grouped(opinions[piece])
        if len(groups) > 1:
            return groups
    return (tuple(sorted(reports)),)
