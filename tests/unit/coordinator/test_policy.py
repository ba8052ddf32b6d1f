"""Tests for deadpool/coordinator/policy.py: each pure decision, its value and its reason."""

from dataclasses import replace

import pytest

from deadpool.coordinator.policy import (
    FAILURE,
    FINISHED,
    NO_SPARE,
    SCRIPT_ERROR,
    SPARE_AWAITED,
    Decision,
    Durable,
    abandoned_steps,
    awaited_reports,
    choose_restore_step,
    classify_exit,
    commit_step,
    describe_exit,
    initial_plan,
    node_map,
    node_spares,
    place_devices,
    place_replicas,
    plan_after_failures,
    plan_after_join,
    wait_for_spare,
)
from deadpool.protocol.plan import Plan

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

def test_place_replicas_without_spares_uses_the_next_peer_worker():
    assert place_replicas(("w0", "w1", "w2"), (), 1, {}).value == (("w1",), ("w2",), ("w0",))


def test_place_replicas_one_spare_holds_every_rank():
    assert place_replicas(("w0", "w1", "w2"), ("s0",), 1, {}).value == (("s0",), ("s0",), ("s0",))


def test_place_replicas_two_spares_round_robin():
    decision = place_replicas(tuple(f"w{r}" for r in range(5)), ("s0", "s1"), 1, {})
    assert decision == Decision((("s0",), ("s1",), ("s0",), ("s1",), ("s0",)), "1 holder(s) per rank, spares first")


NODES = {"w0": 0, "w1": 0, "w2": 1, "w3": 1, "s0": 2, "s1": 2, "s2": 3, "s3": 3}


def test_place_replicas_two_copies_on_two_spare_nodes_before_a_second_on_one():
    holders = place_replicas(("w0", "w1", "w2", "w3"), ("s0", "s1", "s2", "s3"), 2, NODES).value
    assert holders == (("s0", "s2"), ("s1", "s2"), ("s2", "s0"), ("s3", "s0"))
    assert all(len({NODES[h] for h in pair}) == 2 for pair in holders)  # one spare node's loss leaves a copy


def test_place_replicas_fills_up_with_peer_workers_on_other_nodes_when_spares_run_short():
    holders = place_replicas(("w0", "w1", "w2", "w3"), ("s0",), 2, NODES).value
    assert holders == (("s0", "w2"), ("s0", "w3"), ("s0", "w0"), ("s0", "w1"))
    # each peer holds one rank: a lost node's two ranks stream from two peers, not both from one
    assert place_replicas(("w0", "w1", "w2", "w3"), (), 1, NODES).value == (("w2",), ("w3",), ("w0",), ("w1",))


def test_place_replicas_never_on_the_own_node_and_says_when_short():
    decision = place_replicas(("w0", "w1"), (), 1, {"w0": 0, "w1": 0})  # one node: nowhere else to go
    assert decision == Decision(((), ()), "ranks [0, 1] have fewer than 1 holder(s): no more processes off their nodes")


def test_initial_plan():
    assert initial_plan(4, ("s0", "s1")) == Plan(
        generation=0, ranks=WORKERS, holders=(("s0",), ("s1",), ("s0",), ("s1",)), spares=("s0", "s1"),
        reason="job start")


def test_initial_plan_without_replication_has_no_holders_but_keeps_spares():
    assert initial_plan(2, ("s0",), replicate=False) == Plan(
        generation=0, ranks=("w0", "w1"), holders=((), ()), spares=("s0",), reason="job start", replicate=False)


# ---- plan_after_failures --------------------------------------------------------------------

def test_worker_failure_is_taken_over_by_its_holder_and_only_its_rank_gets_a_new_one():
    plan = initial_plan(4, ("s0", "s1", "s2"))  # holders: s0, s1, s2, s0
    decision = plan_after_failures(plan, 0, frozenset({"w1"}))
    reason = "w1 (rank 1) failed; s1 takes rank 1; holders kept for 3 of 4 ranks; rank 1 gets s2"
    assert decision == Decision(Plan(
        generation=1, ranks=("w0", "s1", "w2", "w3"),
        holders=(("s0",), ("s2",), ("s2",), ("s0",)),  # rank 1's holder is its process now: s2 holds fewer
        spares=("s0", "s2"), reason=reason, sources=(None, None, None, None),
        fresh=((), ("s2",), (), ())), reason)  # one resend of the restored snapshot (three by rotation)


