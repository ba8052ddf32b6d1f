"""Tests for deadpool/runtime/replay.py: a replayed step must be fed what its first run was fed."""

import pytest
import torch

from deadpool.runtime.replay import KEPT_INTERVALS, InputFingerprints, ReplayMismatch


def run(fingerprints: InputFingerprints, step: int, batch: torch.Tensor, replaying: bool = False) -> None:
    fingerprints.saw((batch,), {"targets": batch + 1})
    fingerprints.end_step(step, replaying, rank=1, every=2)


def test_a_replay_fed_the_same_inputs_passes_and_other_inputs_are_named():
    fingerprints = InputFingerprints()
    for step in (1, 2, 3):
        run(fingerprints, step, torch.full((2, 3), step))
    run(fingerprints, 2, torch.full((2, 3), 2), replaying=True)
    with pytest.raises(ReplayMismatch, match=r"^step 3 replayed on rank 1 after a failure was fed other inputs"):
        run(fingerprints, 3, torch.full((2, 3), 4), replaying=True)


def test_shape_and_dtype_count_not_only_bytes():
    fingerprints = InputFingerprints()
    run(fingerprints, 1, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ReplayMismatch):
        run(fingerprints, 1, torch.zeros(3, 2, dtype=torch.int32), replaying=True)


def test_a_step_never_seen_is_recorded_not_checked_and_old_steps_are_dropped():
    """A spare replays steps it never ran; a replay further back than the kept window goes unchecked."""
    fingerprints = InputFingerprints()
    run(fingerprints, 5, torch.ones(1), replaying=True)
    for step in range(6, 30):
        run(fingerprints, step, torch.ones(1))
    assert min(fingerprints.first) == 29 - KEPT_INTERVALS * 2


def test_a_failed_steps_partial_inputs_do_not_count():
    fingerprints = InputFingerprints()
    run(fingerprints, 1, torch.ones(1))
    fingerprints.saw((torch.zeros(1),), {})  # the step that failed mid-way
    fingerprints.drop_partial()
    run(fingerprints, 1, torch.ones(1), replaying=True)
