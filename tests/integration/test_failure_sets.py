"""Failures as a set: simultaneous SIGKILLs, each dead rank restored from whichever live spare holds it."""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from deadpool.config import Fault

from .conftest import Background, Job, run_job
from .test_hot_swap import assert_same_training


@pytest.fixture(scope="module")
def reference3(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The failure-free 3-rank run the set-failure tests must reproduce bit for bit."""
    job = run_job(tmp_path_factory.mktemp("reference3"), workers=3, spares=1)
    assert job.code == 0 and job.summary["swaps"] == 0
    return job


@pytest.mark.parametrize("ranks", [*itertools.combinations(range(3), 2), (0, 1, 2)],
                         ids=lambda ranks: "+".join(map(str, ranks)))
def test_simultaneous_sigkills_with_as_many_spares(tmp_path, reference3, ranks):
    """Under the default placement (rank r -> spare r mod S), some dead ranks' replicas sit on a spare
    that takes another rank: the replica is streamed from that holder to the spare that takes it."""
    faults = tuple(Fault(kind="kill", rank=r, step=6, phase="backward") for r in ranks)
    job = run_job(tmp_path, workers=3, spares=len(ranks), faults=faults)
    assert_same_training(job, reference3)
    assert sorted(e["failed_rank"] for e in job.named("failure_detected")) == list(ranks)
    [recovery] = job.summary["recoveries"]  # one recovery, one new generation, one communicator rebuild
    assert recovery["generation"] == 1 and sorted(recovery["failed_ranks"]) == list(ranks)
    assert sorted(int(r) for r in recovery["replaced"]) == list(ranks)
    [plan] = [e for e in job.named("plan_published") if e["gen"] == 1]
    streamed = [r for r, source in enumerate(plan["sources"]) if source is not None]
    handed = sorted(e["of_rank"] for e in job.named("replica_handed_over"))
    assert handed == streamed and sorted(e["rank"] for e in job.named("replica_received")) == streamed
    if ranks == (0, 2):  # both replicas live on s0: s1 gets rank 2's from it
        assert plan["sources"] == [None, None, "s0"]
    assert {e["gen"] for e in job.named("group_joined") if e["gen"] > 0} == {1}


def test_sigkill_in_the_first_forward_pass_restores_step_zero(tmp_path, reference):
    """Step 0 is committed before step 1 starts, so even a failure before any step finished is recovered."""
    job = run_job(tmp_path, faults=(Fault(kind="kill", rank=2, step=1, phase="forward"),))
    assert_same_training(job, reference)
    [recovery] = job.summary["recoveries"]
    assert recovery["restored_step"] == 0 and recovery["kill_step"] == 1
    commits = [e for e in job.events if e["event"] == "commit"]
    first_step = min(e["t"] for e in job.named("step"))
    assert commits[0]["step"] == 0 and commits[0]["t"] < first_step


def test_a_spare_without_replicas_dying_during_a_recovery(tmp_path):
    """w0 dies; while the coordinator gathers the failure set, s2 (which holds nothing) dies too. The
    recovery plans both, completes, and the run is still the failure-free one."""
    reference = run_job(tmp_path / "reference", workers=2, spares=0)  # spares and settling change no number
    background = Background(tmp_path / "run", workers=2, spares=3, settle_s=2.0,
                            faults=(Fault(kind="kill", rank=0, step=5),))
    background.wait_for(lambda e: e["event"] == "failure_detected")
    os.kill(background.pid("s2"), signal.SIGKILL)
    job = background.join()
    assert_same_training(job, reference)
    lost = {e["proc"]: e for e in job.named("failure_detected")}
    assert set(lost) == {"w0", "s2"} and lost["s2"]["during"] == "settling"
    [recovery] = job.summary["recoveries"]
    assert recovery["replaced"] == {"0": "s0"}
    assert job.named("plan_published")[-1]["spares"] == ["s1"]


def test_two_ranks_die_at_once_and_their_pieces_come_from_their_holders_bit_for_bit(tmp_path, reference3):
    """Sliced snapshots: each rank's piece of the replicated state lives in its own slot and at its holder only.
    Ranks 0 and 2 die together; both pieces sit at s0 (rank r -> spare r mod 2), which takes rank 0 and streams
    rank 2's piece to s1. The new generation gathers the three pieces (rank 1's from its own slot) and goes on
    bit for bit."""
    faults = tuple(Fault(kind="kill", rank=r, step=6, phase="backward") for r in (0, 2))
    job = run_job(tmp_path, workers=3, spares=2, faults=faults)
    assert_same_training(job, reference3)
    [recovery] = job.summary["recoveries"]
    restored = recovery["restored_step"]
    assert recovery["replaced"] == {"0": "s0", "2": "s1"}
    pieces = {e["rank"]: tuple(e["slice"]) for e in job.named("snapshot") if e["gen"] == 0 and e["step"] == restored}
    lead = pieces[2][1]
    assert pieces[0][0] == 0 and pieces[0][1] == pieces[1][0] and pieces[1][1] == pieces[2][0] and lead > 0
    [received] = job.named("replica_received")  # s1 from s0; s0 adopted its own copy of rank 0
    assert (received["proc"], received["of_rank"], received["source"]) == ("s1", 2, "s0")
    assert tuple(received["slices"][str(restored)]) == pieces[2]  # the holder held rank 2's piece only
    gathered = {e["rank"]: e for e in job.named("pieces_gathered")}
    assert sorted(gathered) == [0, 1, 2] and {e["step"] for e in gathered.values()} == {restored}
    assert all(e["received"] == lead - (pieces[r][1] - pieces[r][0]) for r, e in gathered.items())
    sent = {e["rank"]: e["held"] for e in job.named("snapshot") if e["step"] == restored and e["gen"] == 0}
    assert all(sent[r] < lead for r in sent)  # each rank copied and sent less than the replicated state
