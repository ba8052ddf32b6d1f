"""Sharded training (the example with --parallel fsdp: FSDP2 over gloo): each rank snapshots only its own
shards, and whole nodes or single ranks die mid-step; every run must end on the failure-free sharded run's
exact state, losses and samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


def _global_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's global tensors (parameters and optimizer state, whatever shards wrote them), read with
    torch's own tool."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, checkpoint.with_suffix(".pt"))
    found: dict[str, torch.Tensor] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor) and not (prefix + key).startswith("_deadpool"):
                found[prefix + key] = value

    walk(torch.load(checkpoint.with_suffix(".pt")), "")
    return found


def test_a_sharded_checkpoint_resumes_on_other_numbers_of_workers_with_its_shards_cut_anew(tmp_path):
    """Two FSDP workers write a checkpoint before their last step; three workers resume it (each cutting its
    shards anew from the saved ones) and write the same global tensors back; two workers resume that and end bit
    for bit as the two-worker run that never stopped (their own state came back through rank r mod 3 = r)."""
    job = run_job(tmp_path / "two", steps=3, workers=2, spares=0, script_args=FSDP, persist_dir=str(tmp_path / "a"),
                  persist_every=1, keep=3)
    assert job.code == 0, job.summary["error"]
    saved = sorted((tmp_path / "a").glob("step-*"))[-2]  # one before the last step (a write may skip one)
    step = int(saved.name.removeprefix("step-"))
    three = run_job(tmp_path / "three", steps=step, workers=3, spares=0, script_args=FSDP, resume=str(saved),
                    persist_dir=str(tmp_path / "b"), persist_every=1)
    assert three.code == 0, three.summary["error"]
    assert sorted(e["rank"] for e in three.named("resumed_from_disk")) == [0, 1, 2]
    cut = tmp_path / "b" / saved.name  # the resumed state, written again by three workers
    assert json.loads((cut / "manifest.json").read_text())["world_size"] == 3
    ours, theirs = _global_tensors(saved), _global_tensors(cut)
    assert ours.keys() == theirs.keys() and len(ours) > 20
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = run_job(tmp_path / "back", steps=3, workers=2, spares=0, script_args=FSDP, resume=str(cut))
    assert back.code == 0, back.summary["error"]
    assert {e["step"] for e in back.named("step")} == set(range(step + 1, 4))
    assert back.summary["rank_state_sha256"] == job.summary["rank_state_sha256"]
