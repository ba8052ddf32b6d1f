"""Tests for deadpool/runtime/persist.py: what a writer copies out of a slot is exactly what was committed, and
a checkpoint of another model is refused before it is loaded."""

import json
import re

import pytest
import torch

from deadpool.errors import CheckpointError, ProtocolError
from deadpool.runtime import persist
from deadpool.runtime.persist import check_fits, copy_out, held_nbytes
from deadpool.runtime.slices import cuts
from deadpool.runtime.slots import Slot, checksum, held_ranges, make_meta
from deadpool.runtime.state import Layout


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


def sliced(step: int) -> tuple[Slot, list[tuple[int, int]]]:
    """Rank 1 of 3's snapshot: its piece of 1.2 MB of replicated tensors, and 40 private bytes (random bytes,
    made in place: no other buffer ever holds them); and the ranges it holds."""
    tensors = [torch.zeros(100_000, 3), torch.zeros(7), torch.zeros(10, dtype=torch.int32)]
    layout = Layout.of(tensors, lead=[True, True, False])
    meta = make_meta(step, None, layout, [False] * 3, [False] * 3, [True, True, False], True, cuts(layout, 3)[1:3])
    slot = Slot()
    slot.reserve(layout.nbytes).random_(0, 256, generator=torch.Generator().manual_seed(step))
    slot.seal(step, meta, checksum(meta, slot.data), trusted=True)
    return slot, held_ranges(meta, slot.nbytes)


def test_a_slice_is_copied_over_the_bytes_it_holds_only():
    slot, held = sliced(5)
    (start, end), (lead, nbytes) = held
    copy = copy_out(1, [slot], 5)
    assert (copy.step, copy.meta, copy.digest, copy.nbytes) == (5, slot.meta, slot.digest, slot.nbytes)
    assert copy.intact() and held_nbytes(copy) == end - start + nbytes - lead == 400_020 + 64  # 33,335 rows + 40 B
    for a, b in held:
        assert torch.equal(copy.data[a:b], slot.data[a:b])
    assert not torch.equal(copy.data[:start], slot.data[:start])  # the other ranks' pieces: not copied
    assert not torch.equal(copy.data[end:lead], slot.data[end:lead])
    slot.data[start - 1] ^= 1  # not this rank's bytes: the copy is still exactly what was committed
    assert copy_out(1, [slot], 5).digest == slot.digest
    slot.data[end - 1] ^= 1
    with pytest.raises(ProtocolError, match="snapshot 5 of rank 1 changed while it was copied"):
        copy_out(1, [slot], 5)


@pytest.mark.parametrize("resealed", [False, True])
def test_a_slice_overwritten_between_its_ranges_is_refused(monkeypatch, resealed):
    """A newer snapshot starts writing the slot after the piece was copied and before the private state is:
    whether or not it was sealed again (with another step) by then, the copy is refused."""
    slot, held = sliced(5)

    def racing(meta, nbytes):
        yield held[0]
        slot.reserve(slot.nbytes)[held[1][0]] ^= 1  # the newer snapshot's copy reaches the private state
        if resealed:
            slot.seal(6, slot.meta, checksum(slot.meta, slot.data))
        yield held[1]

    monkeypatch.setattr(persist, "held_ranges", racing)
    with pytest.raises(ProtocolError, match="snapshot 5 of rank 1 changed while it was copied"):
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
