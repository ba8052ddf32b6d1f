"""Tests for deadpool/coordinator/divergence.py: whole fingerprints compared, and sliced pieces audited."""

from deadpool.coordinator.divergence import Divergence, check_replicas, compare_audits
from deadpool.coordinator.policy import Durable


def _fingerprints(*per_rank: dict[int, int]) -> dict[int, Durable]:
    return {rank: Durable(steps=tuple(f), fingerprints=f) for rank, f in enumerate(per_rank)}


def test_equal_fingerprints_advance_the_checked_step():
    reports = _fingerprints({4: 7, 5: 9}, {4: 7, 5: 9}, {5: 9})
    check = check_replicas(None, reports)
    assert (check.agreed, check.divergence) == (5, None)  # step 4 is not reported by rank 2 any more


def test_the_first_differing_step_and_the_groups_are_named():
    reports = _fingerprints({5: 1, 6: 2, 7: 3}, {5: 1, 6: 8, 7: 8}, {5: 1, 6: 2, 7: 3})
    check = check_replicas(4, reports)
    assert check.divergence == Divergence(step=6, groups=((0, 2), (1,)), agreed=5)
    assert check.agreed == 5
    assert "at step 6, ranks [1] hold different parameters and optimizer state than ranks [0, 2]" in check.reason


def test_steps_checked_before_are_not_checked_again():
    reports = _fingerprints({5: 1, 6: 2}, {5: 9, 6: 2})  # step 5 differed, and was reported already
    assert check_replicas(5, reports) == check_replicas(5, reports)
    assert check_replicas(5, reports).divergence is None and check_replicas(5, reports).agreed == 6


def test_without_fingerprints_nothing_is_compared():
    reports = {0: Durable(steps=(3,)), 1: Durable(steps=(3,))}  # not data parallel
    check = check_replicas(2, reports)
    assert (check.agreed, check.divergence) == (2, None)


# ---- sliced: audits -------------------------------------------------------------------------

def _sliced(step: int, pieces: list[int], piece: int, audits: dict[int, int]) -> dict[int, Durable]:
    """Each rank's own piece hash at `step`; every rank but `piece`'s owner audited `piece` (rank -> its hash)."""
    return {rank: Durable(steps=(step,), fingerprints={step: own},
                          audits={step: (piece, audits[rank])} if rank in audits else {})
            for rank, own in enumerate(pieces)}


def test_audits_that_equal_the_owners_piece_agree():
    reports = _sliced(4, [10, 11, 12], piece=1, audits={0: 11, 2: 11})
    assert compare_audits(4, reports) == ((0, 1, 2),)
    check = check_replicas(3, reports)
    assert (check.agreed, check.divergence) == (4, None)


def test_pieces_are_never_compared_with_each_other():
    """Sliced, every rank's own piece hash differs from the others' (other bytes): only audits are compared."""
    reports = _sliced(4, [10, 11], piece=0, audits={1: 10})
    assert check_replicas(None, reports).divergence is None


def test_an_auditor_outvoted_by_the_owner_and_the_other_auditors_is_named():
    """Rank 1's copy of piece 0 differs: rank 2's audit sides with the owner, rank 0."""
    reports = _sliced(6, [10, 11, 12], piece=0, audits={1: 99, 2: 10})
    check = check_replicas(5, reports)
    assert check.divergence == Divergence(step=6, groups=((0, 2), (1,)), agreed=5)
    assert "at step 6, ranks [1] hold different parameters and optimizer state than ranks [0, 2]" in check.reason


def test_an_owner_every_auditor_disagrees_with_is_named():
    reports = _sliced(6, [10, 11, 12, 13], piece=2, audits={0: 7, 1: 7, 3: 7})
    assert compare_audits(6, reports) == ((0, 1, 3), (2,))


def test_with_two_ranks_neither_can_be_told_odd():
    reports = _sliced(3, [10, 11], piece=1, audits={0: 98})
    assert compare_audits(3, reports) == ((0,), (1,))


def test_an_audit_of_a_piece_whose_owner_has_not_reported_the_step_is_left_for_later():
    reports = _sliced(2, [10, 11, 12], piece=1, audits={0: 11, 2: 11})
    reports[3] = Durable(steps=(1,), fingerprints={1: 5})
    reports[0] = Durable(steps=(2,), fingerprints={2: 10}, audits={2: (3, 77)})
    assert compare_audits(2, reports) == ((0, 1, 2, 3),)


def test_the_first_step_with_a_failed_audit_is_the_one_named():
    def report(rank: int, audit5: int, audit6: int) -> Durable:
        audits = {5: (0, audit5), 6: (1, audit6)}
        return Durable(steps=(5, 6), fingerprints={5: 10 + rank, 6: 20 + rank},
                       audits={s: a for s, a in audits.items() if a[0] != rank})
    reports = {0: report(0, 0, 21), 1: report(1, 10, 0), 2: report(2, 10, 21)}
    assert check_replicas(4, reports).agreed == 6
    reports[2] = report(2, 10, 66)
    check = check_replicas(4, reports)
    assert check.divergence == Divergence(step=6, groups=((0, 1), (2,)), agreed=5)


def test_a_step_without_audits_is_compared_whole():
    """A step no rank audited (snapshots taken whole, --slices off) compares the fingerprints themselves."""
    reports = {0: Durable(steps=(5, 6), fingerprints={5: 1, 6: 30}, audits={6: (1, 31)}),
               1: Durable(steps=(5, 6), fingerprints={5: 1, 6: 31})}
    assert check_replicas(4, reports).agreed == 6
    reports[1] = Durable(steps=(5, 6), fingerprints={5: 2, 6: 31})
    assert check_replicas(4, reports).divergence == Divergence(step=5, groups=((0,), (1,)), agreed=4)
