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
    first step where they differ. Whole fingerprints must all be equal; sliced (runtime/pieces.py), each rank's
    audit of another rank's piece must equal that rank's own piece hash (compare_audits)."""
    if not reports or any(not r.fingerprints for r in reports.values()):
        return ReplicaCheck(agreed, None, "no fingerprints to compare")
    common = sorted(set.intersection(*(set(r.fingerprints) for r in reports.values())))
    sliced = any(r.audits for r in reports.values())
    for step in (s for s in common if agreed is None or s > agreed):
        groups = compare_audits(step, reports) if sliced else _equal_groups(step, reports)
        if len(groups) > 1:
            others = " and ".join(f"ranks {list(g)}" for g in groups[1:])
            return ReplicaCheck(agreed, Divergence(step, groups, agreed),
                                f"at step {step}, {others} hold different parameters and optimizer state "
                                f"than ranks {list(groups[0])} (last checked equal: step {agreed})")
        agreed = step
    return ReplicaCheck(agreed, None, f"replicas equal up to step {agreed}")


def _ordered(groups: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in sorted((g for g in groups if g), key=lambda g: (-len(g), g)))


def _equal_groups(step: int, reports: Mapping[int, Durable]) -> tuple[tuple[int, ...], ...]:
    """Whole fingerprints: the ranks grouped by the fingerprint they reported, the largest group first."""
    groups: dict[int, list[int]] = {}
    for rank in sorted(reports):
        groups.setdefault(reports[rank].fingerprints[step], []).append(rank)
    return _ordered(list(groups.values()))


def compare_audits(step: int, reports: Mapping[int, Durable]) -> tuple[tuple[int, ...], ...]:
    """Sliced: one group of every rank if each audit at `step` equals the audited rank's own piece hash.
    Otherwise the odd ranks out each alone, after the others: a rank whose every comparison (its audit, and
    the audits of its piece) failed, or, where no rank failed them all, every rank in a failed one. Each rank
    audits one piece per snapshot and each piece is audited by one rank, so a rank whose whole state differs
    fails both of its comparisons at once and its peers one each; a difference confined to one piece is seen
    when a rank on the other side of it audits that piece, within N-1 snapshots."""
    outcomes: dict[int, list[bool]] = {rank: [] for rank in reports}
    for auditor in sorted(reports):
        audit = reports[auditor].audits.get(step)
        if audit is None or audit[0] not in reports or step not in reports[audit[0]].fingerprints:
            continue  # a resent snapshot has no audit; a rank that reports none yet is compared later
        owner, seen = audit
        equal = seen == reports[owner].fingerprints[step]
        outcomes[auditor].append(equal)
        outcomes[owner].append(equal)
    failed = [rank for rank, results in outcomes.items() if results and not any(results)]
    if not failed:
        failed = [rank for rank, results in outcomes.items() if not all(results)]
    if not failed:
        return (tuple(sorted(reports)),)
    return _ordered([[r for r in sorted(reports) if r not in failed], *([r] for r in sorted(failed))])
