"""Tests for deadpool/coordinator/policy.py: each pure decision, its value and its reason."""

import pytest

from deadpool.coordinator.policy import (Decision, choose_restore_step, describe_exit, initial_plan,
                                         place_replicas, plan_after_failure)
from deadpool.coordinator.protocol import Plan

WORKERS = ("w0", "w1", "w2", "w3")


# ---- describe_exit --------------------------------------------------------------------------

@pytest.mark.parametrize("code, text", [
    (-9, "killed by SIGKILL"),
    (-15, "killed by SIGTERM"),
    (3, "exited with code 3"),
    (0, "exited with code 0"),
    (-999, "killed by signal 999"),  # not a known signal number
])
def test_describe_exit(code, text):
    assert describe_exit(code) == text


# ---- Decision -------------------------------------------------------------------------------

def test_decision_ok_only_with_a_value():
    assert Decision(0, "step zero is a value").ok
    assert not Decision(None, "nothing to do").ok


# ---- place_replicas / initial_plan ----------------------------------------------------------

def test_place_replicas_without_spares_places_nothing():
    assert place_replicas(3, ()) == ((), (), ())


def test_place_replicas_one_spare_holds_every_rank():
    assert place_replicas(3, ("s0",)) == (("s0",), ("s0",), ("s0",))


def test_place_replicas_two_spares_round_robin():
    assert place_replicas(5, ("s0", "s1")) == (("s0",), ("s1",), ("s0",), ("s1",), ("s0",))


def test_initial_plan():
    assert initial_plan(4, ("s0", "s1")) == Plan(
        generation=0, ranks=WORKERS, holders=(("s0",), ("s1",), ("s0",), ("s1",)), spares=("s0", "s1"),
        reason="job start")


def test_initial_plan_without_replication_has_no_holders_but_keeps_spares():
    assert initial_plan(2, ("s0",), replicate=False) == Plan(
        generation=0, ranks=("w0", "w1"), holders=((), ()), spares=("s0",), reason="job start", replicate=False)


# ---- plan_after_failure ---------------------------------------------------------------------

def test_worker_failure_is_taken_over_by_its_holder():
    plan = initial_plan(4, ("s0", "s1", "s2"))  # holders: s0, s1, s2, s0
    everyone = set(WORKERS) - {"w1"} | {"s0", "s1", "s2"}
    decision = plan_after_failure(plan, "w1", everyone)
    reason = "w1 (rank 1) failed; spare s1 takes rank 1"
    assert decision == Decision(Plan(
        generation=1, ranks=("w0", "s1", "w2", "w3"),
        holders=(("s0",), ("s2",), ("s0",), ("s2",)),  # re-placed round robin on the remaining pool
        spares=("s0", "s2"), reason=reason), reason)


def test_last_spare_takes_over_and_leaves_no_holders():
    plan = initial_plan(2, ("s0",))
    decision = plan_after_failure(plan, "w0", {"w1", "s0"})
    reason = "w0 (rank 0) failed; spare s0 takes rank 0"
    assert decision == Decision(Plan(generation=1, ranks=("s0", "w1"), holders=((), ()), spares=(),
                                     reason=reason), reason)


def test_generation_counts_on_from_the_failed_plan():
    plan = Plan(generation=5, ranks=("w0", "s0"), holders=(("s1",), ("s1",)), spares=("s1",))
    decision = plan_after_failure(plan, "s0", {"w0", "s1"})  # s0 is rank 1 now: a worker failure
    assert decision.value == Plan(generation=6, ranks=("w0", "s1"), holders=((), ()), spares=(),
                                  reason="s0 (rank 1) failed; spare s1 takes rank 1")


def test_worker_failure_with_no_spare_left():
    plan = initial_plan(2, ())
    assert plan_after_failure(plan, "w1", {"w0"}) == Decision(None, "no spare left in the pool")


def test_worker_failure_with_only_dead_spares():
    plan = initial_plan(2, ("s0",))
    assert plan_after_failure(plan, "w1", {"w0"}) == Decision(None, "no spare left in the pool")


def test_live_spare_that_is_not_the_holder_cannot_take_over():
    plan = initial_plan(2, ("s0", "s1"))  # rank 0 -> s0, rank 1 -> s1
    # s0, rank 0's only holder, is dead; s1 is alive but holds rank 1, not rank 0.
    decision = plan_after_failure(plan, "w0", {"w1", "s1"})
    assert decision == Decision(None, "no live spare holds rank 0's snapshot")


def test_spare_without_replicas_cannot_take_over_when_snapshots_are_off():
    plan = initial_plan(2, ("s0",), replicate=False)
    assert plan_after_failure(plan, "w0", {"w1", "s0"}) == Decision(None, "no live spare holds rank 0's snapshot")


