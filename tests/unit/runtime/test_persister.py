"""Tests for deadpool/runtime/persist.py: what a writer copies out of a slot is exactly what was committed, and
a checkpoint of another model is refused before it is loaded."""

import json
import re

import pytest
import torch

from deadpool.errors import CheckpointError, ProtocolError
from deadpool.runtime.persist import check_fits, copy_out
from deadpool.runtime.slots import Slot, checksum


def sealed(step: int, fill: int) -> Slot:
    slot = Slot()
    data = slot.reserve(128)
    data.fill_(fill)
    meta = b'{"step": %d}' % step
    slot.seal(step, meta, checksum(meta, data), trusted=True)
    return slot


def test_the_copy_is_the_committed_snapshot_and_owns_its_bytes():
    slots = [sealed(4, 1), sealed(5, 2)]
    copy = copy_out(0, slots, 5)
    assert (copy.step, copy.meta, copy.digest) == (5, slots[1].meta, slots[1].digest) and copy.usable()
    assert torch.equal(copy.data, slots[1].data)
    slots[1].data.fill_(9)  # the slot is reused for a newer snapshot: the copy is unaffected
    assert copy.intact()


def test_a_snapshot_no_longer_held_is_refused():
    with pytest.raises(ProtocolError, match="snapshot 3 of rank 2 is no longer held"):
        copy_out(2, [sealed(4, 1), sealed(5, 2)], 3)


def test_a_slot_overwritten_while_it_was_copied_is_refused():
    slot = sealed(5, 2)
    slot.data[7] = 0  # what a newer snapshot's copy does to the bytes before the slot is sealed again
    with pytest.raises(ProtocolError, match="changed while it was copied"):
        copy_out(1, [slot], 5)


def test_a_checkpoint_of_other_shapes_is_refused_before_it_is_loaded_naming_the_first_difference(tmp_path):
    """The optimizer's state is not built before the first step: only what the live state has is compared."""
    shapes = {"model.weight": [3, 4], "model.bias": [3], "optimizer.state.0.exp_avg": [3, 4]}
    (tmp_path / "manifest.json").write_text(json.dumps({"identity": {"shapes": shapes}}))
    model = torch.nn.Linear(4, 3)
    check_fits(tmp_path, {"model": model, "optimizer": torch.optim.AdamW(model.parameters())})
    with pytest.raises(CheckpointError, match=re.escape(
            f"cannot resume from {tmp_path}: it holds the state of another job (model.weight has shape [3, 4] in the "
            "checkpoint, [2, 4] now (and 1 more of other shapes))")):
        check_fits(tmp_path, {"model": torch.nn.Linear(4, 2)})
