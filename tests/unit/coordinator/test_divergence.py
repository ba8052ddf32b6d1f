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

def _sliced(step: int, pieces: list[int], audits: list[tuple[int, int]]) -> dict[int, Durable]:
    """Each rank's piece hash at `step` and its audit (rank audited, hash it computed)."""
    return {rank: Durable(steps=(step,), fingerprints={step: piece}, audits={step: audit})
            for rank, (piece, audit) in enumerate(zip(pieces, audits))}


def test_audits_that_equal_the_owners_pieces_agree():
    reports = _sliced(4, [10, 11, 12], [(1, 11), (2, 12), (0, 10)])
    assert compare_audits(4, reports) == ((0, 1, 2),)
    check = check_replicas(3, reports)
    assert (check.agreed, check.divergence) == (4, None)


def test_pieces_are_never_compared_with_each_other():
    """Sliced, every rank's piece hash differs from the others' (other bytes): only audits are compared."""
    reports = _sliced(4, [10, 11], [(1, 11), (0, 10)])
    assert check_replicas(None, reports).divergence is None


def test_a_rank_whose_whole_state_differs_fails_both_its_comparisons_and_is_named():
    """Rank 1 diverged: its piece disagrees with rank 0's audit of it, and its audit of rank 2's piece with
    rank 2's hash; rank 2's audit of rank 0 matches."""
    reports = _sliced(6, [10, 99, 12], [(1, 11), (2, 98), (0, 10)])
    check = check_replicas(5, reports)
    assert check.divergence == Divergence(step=6, groups=((0, 2), (1,)), agreed=5)
    assert "at step 6, ranks [1] hold different parameters and optimizer state than ranks [0, 2]" in check.reason


def test_with_two_ranks_neither_can_be_told_odd():
    reports = _sliced(3, [10, 99], [(1, 11), (0, 98)])
    assert compare_audits(3, reports) == ((0,), (1,))


def test_a_difference_in_one_piece_names_both_sides_of_the_failed_audit():
    """Rank 0's copy of rank 1's piece differs (rank 0's own piece is fine): the one failed comparison cannot
    say which of the two is odd, so both are named apart from the ranks whose comparisons all held."""
    reports = _sliced(2, [10, 11, 12, 13], [(1, 50), (2, 12), (3, 13), (0, 10)])
    assert compare_audits(2, reports) == ((2, 3), (0,), (1,))


def test_an_audit_of_a_rank_without_a_report_is_left_for_later():
    reports = _sliced(2, [10, 11, 12], [(1, 11), (2, 12), (0, 10)])
    reports[3] = Durable(steps=(2,), fingerprints={1: 5})  # has not reported step 2
    reports[0] = Durable(steps=(2,), fingerprints={2: 10}, audits={2: (3, 77)})
    assert compare_audits(2, reports) == ((0, 1, 2, 3),)


def test_the_first_step_with_a_failed_audit_is_the_one_named():
    reports = {rank: Durable(steps=(5, 6), fingerprints={5: 10 + rank, 6: 20 + rank},
                             audits={5: ((rank + 1) % 2, 11 - rank), 6: ((rank + 1) % 2, 21 - rank)})
               for rank in range(2)}
    assert check_replicas(4, reports).agreed == 6
    reports[1] = Durable(steps=(5, 6), fingerprints={5: 11, 6: 21}, audits={5: (0, 10), 6: (0, 0)})
    check = check_replicas(4, reports)
    assert check.divergence == Divergence(step=6, groups=((0,), (1,)), agreed=5)
