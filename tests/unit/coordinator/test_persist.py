"""Tests for deadpool/coordinator/persist.py and the machine's disk tier: orders, reports, finalize, SIGTERM,
with a fake clock."""

from dataclasses import replace

import pytest

from deadpool.config import JobConfig
from deadpool.coordinator.machine import advance, start
from deadpool.coordinator.persist import persist_due, writers_of
from deadpool.coordinator.policy import Durable
from deadpool.coordinator.state import CoordinatorState, Emit, Finalize, Inputs, OrderPersist, Say, Stop
from deadpool.protocol.plan import Plan
from deadpool.protocol.records import PersistOrder, PersistReport

CONFIG = JobConfig(script="train.py", workers=2, spares=1, run_dir="run", persist_dir="ckpt", persist_every=2)


def emitted(effects, name: str) -> list[dict]:
    return [dict(e.fields) for e in effects if isinstance(e, Emit) and e.event == name]


def of(effects, kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


def committing(s: CoordinatorState, step: int, t: float, **more) -> tuple[CoordinatorState, tuple]:
    return advance(s, Inputs(durable={r: Durable(tuple(range(step + 1))) for r in range(2)}, **more), t)


def report(step: int, proc: str, ok: bool = True, error: str = "") -> PersistReport:
    return PersistReport(step, proc, (0, 1), ok, error, nbytes=1000, seconds=0.5)


# ---- the pure rules ---------------------------------------------------------------------------

def test_an_idle_spare_holding_a_rank_writes_it_else_the_rank_itself():
    plan = Plan(0, ranks=("w0", "w1", "w2"), holders=(("s0",), ("w2",), ("s0", "w0")), spares=("s0",))
    assert writers_of(plan) == ("s0", "w1", "s0")
    assert writers_of(plan, lost=frozenset({"w1", "s0"})) == ("w0", "w2", "w2")  # a lost rank: its live holder


@pytest.mark.parametrize("committed,persisted,commits,since,now,due", [
    (None, None, 5, 0.0, 9.0, False),  # nothing committed yet
    (4, 4, 5, 0.0, 9.0, False),        # on disk already
    (4, None, 1, 0.0, 1.0, False),     # one commit of two
    (4, None, 2, 0.0, 1.0, True),      # --persist-every 2
])
def test_persist_due_every_n_commits(committed, persisted, commits, since, now, due):
    assert (persist_due(CONFIG, committed, persisted, commits, since, now).value is True) is due


def test_persist_due_by_interval_too():
    config = replace(CONFIG, persist_every=0, persist_interval_s=30.0)
    assert persist_due(config, 4, None, 1, 0.0, 29.0).value is None
    decision = persist_due(config, 4, None, 1, 0.0, 31.0)
    assert decision.value is True and "30" in decision.reason
    assert persist_due(replace(config, persist_dir=""), 4, None, 9, 0.0, 99.0).value is None


# ---- the machine ------------------------------------------------------------------------------

def test_every_second_commit_is_ordered_then_finalized_once_every_writer_reported():
    s, _ = start(CONFIG)
    s, effects = committing(s, 1, 1.0)
    assert not of(effects, OrderPersist)
    s, effects = committing(s, 2, 2.0)
    assert of(effects, OrderPersist) == [OrderPersist(PersistOrder(2, 0, ("s0", "s0"), s.persisting.reason))]
    assert "2 commits" in s.persisting.reason
    s, effects = advance(s, Inputs(), 2.5)  # no report yet: waits
    assert not of(effects, Finalize) and s.persisting is not None
    s, effects = advance(s, Inputs(persist_reports={"s0": report(2, "s0")}), 3.0)
    assert of(effects, Finalize) == [Finalize(2, 2.0, 1000, 0.5)]
    s, _ = advance(s, Inputs(finalized={2: True}), 3.5)
    assert (s.persisting, s.persisted, s.commits_since_persist) == (None, 2, 0)


def test_a_failed_part_drops_the_order_and_a_later_commit_orders_again():
    s, _ = start(CONFIG)
    s, _ = committing(s, 1, 1.0)
    s, _ = committing(s, 2, 2.0)
    s, effects = advance(s, Inputs(persist_reports={"s0": report(2, "s0", ok=False, error="disk full")}), 3.0)
    assert emitted(effects, "persist_failed") == [{"step": 2, "reason": "s0: disk full"}]
    assert s.persisting is None and s.persisted is None
    s, effects = committing(s, 3, 4.0)
    assert [e.order.step for e in of(effects, OrderPersist)] == [3]


def test_a_writer_that_never_reports_is_given_up_at_the_deadline():
    s, _ = start(CONFIG)
    s, _ = committing(s, 1, 1.0)
    s, _ = committing(s, 2, 2.0)
    s, effects = advance(s, Inputs(), 2.0 + CONFIG.collective_timeout_s + 1)
    assert "did not report" in emitted(effects, "persist_failed")[0]["reason"]
    assert s.persisting is None


def test_reports_of_another_step_do_not_count():
    s, _ = start(CONFIG)
    s, _ = committing(s, 1, 1.0)
    s, _ = committing(s, 2, 2.0)
    s, effects = advance(s, Inputs(persist_reports={"s0": report(1, "s0")}), 3.0)
    assert not of(effects, Finalize) and s.persisting is not None


def test_sigterm_persists_the_newest_commit_then_stops_with_143():
    s, _ = start(CONFIG)
    s, _ = committing(s, 1, 1.0)
    s, effects = advance(s, Inputs(terminate=True), 2.0)
    assert [e.order.step for e in of(effects, OrderPersist)] == [1] and s.exit_code is None
    s, effects = advance(s, Inputs(persist_reports={"s0": report(1, "s0")}), 2.5)
    assert of(effects, Finalize) and s.exit_code is None
    s, effects = advance(s, Inputs(finalized={1: True}), 3.0)
    assert s.exit_code == 143 and of(effects, Stop) == [Stop("terminated", grace_s=0.0)]
    assert emitted(effects, "job_stopped") == [{"by": "SIGTERM", "persisted": 1, "committed": 1}]


def test_a_job_resumed_from_its_persist_dir_does_not_write_that_checkpoint_again():
    s, _ = start(CONFIG, persisted=4)
    s, effects = advance(s, Inputs(durable={r: Durable((4,)) for r in range(2)}), 1.0)
    assert s.committed == 4 and not of(effects, OrderPersist)
    s, effects = advance(s, Inputs(durable={r: Durable((4, 5)) for r in range(2)}), 2.0)
    assert not of(effects, OrderPersist)
    s, effects = advance(s, Inputs(durable={r: Durable((4, 5, 6)) for r in range(2)}), 3.0)
    assert [o.order.step for o in of(effects, OrderPersist)] == [6]  # --persist-every 2 commits after step 4


def test_sigterm_stops_at_the_grace_even_if_the_write_is_not_done():
    s, _ = start(CONFIG)
    s, _ = committing(s, 1, 1.0)
    s, _ = advance(s, Inputs(terminate=True), 2.0)
    s, _ = advance(s, Inputs(), 2.0 + CONFIG.stop_grace_s - 0.1)
    assert s.exit_code is None
    s, effects = advance(s, Inputs(), 2.0 + CONFIG.stop_grace_s + 0.1)
    assert s.exit_code is None and of(effects, Finalize) == [Finalize(1, None, None, None)]  # what the ranks wrote
    s, effects = advance(s, Inputs(finalized={1: False}), 2.0 + CONFIG.stop_grace_s + 0.2)
    assert s.exit_code == 143 and "no complete checkpoint" in s.failure


def test_sigterm_to_every_process_completes_the_checkpoint_from_the_ranks_own_parts():
    s, _ = start(CONFIG)
    s, _ = committing(s, 1, 1.0)
    s, _ = advance(s, Inputs(terminate=True), 2.0)
    s, effects = advance(s, Inputs(persist_reports={"s0": report(1, "s0", ok=False, error="SIGTERM")}), 2.5)
    assert emitted(effects, "persist_failed") and of(effects, Finalize) == [Finalize(1, None, None, None)]
    s, effects = advance(s, Inputs(finalized={1: True}), 3.0)
    assert s.exit_code == 143 and s.persisted == 1 and "step 1 is on disk" in s.failure


def test_sigterm_without_a_disk_tier_stops_at_once_and_says_nothing_was_kept():
    s, _ = start(replace(CONFIG, persist_dir=""))
    s, _ = committing(s, 1, 1.0)
    s, effects = advance(s, Inputs(terminate=True), 2.0)
    assert s.exit_code == 143 and not of(effects, OrderPersist) and "nothing was persisted" in s.failure


def test_the_end_of_the_job_finalizes_the_last_commit_the_ranks_wrote():
    from deadpool.coordinator.state import ExitReport

    s, _ = start(CONFIG)
    s, _ = committing(s, 1, 1.0)
    s, effects = advance(s, Inputs(exits=(ExitReport("w0", 0, 1, True), ExitReport("w1", 0, 2, True))), 2.0)
    assert s.exit_code == 0 and of(effects, Finalize) == [Finalize(1, None, None, None)]


def test_a_rank_lost_with_every_holder_is_taken_over_when_a_checkpoint_is_on_disk():
    from deadpool.coordinator.policy import plan_after_failures

    steady = Plan(0, ranks=("w0", "w1"), holders=(("s0",), ("s1",)), spares=("s0", "s1"))
    assert plan_after_failures(steady, 0, frozenset({"w1", "s1"})).value is None  # nothing to restore it from
    plan = plan_after_failures(steady, 0, frozenset({"w1", "s1"}), disk_step=4).value
    assert plan.ranks == ("w0", "s0") and plan.sources == (None, None)
    assert "every rank restores step 4 from disk" in plan.reason


def test_when_memory_cannot_recover_every_rank_restores_the_newest_checkpoint():
    from deadpool.coordinator.state import ExitReport, WriteTarget

    s, _ = start(CONFIG)
    s = replace(s, persisted=2)
    s, _ = committing(s, 3, 1.0)
    s, _ = advance(s, Inputs(exits=(ExitReport("w1", -9, 9, True),)), 2.0)
    s, _ = advance(s, Inputs(), 2.5)  # settled: s0 takes rank 1 from its replica
    s, effects = advance(s, Inputs(ready={0: [3], 1: []}), 3.0)  # ...but the replica turned out unusable
    assert emitted(effects, "restore_decided")[0]["from_disk"] is True
    assert of(effects, WriteTarget) == [WriteTarget(1, 2)]


# ---- no spare left ---------------------------------------------------------------------------

NODES = replace(CONFIG, spares=0, nproc_per_node=1, spare_wait_s=10.0, store_host="10.0.0.1", store_port=29500)


def test_when_the_spare_wait_runs_out_the_newest_commit_is_persisted_then_the_job_fails_saying_how_to_go_on():
    from deadpool.coordinator.state import ExitReport, Phase

    s, _ = start(NODES)  # two worker nodes, no spare: each worker holds the other's replica
    s, _ = committing(s, 1, 1.0)
    s, _ = advance(s, Inputs(exits=(ExitReport("w1", -9, 9, True),)), 2.0)
    s, _ = advance(s, Inputs(), 2.1)
    assert s.phase is Phase.AWAIT_SPARE and s.exit_code is None
    s, effects = advance(s, Inputs(), 12.1)  # --spare-wait is over: persist before stopping
    assert emitted(effects, "no_spare") and s.exit_code is None and not emitted(effects, "job_failed")
    [ordered] = of(effects, OrderPersist)
    assert (ordered.order.step, ordered.order.writers) == (1, ("w0", "w0"))  # w0 writes rank 1 from its replica
    assert any(e.text.startswith("no spare left: writing step 1 to ckpt before stopping") for e in of(effects, Say))
    s, effects = advance(s, Inputs(persist_reports={"w0": report(1, "w0")}), 13.0)
    assert of(effects, Finalize) and s.exit_code is None
    s, effects = advance(s, Inputs(finalized={1: True}), 13.5)
    assert s.exit_code == 1 and s.persisted == 1 and of(effects, Stop) == [Stop("failed", grace_s=5.0)]
    assert emitted(effects, "job_stopped") == [{"by": "no spare", "persisted": 1, "committed": 1}]
    [failed] = emitted(effects, "job_failed")
    assert failed["reason"].startswith("node 1 (rank 1) was lost and no spare is left in the pool, and no spare node "
                                       "joined within --spare-wait 10 s. Last committed step: 1.")
    assert failed["reason"].endswith("Step 1 is on disk in ckpt; go on from it with the same command and "
                                     "--resume auto.")


def test_with_no_spare_on_one_machine_the_newest_commit_is_persisted_unless_it_is_on_disk_already():
    from deadpool.coordinator.state import ExitReport

    s, _ = start(replace(CONFIG, spares=0))
    s, _ = committing(s, 1, 1.0)
    s = replace(s, persisted=1)  # step 1 is on disk already: nothing to write
    s, _ = advance(s, Inputs(exits=(ExitReport("w1", -9, 9, True),)), 2.0)
    s, effects = advance(s, Inputs(), 2.1)
    assert not of(effects, OrderPersist) and s.exit_code is None
    s, effects = advance(s, Inputs(), 2.2)
    [failed] = emitted(effects, "job_failed")
    assert s.exit_code == 1 and "no spare is left in the pool" in failed["reason"]
    assert "Add spares (--spares)" in failed["reason"] and "Step 1 is on disk in ckpt" in failed["reason"]


def test_with_no_spare_and_no_disk_tier_the_job_fails_at_once():
    from deadpool.coordinator.state import ExitReport

    s, _ = start(replace(NODES, persist_dir="", spare_wait_s=0.0))
    s, _ = committing(s, 1, 1.0)
    s, _ = advance(s, Inputs(exits=(ExitReport("w1", -9, 9, True),)), 2.0)
    s, effects = advance(s, Inputs(), 2.1)
    assert s.exit_code == 1 and not of(effects, OrderPersist) and not emitted(effects, "job_stopped")