def test_last_spare_takes_over_and_leaves_no_holders():
    plan = initial_plan(2, ("s0",))
    decision = plan_after_failures(plan, 0, frozenset({"w0"}))
    reason = "w0 (rank 0) failed; s0 takes rank 0; holders kept for 1 of 2 ranks; rank 0 gets w1"
    assert decision == Decision(Plan(generation=1, ranks=("s0", "w1"), holders=(("w1",), ("s0",)), spares=(),
                                     reason=reason, sources=(None, None), fresh=(("w1",), ())),
                                reason)  # the ranks hold each other's; s0 still holds rank 1's replica


def test_generation_counts_on_from_the_newest_published():
    plan = Plan(generation=5, ranks=("w0", "s0"), holders=(("s1",), ("s1",)), spares=("s1",))
    decision = plan_after_failures(plan, 5, frozenset({"s0"}))  # s0 is rank 1 now: a worker failure
    assert decision.value == Plan(generation=6, ranks=("w0", "s1"), holders=(("s1",), ("w0",)), spares=(),
                                  reason="s0 (rank 1) failed; s1 takes rank 1; holders kept for 1 of 2 ranks; "
                                         "rank 1 gets w0", sources=(None, None),
                                  fresh=((), ("w0",)))


def test_two_failures_whose_replicas_share_a_holder_stream_one_to_the_other_spare():
    """The bug this policy fixes: ranks 0 and 2 both replicate to s0; s1 takes rank 2 from s0's copy."""
    plan = initial_plan(3, ("s0", "s1"))  # holders: s0, s1, s0
    decision = plan_after_failures(plan, 0, frozenset({"w0", "w2"}))
    reason = ("w0 (rank 0), w2 (rank 2) failed; s0 takes rank 0, s1 takes rank 2 (from s0's replica); "
              "holders kept for 2 of 3 ranks; rank 0 gets w1")
    assert decision == Decision(Plan(generation=1, ranks=("s0", "w1", "s1"), holders=(("w1",), ("s1",), ("s0",)),
                                     spares=(), reason=reason, sources=(None, None, "s0"),
                                     fresh=(("w1",), (), ())), reason)  # s1, s0 keep ranks 1, 2's copies
    assert decision.value.sends_from("s0") == [2]


@pytest.mark.parametrize("lost", [{"w0", "w1"}, {"w0", "w2"}, {"w1", "w2"}])
def test_any_pair_of_a_three_rank_job_survives_with_two_spares(lost):
    decision = plan_after_failures(initial_plan(3, ("s0", "s1")), 0, frozenset(lost))
    plan = decision.value
    assert plan is not None and set(plan.ranks) == {"w0", "w1", "w2", "s0", "s1"} - lost
    for rank, proc in enumerate(plan.ranks):  # every taker has its state: held, or streamed from a holder
        if proc.startswith("s"):
            assert proc in initial_plan(3, ("s0", "s1")).holders[rank] or plan.sources[rank] is not None


def test_all_ranks_lost_at_once_with_as_many_spares():
    decision = plan_after_failures(initial_plan(3, ("s0", "s1", "s2")), 0, frozenset({"w0", "w1", "w2"}))
    assert decision.value.ranks == ("s0", "s1", "s2") and decision.value.sources == (None, None, None)


def test_failures_during_a_recovery_are_planned_from_the_steady_plan():
    steady = initial_plan(3, ("s0", "s1"))
    first = plan_after_failures(steady, 0, frozenset({"w1"})).value  # generation 1: s1 takes rank 1
    assert first.generation == 1 and first.ranks == ("w0", "s1", "w2")
    decision = plan_after_failures(steady, first.generation, frozenset({"w1", "w2"}))  # w2 dies while recovering
    assert decision.value.generation == 2
    assert decision.value.ranks == ("w0", "s1", "s0") and decision.value.sources == (None, None, None)


def test_worker_failure_with_no_spare_left():
    plan = initial_plan(2, ())
    assert plan_after_failures(plan, 0, frozenset({"w1"})) == Decision(
        None, "w1 (rank 1) failed and no spare is left in the pool")


def test_more_failures_than_spares():
    plan = initial_plan(3, ("s0",))
    assert plan_after_failures(plan, 0, frozenset({"w0", "w2"})) == Decision(
        None, "w2 (rank 2) failed and no spare is left in the pool")


