"""Commits are decided by the coordinator alone, from durable reports, and keep flowing under `skip`."""

from __future__ import annotations

import os
import signal
import time

from .conftest import Background


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
