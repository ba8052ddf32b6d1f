"""Tests for deadpool/disk/chunks.py: DCP's fqns, which rank stores what, shard offsets, no copies."""

import pytest
import torch
from tests.unit.disk.snapshots import replicated_slots, sharded_slots, trained
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from deadpool.disk import chunk_rank, private_key


def test_fqns_are_dcps_flattened_keys_and_tied_weights_are_aliases():
    slot = replicated_slots()[0]
    chunks = chunk_rank(slot.meta, slot.data, 0, 2)
    model, optimizer = trained()
    flat, _ = flatten_state_dict({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    dcp_tensors = {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
    ours = {c.fqn for c in chunks.chunks} | {a for c in chunks.chunks for a in c.aliases}
    assert dcp_tensors <= ours and "optimizer.state.0.exp_avg" in ours
    tied = next(c for c in chunks.chunks if c.fqn == "model.wte.weight")
    assert tied.aliases == ("model.head.weight",) and "model.head.weight" not in {c.fqn for c in chunks.chunks}
    assert {"rng.torch", "rng.numpy.1", "rng.seen"} <= ours  # rank 0: everything under a global fqn
    assert not chunks.shared


def test_other_data_parallel_ranks_store_only_their_private_tensors():
    slot = replicated_slots()[1]
    chunks = chunk_rank(slot.meta, slot.data, 1, 2)
    assert all(c.fqn == c.key and c.key.startswith("_deadpool/rank1/t") for c in chunks.chunks)
    assert "model.wte.weight" in chunks.shared.values() and "optimizer.state.0.exp_avg" in chunks.shared.values()
    assert "model.mask" not in chunks.shared.values()  # a buffer is not stable: rank 1 keeps its own


def test_shards_sit_at_torch_chunk_offsets_and_an_empty_shard_is_private():
    slots, full = sharded_slots()
    seen = {}
    for rank, slot in enumerate(slots):
        for c in chunk_rank(slot.meta, slot.data, rank, 3).chunks:
            seen[(rank, c.fqn)] = (c.global_shape, c.offsets, tuple(c.tensor.shape))
    assert seen[(0, "model.w")] == ((7, 4), (0, 0), (3, 4))
    assert seen[(2, "model.w")] == ((7, 4), (6, 0), (1, 4))
    assert seen[(1, "model.few")] == ((2, 4), (1, 0), (1, 4))
    assert (2, "model.few") not in seen and (2, private_key(2, 2)) in seen  # rank 2 holds none of `few`
    assert seen[(0, "model.r")] == ((3,), (0,), (3,))  # Replicate: rank 0 stores it whole
    assert (1, "model.r") not in seen and (1, private_key(1, 3)) in seen  # the others keep their copy private


def test_chunk_tensors_are_views_of_the_slot_owning_exactly_their_bytes():
    slot = replicated_slots()[0]
    start, end = slot.data.data_ptr(), slot.data.data_ptr() + slot.nbytes
    for c in chunk_rank(slot.meta, slot.data, 0, 2).chunks:
        if c.tensor.numel():
            assert start <= c.tensor.data_ptr() < end
            assert c.tensor.untyped_storage().nbytes() == c.tensor.numel() * c.tensor.element_size()


def test_a_shard_of_the_wrong_shape_is_refused():
    slots, _ = sharded_slots()
    with pytest.raises(ValueError, match="shard has shape"):
        chunk_rank(slots[0].meta, slots[0].data, 0, 2)  # written for 3 ranks, read as 2