def test_dead_holder_is_skipped_for_a_live_one():
    plan = Plan(generation=0, ranks=("w0", "w1"), holders=(("s0", "s1"), ("s0", "s1")), spares=("s0", "s1"))
    decision = plan_after_failure(plan, "w0", {"w1", "s1"})  # s0, the first holder, is dead
    reason = "w0 (rank 0) failed; spare s1 takes rank 0"
    assert decision == Decision(Plan(generation=1, ranks=("s1", "w1"), holders=((), ()), spares=(),
                                     reason=reason), reason)


def test_first_live_holder_in_holder_order_is_chosen():
    plan = Plan(generation=0, ranks=("w0",), holders=(("s1", "s0"),), spares=("s0", "s1"))
    decision = plan_after_failure(plan, "w0", {"s0", "s1"})
    assert decision.value.ranks == ("s1",) and decision.value.spares == ("s0",)
    assert decision.reason == "w0 (rank 0) failed; spare s1 takes rank 0"


def test_failed_idle_spare_shrinks_the_pool():
    plan = initial_plan(4, ("s0", "s1", "s2"))
    decision = plan_after_failure(plan, "s1", set(WORKERS) | {"s0", "s2"})
    reason = "spare s1 lost; 2 left"
    assert decision == Decision(Plan(
        generation=1, ranks=WORKERS, holders=(("s0",), ("s2",), ("s0",), ("s2",)), spares=("s0", "s2"),
        reason=reason), reason)


def test_failed_spare_that_is_still_listed_alive_is_removed():
    # The agent may not have reaped the spare yet: the failed process must leave the pool regardless.
    plan = initial_plan(2, ("s0", "s1"))
    decision = plan_after_failure(plan, "s0", {"w0", "w1", "s0", "s1"})
    assert decision.value.spares == ("s1",) and decision.value.holders == (("s1",), ("s1",))
    assert decision.reason == "spare s0 lost; 1 left"


def test_last_spare_lost_leaves_an_empty_pool():
    plan = initial_plan(2, ("s0",))
    reason = "spare s0 lost; 0 left"
    assert plan_after_failure(plan, "s0", {"w0", "w1"}) == Decision(Plan(
        generation=1, ranks=("w0", "w1"), holders=((), ()), spares=(), reason=reason), reason)


def test_spare_failure_also_drops_other_dead_spares():
    plan = initial_plan(2, ("s0", "s1", "s2"))
    decision = plan_after_failure(plan, "s0", {"w0", "w1", "s2"})  # s1 died too, unseen so far
    assert decision == Decision(Plan(generation=1, ranks=("w0", "w1"), holders=(("s2",), ("s2",)), spares=("s2",),
                                     reason="spare s0 lost; 1 left"), "spare s0 lost; 1 left")


def test_spare_loss_keeps_snapshots_off():
    plan = initial_plan(2, ("s0", "s1"), replicate=False)
    decision = plan_after_failure(plan, "s1", {"w0", "w1", "s0"})
    assert decision.value.holders == ((), ())


# ---- choose_restore_step --------------------------------------------------------------------

def test_restore_committed_step_held_by_all():
    assert choose_restore_step(7, {0: [6, 7], 1: [7, 6], 2: [7]}) == Decision(7, "restore committed step 7")


def test_fall_back_to_older_common_step():
    decision = choose_restore_step(7, {0: [6, 7], 1: [6]})
    assert decision == Decision(6, "committed step 7 is not intact everywhere; fall back to step 6")


def test_fall_back_picks_newest_common_step():
    decision = choose_restore_step(9, {0: [3, 5, 8], 1: [5, 3, 9], 2: [3, 5]})
    assert decision == Decision(5, "committed step 9 is not intact everywhere; fall back to step 5")


def test_steps_newer_than_committed_are_never_chosen():
    # Everyone holds 8, but only 7 is committed: 8 may not be held by some rank that already failed.
    assert choose_restore_step(7, {0: [7, 8], 1: [8, 7]}) == Decision(7, "restore committed step 7")
    decision = choose_restore_step(7, {0: [6, 8], 1: [8, 6]})
    assert decision == Decision(6, "committed step 7 is not intact everywhere; fall back to step 6")


def test_nothing_in_common_lists_the_holdings():
    decision = choose_restore_step(7, {1: [7, 6], 0: [5]})
    assert decision == Decision(
        None, "no snapshot at or before committed step 7 is intact on every rank (rank 0: [5], rank 1: [6, 7])")


def test_only_newer_common_steps_is_nothing():
    decision = choose_restore_step(4, {0: [5], 1: [5]})
    assert decision == Decision(
        None, "no snapshot at or before committed step 4 is intact on every rank (rank 0: [5], rank 1: [5])")


def test_nothing_committed_yet():
    decision = choose_restore_step(-1, {0: [], 1: [1]})
    assert decision == Decision(
        None, "no snapshot at or before committed step -1 is intact on every rank (rank 0: [], rank 1: [1])")


def test_no_holdings_at_all():
    assert choose_restore_step(3, {}) == Decision(
        None, "no snapshot at or before committed step 3 is intact on every rank ()")