def test_rank_whose_every_holder_is_lost():
    plan = initial_plan(2, ("s0", "s1"))  # rank 0 -> s0, rank 1 -> s1
    decision = plan_after_failures(plan, 0, frozenset({"w0", "s0"}))
    assert decision == Decision(None, "w0 (rank 0) failed and every holder of its replica (s0) is lost too; "
                                      "--replicas 2 keeps one more copy of each rank, on another node")


def test_every_rank_left_without_a_holder_is_named():
    plan = initial_plan(4, ("s0", "s1"), nodes=NODES)  # ranks 0, 2 -> s0; 1, 3 -> s1 (all on node 2)
    decision = plan_after_failures(plan, 0, frozenset({"w0", "w1", "s0", "s1"}))
    assert decision == Decision(None, "w0 (rank 0), w1 (rank 1) failed and every holder of their replicas (s0, s1) "
                                      "is lost too; --replicas 2 keeps one more copy of each rank, on another node")


def test_with_two_replicas_a_rank_survives_losing_one_holder_with_it():
    plan = initial_plan(2, ("s0", "s1"), replicas=2)  # rank 0 -> s0, s1; rank 1 -> s1, s0
    decision = plan_after_failures(plan, 0, frozenset({"w0", "s0"}))
    assert decision.value is not None and decision.value.ranks == ("s1", "w1")
    assert decision.value.holders == (("w1",), ("s1",)) and decision.value.replicas == 2  # short of 2: nobody else


def test_node_map_puts_workers_then_spares_on_nodes_of_nproc():
    assert node_map(4, 4, 2) == NODES and node_map(4, 1, 0) == {}


def test_spare_without_replicas_cannot_take_over_when_snapshots_are_off():
    plan = initial_plan(2, ("s0",), replicate=False)
    assert plan_after_failures(plan, 0, frozenset({"w0"})) == Decision(
        None, "w0 (rank 0) failed and snapshots are off (--snapshot-every 0), so nobody holds its state")


def test_dead_holder_is_skipped_for_a_live_one():
    plan = Plan(generation=0, ranks=("w0", "w1"), holders=(("s0", "s1"), ("s0", "s1")), spares=("s0", "s1"))
    decision = plan_after_failures(plan, 0, frozenset({"w0", "s0"}))  # s0, the first holder, is dead
    assert decision.value.ranks == ("s1", "w1") and decision.value.sources == (None, None)


def test_first_live_holder_in_holder_order_is_chosen():
    plan = Plan(generation=0, ranks=("w0",), holders=(("s1", "s0"),), spares=("s0", "s1"))
    decision = plan_after_failures(plan, 0, frozenset({"w0"}))
    assert decision.value.ranks == ("s1",) and decision.value.spares == ("s0",)
    assert decision.reason == "w0 (rank 0) failed; s1 takes rank 0; holders kept for every rank"  # s0 holds it


def test_failed_spare_with_replicas_starts_a_generation_to_place_its_ranks_anew():
    plan = initial_plan(4, ("s0", "s1", "s2"))  # holders: s0, s1, s2, s0
    decision = plan_after_failures(plan, 0, frozenset({"s1"}))
    reason = "spare s1 lost; 2 left; holders kept for 3 of 4 ranks; rank 1 gets s2"
    assert decision == Decision(Plan(
        generation=1, ranks=WORKERS, holders=(("s0",), ("s2",), ("s2",), ("s0",)), spares=("s0", "s2"),
        reason=reason, fresh=((), ("s2",), (), ())), reason)  # only the rank s1 held is resent


def test_failed_spare_without_replicas_only_shrinks_the_pool():
    plan = initial_plan(1, ("s0", "s1"))  # s1 holds nothing
    decision = plan_after_failures(plan, 0, frozenset({"s1"}))
    assert decision.value.generation == 0 and decision.value.spares == ("s0",)


def test_spare_without_replicas_lost_during_a_recovery_still_gets_a_generation():
    plan = initial_plan(1, ("s0", "s1", "s2"))  # s0 holds rank 0
    decision = plan_after_failures(plan, 1, frozenset({"w0", "s2"}))  # generation 1 was recovering
    assert decision.value.generation == 2 and decision.value.ranks == ("s0",) and decision.value.spares == ("s1",)


def test_spare_loss_keeps_snapshots_off():
    plan = initial_plan(2, ("s0", "s1"), replicate=False)
    decision = plan_after_failures(plan, 0, frozenset({"s1"}))
    assert decision.value.holders == ((), ())


# ---- sticky placement: holders that are still valid stay, only the missing ones are placed -----------

ONE_SPARE_NODE = node_map(4, 2, 2)  # workers on nodes 0, 1; spares s0, s1 on node 2


