"""Replica placement across nodes (--replicas K): a worker node and the spare node holding its ranks'
only replicas die together, which no spare can recover with one copy and can with two; once the
spares run out, peer workers hold each other's replicas (host memory reported per holder); and holders
that are still valid after a recovery stay, so the restored snapshot is resent only to new ones."""

from __future__ import annotations

import os
import signal

from deadpool.config import Fault
from tests.integration.conftest import Background, Job, run_job
from tests.integration.test_nodes import NODES, assert_same_training

TWO_SPARE_NODES = dict(workers=4, spares=4, nproc_per_node=2, settle_s=0.5)  # nodes 0, 1: workers; 2, 3: spares


def kill_nodes_together(tmp_path, nodes: tuple[int, ...], **job) -> Job:
    """SIGKILLs the agents of `nodes` at once, mid-run (their processes die with them)."""
    running = Background(tmp_path, **TWO_SPARE_NODES, **job)
    events = running.wait_for(lambda e: e["event"] == "step" and e["step"] >= 4)
    [joined] = [e for e in events if e["event"] == "nodes_joined"]
    for node in nodes:
        os.kill(joined["agent_pids"][node], signal.SIGKILL)
    return running.join()


def test_with_one_replica_a_node_and_the_holder_of_its_ranks_cannot_be_recovered(tmp_path):
    job = kill_nodes_together(tmp_path, (0, 2), replicas=1)
    assert job.code == 1
    [plan] = job.named("plan_published")
    assert plan["holders"] == [["s0"], ["s1"], ["s2"], ["s3"]]  # ranks 0 and 1: on spare node 2 only
    error = job.summary["error"]
    assert ("w0 (rank 0), w1 (rank 1) failed and every holder of their replicas (s0, s1) is lost too; "
            "--replicas 2 keeps one more copy of each rank, on another node") in error
    assert "Last committed step: " in error and "--spares" not in error  # more spares would not have helped


def test_with_two_replicas_on_two_spare_nodes_the_same_failure_is_recovered(tmp_path, reference):
    job = kill_nodes_together(tmp_path, (0, 2), replicas=2)
    assert_same_training(job, reference)
    first = job.named("plan_published")[0]
    assert first["holders"] == [["s0", "s2"], ["s1", "s2"], ["s2", "s0"], ["s3", "s0"]]  # two spare nodes each
    [recovery] = job.summary["recoveries"]
    assert recovery["replaced"] == {"0": "s2", "1": "s3"}
    [received] = [e for e in job.named("replica_received") if e["of_rank"] == 1]
    assert received["source"] == "s2"  # s3 held no copy of rank 1: s2 streamed it
    # The pool is empty now: the ranks hold each other's snapshots, on the other node, two copies each.
    last = job.named("plan_published")[-1]
    assert last["holders"] == [["w2", "w3"], ["w3", "w2"], ["s2", "s3"], ["s3", "s2"]]  # first copies spread
    # nodes on one machine (no --netns): holders map their senders' slots, allocating nothing of their own
    own, mapped = job.summary["replica_memory_bytes"], job.summary["replica_mapped_bytes"]
    assert own == {"s2": 0, "s3": 0, "w2": 0, "w3": 0}
    assert sorted(mapped) == ["s2", "s3", "w2", "w3"] and len(set(mapped.values())) == 1
    snapshot = max(e["bytes"] for e in job.named("snapshot"))
    assert mapped["w2"] >= 2 * 2 * snapshot  # two ranks held, two slots each



def test_a_recovery_whose_holders_all_stay_valid_resends_nothing(tmp_path, reference):
    """Rank 1 fails twice (spares s0, s1 on node 2). First s1 takes it; s0 shares s1's node, so peer w2
    becomes rank 1's holder, and rank 3's holder s1 (a rank now) gives way to the idle s0: two resends.
    Then s0 takes rank 1 from w2's copy, and every holder is still valid: nothing is resent."""
    faults = tuple(Fault(kind="kill", rank=1, step=step, phase="backward") for step in (3, 7))
    job = run_job(tmp_path, faults=faults, **NODES)
    assert_same_training(job, reference)
    first, second = job.summary["recoveries"]
    assert first["replaced"] == {"1": "s1"} and second["replaced"] == {"1": "s0"}
    [received] = [e for e in job.named("replica_received") if e["gen"] == 2]
    assert received["source"] == "w2"  # s0 held no copy of rank 1
    plans = job.named("plan_published")
    assert [p["holders"] for p in plans] == [[["s0"], ["s1"], ["s0"], ["s1"]]] + [[["s0"], ["w2"], ["s0"], ["s0"]]] * 2
    resent = sorted((e["gen"], e["rank"], e["holders"]) for e in job.named("snapshot_resent"))
    assert resent == [(1, 1, ["w2"]), (1, 3, ["s0"])]  # placed anew by rotation, generation 2 had resent rank 2's
    snapshot = max(e["bytes"] for e in job.named("snapshot"))  # each resend timed, for scripts/bench_sim_fit.py
    assert all(e["bytes"] == snapshot and e["send_s"] > 0 for e in job.named("snapshot_resent"))
    # sliced snapshots: a resend sends the restored piece (and private state) only, and each recovery gathered
    # the pieces over its new group
    lead = max(e["slice"][1] for e in job.named("snapshot"))
    assert all(e["held"] < lead for e in job.named("snapshot_resent"))
    gathered = sorted((e["gen"], e["rank"]) for e in job.named("pieces_gathered"))
    assert gathered == [(gen, rank) for gen in (1, 2) for rank in range(4)]
