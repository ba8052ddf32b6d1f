"""Commits are decided by the coordinator alone, from durable reports, and keep flowing under `skip`; training
kept waiting by snapshots is told so."""

from __future__ import annotations

import os
import signal
import time

from .conftest import SCRIPTS, Background, run_job


def test_commits_keep_flowing_under_skip_when_replication_is_held_back(tmp_path, reference):
    """The test stops the spare (the replicas' holder) for a while: ranks skip the snapshots they have no
    free slot for, not necessarily the same ones, and commits resume up to the last step once it is back."""
    background = Background(tmp_path / "run", steps=16, backlog_policy="skip")
    background.wait_for(lambda e: e["event"] == "step" and e["step"] >= 4)
    os.kill(background.pid("s0"), signal.SIGSTOP)
    time.sleep(1.5)
    os.kill(background.pid("s0"), signal.SIGCONT)
    job = background.join()
    assert job.code == 0, job.summary["error"]
    assert job.named("snapshot_skipped"), "holding the spare back made no rank skip a snapshot"
    commits = [e["step"] for e in job.named("commit")]
    skipped = {e["step"] for e in job.named("snapshot_skipped")}
    assert commits == sorted(set(commits)) and not skipped & set(commits)  # a skipped step is never committed
    assert commits[-1] == max(set(range(17)) - skipped)  # the newest snapshot no rank skipped: up to the end
    assert all(e["role"] == "coordinator" for e in job.named("commit"))  # the one writer
    # skipping snapshots changes nothing in training: the reference's 10 steps are this run's first 10
    assert {rank: losses[:10] for rank, losses in job.summary["losses"].items()} == reference.summary["losses"]


def test_training_kept_waiting_by_snapshots_is_told_once_and_not_when_snapshots_are_sparse(tmp_path):
    """64 MB of state and a step of a few milliseconds: the snapshot engine cannot keep up with a snapshot
    every step, so training waits for it, and the user is told once (rank 0's output, an event per rank) how
    often to snapshot instead. Snapshotting every 100 steps, the same job waits a few percent (the first step
    of each interval waits for the copy to land) and is not told."""
    heavy = {"script": SCRIPTS / "heavy_state.py", "script_args": (), "workers": 2}
    told = run_job(tmp_path / "every-step", steps=30, **heavy)
    assert told.code == 0, told.summary["error"]
    events = told.named("snapshots_behind")
    assert sorted(e["rank"] for e in events) == [0, 1]
    for event in events:
        assert event["waited_share"] > 0.1 and event["engine_s"] > event["step_s"] and event["every"] == 1
        assert event["advice_every"] >= 2 and event["step"] > 2
    log = (tmp_path / "every-step" / "logs" / "w0.log").read_text()
    assert log.count("snapshots are slowing training") == 1 and "--snapshot-every auto" in log
    assert "snapshots are slowing training" not in (tmp_path / "every-step" / "logs" / "w1.log").read_text()

    sparse = run_job(tmp_path / "sparse", steps=300, snapshot_every=100, **heavy)
    assert sparse.code == 0, sparse.summary["error"]
    assert [e["step"] for e in sparse.named("commit")] == [0, 100, 200, 300]
    assert not sparse.named("snapshots_behind")