def test_a_previous_holder_stays_unless_lost_on_the_ranks_node_or_a_peer_where_a_spare_can_hold():
    decision = place_replicas(("w0", "s1", "w2", "w3"), ("s0", "s2"), 1, NODES,
                              previous=(("s3",), ("s0",), ("s1",), ("s2",)))
    # rank 0: s3 is lost; rank 1: s1 now runs it on node 2, where s0 is; rank 2: s1 is a rank, spares are idle
    assert decision == Decision((("s0",), ("s2",), ("s0",), ("s2",)),
                                "holders kept for 1 of 4 ranks; rank 0 gets s0, rank 1 gets s2, rank 2 gets s0")


def test_a_lost_node_moves_only_its_ranks_holders():
    plan = initial_plan(4, ("s0", "s1", "s2", "s3"), nodes=NODES)  # holders: s0, s1, s2, s3
    decision = plan_after_failures(plan, 0, frozenset({"w2", "w3"}))
    reason = ("w2 (rank 2), w3 (rank 3) failed; s2 takes rank 2, s3 takes rank 3; holders kept for 2 of 4 ranks; "
              "rank 2 gets s0, rank 3 gets s1")
    assert decision == Decision(Plan(
        generation=1, ranks=("w0", "w1", "s2", "s3"), holders=(("s0",), ("s1",), ("s0",), ("s1",)),
        spares=("s0", "s1"), reason=reason, sources=(None, None, None, None), nodes=NODES,
        fresh=((), (), ("s0",), ("s1",))), reason)  # their holders became their processes: nothing else moves


def test_with_two_replicas_only_the_copy_that_took_the_rank_is_replaced():
    plan = initial_plan(4, ("s0", "s1", "s2", "s3"), replicas=2, nodes=NODES)  # (s0 s2) (s1 s2) (s2 s0) (s3 s0)
    decision = plan_after_failures(plan, 0, frozenset({"w1"}))
    reason = "w1 (rank 1) failed; s1 takes rank 1; holders kept for 3 of 4 ranks; rank 1 gets s3"
    assert decision == Decision(Plan(
        generation=1, ranks=("w0", "s1", "w2", "w3"), holders=(("s0", "s2"), ("s2", "s3"), ("s2", "s0"), ("s3", "s0")),
        spares=("s0", "s2", "s3"), reason=reason, sources=(None, None, None, None), replicas=2, nodes=NODES,
        fresh=((), ("s3",), (), ())), reason)  # s1 runs rank 1 on node 2 now: its copies go to node 3 only
    # placed anew by rotation, ranks 1, 2 and 3 would each have had a new holder to send to


def test_a_spare_that_took_a_rank_holds_its_peers_only_when_spares_run_short():
    """Rank 1's taker s1 shares node 2 with the last spare, so a peer (w2) holds rank 1; rank 3 leaves s1
    for s0, since an idle spare comes before a peer. When rank 1 fails again, s0 takes it from w2's copy
    and holds its peers' as a worker now: every holder is still valid, nobody resends anything."""
    first = plan_after_failures(initial_plan(4, ("s0", "s1"), nodes=ONE_SPARE_NODE), 0, frozenset({"w1"}))
    assert first.value.holders == (("s0",), ("w2",), ("s0",), ("s0",))
    assert first.value.fresh == ((), ("w2",), (), ("s0",))
    assert first.reason == "w1 (rank 1) failed; s1 takes rank 1; holders kept for 2 of 4 ranks; rank 1 gets w2, " \
                           "rank 3 gets s0"
    second = plan_after_failures(first.value, 1, frozenset({"s1"}))
    reason = "s1 (rank 1) failed; s0 takes rank 1 (from w2's replica); holders kept for every rank"
    assert second == Decision(Plan(
        generation=2, ranks=("w0", "s0", "w2", "w3"), holders=(("s0",), ("w2",), ("s0",), ("s0",)), spares=(),
        reason=reason, sources=(None, "w2", None, None), nodes=ONE_SPARE_NODE), reason)  # fresh: () (rotation: 1)


# ---- the pool over time: spare nodes that join, and waiting for one -----------------------

EMPTY_POOL = Plan(generation=1, ranks=("w0", "w1", "s0", "s1"), holders=(("s0",), ("s1",), ("w0",), ("w1",)),
                  spares=(), nodes={"w0": 0, "w1": 0, "w2": 1, "w3": 1, "s0": 2, "s1": 2})  # node 1 was swapped


