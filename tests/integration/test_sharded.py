"""Sharded training (the example with --parallel fsdp: FSDP2 over gloo): each rank snapshots only its own
shards, and whole nodes or single ranks die mid-step; every run must end on the failure-free sharded run's
exact state, losses and samples."""

from __future__ import annotations

import pytest

from deadpool.config import Fault
from tests.integration.conftest import SMALL, Job, run_job
from tests.integration.test_nodes import NODES, assert_same_training

FSDP = (*SMALL, "--parallel", "fsdp")


@pytest.fixture(scope="module")
def sharded_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    job = run_job(tmp_path_factory.mktemp("sharded-reference"), script_args=FSDP)
    assert job.code == 0 and job.summary["swaps"] == 0
    return job


def snapshot_bytes(job: Job) -> dict[int, int]:
    return {e["rank"]: e["bytes"] for e in job.named("snapshot") if e["step"] == 1}


def test_each_rank_snapshots_its_own_shards_only(sharded_reference, reference):
    """Data-parallel, every rank's snapshot holds the whole model and optimizer; sharded over 4 ranks,
    each holds a quarter of them (plus its own RNG, data position and step)."""
    replicated, sharded = snapshot_bytes(reference), snapshot_bytes(sharded_reference)
    assert len(sharded) == 4 and all(n < replicated[r] / 3 for r, n in sharded.items())
    assert abs(sum(sharded.values()) - replicated[0]) < 0.05 * replicated[0]
    assert len(set(sharded_reference.summary["rank_state_sha256"])) == 4  # four different states
    assert sharded_reference.summary["losses"] != reference.summary["losses"]  # not the replicated run by mistake


@pytest.mark.parametrize("phase", ["backward", "after_optimizer"])
def test_a_whole_node_dies_mid_step_and_a_spare_node_takes_its_shards(tmp_path, sharded_reference, phase):
    job = run_job(tmp_path, script_args=FSDP, faults=(Fault(kind="kill_node", rank=2, step=6, phase=phase),),
                  **NODES)
    assert_same_training(job, sharded_reference)
    [recovery] = job.summary["recoveries"]
    assert recovery["failed_ranks"] == [2, 3] and recovery["replaced"] == {"2": "s0", "3": "s1"}


def test_one_rank_of_a_node_dies_and_a_spare_takes_its_shards(tmp_path, sharded_reference):
    job = run_job(tmp_path, script_args=FSDP, faults=(Fault(kind="kill", rank=1, step=5, phase="backward"),),
                  **NODES)
    assert_same_training(job, sharded_reference)
    [recovery] = job.summary["recoveries"]
    assert recovery["failed_ranks"] == [1]