def test_a_node_that_joins_gets_the_next_spare_names_and_placeholder_ranks():
    assert node_spares(2, workers=4, nproc_per_node=2) == {"s0": 4, "s1": 5}  # as node_map names spare node 2
    assert node_spares(3, workers=4, nproc_per_node=2) == {"s2": 6, "s3": 7}  # rank 6 // 2: node 3


def test_a_spare_node_that_joins_takes_the_replicas_in_a_new_generation():
    decision = plan_after_join(EMPTY_POOL, 1, {"s2": 3, "s3": 3})
    plan = decision.value
    assert plan.generation == 2 and plan.ranks == EMPTY_POOL.ranks and plan.spares == ("s2", "s3")
    assert plan.holders == (("s2",), ("s3",), ("s2",), ("s3",)) and plan.sources == ()  # off the workers
    assert plan.nodes["s2"] == 3 and decision.reason.startswith("spare node 3 joined (s2, s3); 2 spare(s) in the pool")


def test_a_spare_node_that_joins_relieves_the_peers_and_leaves_the_spares_holders_where_they_are():
    """Peers held only because the pool ran short: the newcomers relieve them. Spares keep what they hold,
    since moving a replica costs a resend and frees nothing."""
    steady = plan_after_failures(initial_plan(4, ("s0", "s1"), nodes=ONE_SPARE_NODE), 0, frozenset({"w1"})).value
    assert steady.holders == (("s0",), ("w2",), ("s0",), ("s0",))  # w2 holds rank 1: s0 shares s1's node
    decision = plan_after_join(steady, 1, {"s2": 3, "s3": 3})
    reason = "spare node 3 joined (s2, s3); 3 spare(s) in the pool; holders kept for 3 of 4 ranks; rank 1 gets s2"
    assert decision == Decision(replace(
        steady, generation=2, holders=(("s0",), ("s2",), ("s0",), ("s0",)), spares=("s0", "s2", "s3"),
        nodes={**ONE_SPARE_NODE, "s2": 3, "s3": 3}, sources=(), reason=reason, fresh=((), ("s2",), (), ())), reason)


def test_a_join_that_moves_no_holder_resends_nothing():
    """The new generation is still published (the newcomer learns from its plan that it is in the pool),
    but no rank sends its restored snapshot anywhere."""
    decision = plan_after_join(initial_plan(2, ("s0",)), 0, {"s1": 1})
    reason = "spare node 1 joined (s1); 2 spare(s) in the pool; holders kept for every rank"
    assert decision == Decision(Plan(generation=1, ranks=("w0", "w1"), holders=(("s0",), ("s0",)),
                                     spares=("s0", "s1"), nodes={"s1": 1}, reason=reason), reason)


def test_a_join_with_snapshots_off_grows_the_pool_without_a_new_generation():
    plan = initial_plan(2, (), replicate=False)
    assert plan_after_join(plan, 0, {"s0": 1}).value == Plan(generation=0, ranks=("w0", "w1"), holders=((), ()),
                                                             spares=("s0",), replicate=False, nodes={"s0": 1},
                                                             reason="spare node 1 joined (s0); 1 spare(s) in the pool")
    assert plan_after_join(plan, 0, {}) == Decision(None, "no spare joined")


def test_no_spare_left_waits_for_a_spare_node_then_stops_naming_the_node_its_ranks():
    lost = frozenset({"w0", "w1"})  # node 0, after node 1 already used the pool up
    assert wait_for_spare(EMPTY_POOL, lost, 0.0, 30.0) == Decision(
        SPARE_AWAITED, "node 0 (ranks 0, 1) was lost and no spare is left in the pool: waiting up to 30.0 s for "
                       "a spare node to join")
    assert wait_for_spare(EMPTY_POOL, lost, 30.0, 30.0) == Decision(
        NO_SPARE, "node 0 (ranks 0, 1) was lost and no spare is left in the pool, and no spare node joined within "
                  "--spare-wait 30 s")
    assert wait_for_spare(EMPTY_POOL, lost, 0.0, 0.0).value == NO_SPARE


def test_waiting_is_not_the_question_when_the_pool_suffices_or_a_replica_is_lost():
    assert wait_for_spare(initial_plan(2, ("s0",)), frozenset({"w1"}), 0.0, 30.0).value is None
    orphan = wait_for_spare(EMPTY_POOL, frozenset({"w0", "s0"}), 0.0, 30.0)  # s0 held rank 0's only copy
    assert orphan == Decision(None, "ranks [0, 2] have no live holder of their replica: a spare that joins could "
                                    "not restore them")


# ---- classify_exit --------------------------------------------------------------------------

@pytest.mark.parametrize("code, kw, verdict", [
    (0, dict(fenced=False, started=True, script_error=None), (FINISHED, "exited with code 0")),
    (-9, dict(fenced=False, started=True, script_error=None), (FAILURE, "killed by SIGKILL")),
    (-9, dict(fenced=True, started=True, script_error=None), (FAILURE, "hung, and fenced (SIGKILL)")),
    (1, dict(fenced=False, started=True, script_error="ValueError: bad"),
     (SCRIPT_ERROR, "the training script raised ValueError: bad")),
    (1, dict(fenced=False, started=False, script_error=None),
     (SCRIPT_ERROR, "the training script exited with code 1 before deadpool.init()")),
    (1, dict(fenced=False, started=True, script_error=None), (FAILURE, "exited with code 1")),
    (-11, dict(fenced=False, started=False, script_error=None), (FAILURE, "killed by SIGSEGV")),
])
def test_classify_exit(code, kw, verdict):
    assert classify_exit(code, **kw) == Decision(*verdict)


# ---- commit_step / abandoned_steps ----------------------------------------------------------

def test_commit_the_newest_step_durable_everywhere():
    reports = {0: Durable(steps=(4, 5)), 1: Durable(steps=(5, 4)), 2: Durable(steps=(4,))}
    assert commit_step(3, reports) == Decision(4, "step 4 is durable on all 3 ranks")


def test_nothing_new_to_commit():
    assert commit_step(5, {0: Durable(steps=(5,)), 1: Durable(steps=(5,))}) == Decision(
        None, "no newer step is durable on every rank")


def test_first_commit_of_step_zero():
    assert commit_step(None, {0: Durable(steps=(0,))}).value == 0


def test_skipped_steps_are_abandoned_and_never_committed():
    reports = {0: Durable(steps=(4, 5)), 1: Durable(steps=(4, 6), skipped=(5,))}
    assert commit_step(3, reports).value == 4
    assert abandoned_steps(4, reports) == [5]
    assert abandoned_steps(5, reports) == []


def test_the_reports_awaited_are_those_lacking_the_newest_step_else_every_rank():
    """Rank 2 lags behind step 5: only its report can let anything more be committed; once every rank holds
    step 5, each must report step 6 first. A rank that never reported holds nothing, so it lags."""
    assert awaited_reports({0: Durable(steps=(4, 5)), 1: Durable(steps=(5, 4)), 2: Durable(steps=(3, 4))}, 3) == {2}
    assert awaited_reports({0: Durable(steps=(4, 5)), 1: Durable(steps=(4, 5))}, 3) == {2}
    assert awaited_reports({0: Durable(steps=(4, 5)), 1: Durable(steps=(5,), skipped=(4,))}, 2) == {0, 1}
    assert awaited_reports({}, 2) == {0, 1}


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
    assert choose_restore_step(None, {0: [], 1: [1]}) == Decision(None, "no snapshot was committed yet")


def test_no_holdings_at_all():
    assert choose_restore_step(3, {}) == Decision(
        None, "no snapshot at or before committed step 3 is intact on every rank ()")


# ---- place_devices -----------------------------------------------------------------------------

def test_every_process_gets_its_own_gpu_when_there_are_enough():
    decision = place_devices(workers=4, spares=2, gpus=8)
    assert decision.value == (0, 1, 2, 3, 4, 5) and "one GPU per process" in decision.reason


def test_spares_take_the_gpus_left_and_the_rest_inherit():
    decision = place_devices(workers=3, spares=3, gpus=4)
    assert decision.value == (0, 1, 2, 3, None, None)
    assert "2 of 3 spares have no GPU" in decision.reason and "rank they replace" in decision.reason
    assert place_devices(workers=1, spares=1, gpus=1).value == (0, None)  # the GPU check: one H200


def test_no_gpu_means_the_cpu_for_everyone():
    decision = place_devices(workers=2, spares=1, gpus=0)
    assert decision.value == (None, None, None) and "CPU" in decision.reason


def test_fewer_gpus_than_workers_is_refused_with_what_to_do():
    decision = place_devices(workers=4, spares=1, gpus=2)
    assert not decision.ok
    assert "4 workers need 4 GPUs" in decision.reason and "--workers 2" in decision.reason
