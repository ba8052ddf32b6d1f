"""Tests for deadpool/runtime/slots.py: reserve/seal/intact, reading tensors back, and the slot reuse rule."""

import json

import numpy as np
import pytest
import torch
from tests.box import Box

from deadpool.runtime.arena import Arena
from deadpool.runtime.slots import Slot, checksum, make_meta, pick_slot
from deadpool.runtime.state import Layout, flatten, unflatten


def fill(slot: Slot, step: int, tree) -> tuple:
    """Writes a snapshot into `slot` exactly as the snapshot engine does, and seals it."""
    flat = flatten(tree)
    layout = Layout.of(flat.tensors)
    buffer = slot.reserve(layout.nbytes)
    for tensor, (_, _, offset, n) in zip(flat.tensors, layout.specs):
        if n:
            buffer[offset:offset + n].copy_(tensor.reshape(-1).view(torch.uint8))
    meta = make_meta(step, flat.skeleton, layout, flat.numpy, flat.cuda, flat.stable, False)
    slot.seal(step, meta, checksum(meta, slot.data))
    return flat, layout, meta


def sample_tree():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.BatchNorm1d(5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    extra = Box({"rng": np.random.RandomState(3).get_state(), "mask": torch.tensor([True, False, True]),
                 "half": torch.arange(3, dtype=torch.bfloat16), "empty": torch.zeros(0, 2),
                 "t": torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # not contiguous
                 "ids": np.arange(5, dtype=np.int16)})
    return {"model": model, "optim": optimizer, "extra": extra}


# ---- reserve / seal / intact ----------------------------------------------------------------

def test_new_slot_is_empty_and_not_intact():
    slot = Slot()
    assert slot.step is None and slot.nbytes == 0 and not slot.intact()


def test_reserve_grows_only_when_needed_and_marks_empty():
    slot = Slot()
    view = slot.reserve(128)
    assert view.numel() == 128 and view.dtype == torch.uint8 and slot.buffer.numel() == 128
    view.fill_(7)
    slot.seal(1, b"{}", checksum(b"{}", slot.data))
    assert slot.step == 1 and slot.intact()
    ptr = slot.buffer.data_ptr()
    smaller = slot.reserve(64)
    assert slot.step is None and not slot.intact()  # being written: never restored from
    assert slot.nbytes == 64 and slot.data.numel() == 64 and smaller.numel() == 64
    assert slot.buffer.data_ptr() == ptr and slot.buffer.numel() == 128  # no reallocation
    slot.reserve(256)
    assert slot.buffer.numel() == 256


def test_flipping_one_byte_breaks_intact():
    slot = Slot()
    fill(slot, 4, {"box": Box({"w": torch.arange(40, dtype=torch.float32)})})
    assert slot.step == 4 and slot.intact()
    slot.buffer[slot.nbytes // 2] ^= 0xFF
    assert not slot.intact()
    slot.buffer[slot.nbytes // 2] ^= 0xFF
    assert slot.intact()


def test_a_trusted_slot_is_not_checked_again_an_untrusted_one_is_once():
    """A rank's own slots (checksummed as written) are restorable without another pass over their bytes;
    a replica that sat at a holder is checked before use, and once it passed, not again."""
    own, held = Slot(), Slot()
    fill(own, 4, {"box": Box({"w": torch.arange(40, dtype=torch.float32)})})
    fill(held, 4, {"box": Box({"w": torch.arange(40, dtype=torch.float32)})})
    own.trusted = True
    own.buffer[0] ^= 0xFF
    assert own.usable() and not own.intact()  # trusted: the recovery does not pay to check it
    assert held.usable() and held.trusted     # checked now, and passed
    held.buffer[0] ^= 0xFF
    assert held.usable()                      # not checked a second time
    corrupt = Slot()
    fill(corrupt, 4, {"box": Box({"w": torch.ones(8)})})
    corrupt.buffer[3] ^= 0xFF
    assert not corrupt.usable() and not corrupt.trusted


@pytest.mark.parametrize("pinned_shared", [True, False], ids=["shared", "cuda-refused-sharing"])
def test_arenas_have_the_exact_size_and_each_is_pinned_once(monkeypatch, pinned_shared):
    """Snapshot 0 (before the optimizer's state exists) goes unpinned; from step 1 on the slot is pinned at
    its exact size, once, and shared, so holders on this machine map it; where CUDA refused to pin it
    shared, the private pinned arena it got instead is kept, not asked for again at every snapshot. (CUDA
    does not run here: the arena allocator is recorded instead, giving back a private arena for a pinned
    shared one when `pinned_shared` is False, as host_buffer does when CUDA refuses.)"""
    made = []

    def host_buffer(nbytes: int, pinned: bool, shared: bool = False) -> tuple[torch.Tensor, Arena | None]:
        made.append((nbytes, pinned, shared))
        kept_shared = shared and (pinned_shared or not pinned)
        return torch.empty(nbytes, dtype=torch.uint8), Arena(1, 2, 3, nbytes) if kept_shared else None

    monkeypatch.setattr("deadpool.runtime.slots.host_buffer", host_buffer)
    slot = Slot()
    sizes = [(1000, False), (3000, True), (3000, True), (2990, True), (3000, True)]  # step 0, then settled
    for nbytes, pin in sizes:  # as the engine asks: shared where it can be
        assert slot.reserve(nbytes, pin, share=True).numel() == nbytes
    assert made == [(1000, False, True), (3000, True, True)] and slot.pinned and slot.buffer.numel() == 3000
    assert (slot.arena is not None) is pinned_shared


def test_the_real_arena_is_exactly_as_large_as_asked():
    from deadpool.runtime.slots import host_buffer

    for nbytes in (1, 4097, 3 * 2**20 + 5):  # torch's caching pinned allocator would round these to powers of 2
        for shared in (False, True):
            buffer, arena = host_buffer(nbytes, pinned=False, shared=shared)
            assert buffer.untyped_storage().nbytes() == nbytes and (arena is not None) is shared


def test_changed_metadata_breaks_intact():
    slot = Slot()
    _, _, meta = fill(slot, 4, {"box": Box({"w": torch.ones(8)})})
    slot.meta = meta.replace(b'"step": 4', b'"step": 5')
    assert not slot.intact()


def test_checksum_covers_meta_and_data():
    data = torch.arange(16, dtype=torch.uint8)
    base = checksum(b'{"m": 1}', data)
    assert base == checksum(b'{"m": 1}', data.clone())
    assert base != checksum(b'{"m": 2}', data)
    changed = data.clone()
    changed[3] += 1
    assert base != checksum(b'{"m": 1}', changed)


# ---- tensors() ------------------------------------------------------------------------------

def test_make_meta_is_json():
    flat = flatten({"box": Box({"w": torch.ones(2), "n": np.zeros(1)})})
    layout = Layout.of(flat.tensors)
    meta = json.loads(make_meta(9, flat.skeleton, layout, flat.numpy, flat.cuda, flat.stable, True))
    assert meta == {"step": 9, "skeleton": flat.skeleton, "tensors": [["float32", [2], 0, 8], ["float64", [1], 64, 8]],
                    "numpy": [False, True], "cuda": [False, False], "stable": [False, False], "replicated": True,
                    "nbytes": 128, "lead": 0}


def test_make_meta_is_byte_for_byte_what_json_writes_of_the_whole():
    """Its fixed part is encoded once per layout; the bytes must still be json.dumps of the whole record,
    which is what the disk tier writes back when it reads a snapshot (disk/read.py), so its checksum holds."""
    flat = flatten(sample_tree())
    layout = Layout.of(flat.tensors, lead=flat.stable)
    for step, piece in ((3, None), (4, (64, 128)), (5, (64, 128))):
        meta = make_meta(step, flat.skeleton, layout, flat.numpy, flat.cuda, flat.stable, True, piece)
        assert meta == json.dumps(json.loads(meta)).encode()
        assert json.loads(meta)["step"] == step and json.loads(meta).get("slice") == (list(piece) if piece else None)


def test_a_slot_parses_what_it_holds_once_and_forgets_it_when_reused():
    slot = Slot()
    flat, layout, meta = fill(slot, 1, sample_tree())
    assert slot.held() == [(0, layout.nbytes)] and slot.held() is slot.held()
    slot.seal(2, meta, slot.digest, ranges=[(0, 8)])  # the writer knows them: not parsed again
    assert slot.held() == [(0, 8)]
    slot.reserve(layout.nbytes)
    assert slot.ranges is None


def test_tensors_round_trip_through_a_slot():
    tree = sample_tree()
    slot = Slot()
    flat, layout, _ = fill(slot, 6, tree)
    skeleton, tensors, numpy_flags = slot.tensors(torch.device("cpu"))
    assert skeleton == json.loads(json.dumps(flat.skeleton)) and numpy_flags == flat.numpy
    assert len(tensors) == len(flat.tensors)
    for got, want in zip(tensors, flat.tensors):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    # private copies: the slot's buffer can be overwritten without touching them
    kept = [t.clone() for t in tensors]
    slot.buffer.zero_()
    assert all(torch.equal(a, b) for a, b in zip(tensors, kept))

    state = unflatten(skeleton, tensors, numpy_flags)
    rng = state["extra"]["rng"]
    assert type(rng) is tuple and rng[0] == "MT19937"
    assert type(rng[1]) is np.ndarray and rng[1].dtype == np.uint32
    assert np.array_equal(rng[1], np.random.RandomState(3).get_state()[1])
    assert state["extra"]["ids"].dtype == np.int16 and state["extra"]["ids"].tolist() == [0, 1, 2, 3, 4]
    assert state["extra"]["t"].tolist() == [[0, 3], [1, 4], [2, 5]]
    assert state["extra"]["half"].dtype == torch.bfloat16 and state["extra"]["empty"].shape == (0, 2)
    assert list(state["optim"]["state"]) == [0, 1, 2, 3, 4, 5]


def test_tensors_restore_a_model_exactly():
    tree = sample_tree()
    slot = Slot()
    fill(slot, 1, tree)
    state = unflatten(*slot.tensors(torch.device("cpu")))
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.BatchNorm1d(5))
    other.load_state_dict(state["model"])
    for (name, a), (_, b) in zip(tree["model"].state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


# ---- pick_slot ------------------------------------------------------------------------------

def slots(*steps):
    return [Slot(step=s) for s in steps]


def newest(step):
    """pick_slot's question to the store, answered `step`; it must not be asked where `replaced` decides."""
    return lambda: step


def never_asked():
    raise AssertionError("the store was asked for the committed step")


def test_pick_takes_the_slot_holding_the_step_the_sender_replaced_without_asking_the_store():
    pool = slots(4, 5)
    assert pick_slot(pool, replaced=4, committed=never_asked) is pool[0]
    assert pick_slot(slots(None, 5), replaced=5, committed=never_asked).step == 5  # before an empty one


def test_pick_prefers_an_empty_slot():
    pool = slots(3, None)
    assert pick_slot(pool, None, committed=never_asked) is pool[1]
    pool = slots(None, 3)
    assert pick_slot(pool, replaced=1, committed=never_asked) is pool[0]  # 1 is not held here


def test_pick_oldest_when_none_is_committed():
    pool = slots(5, 4)
    assert pick_slot(pool, None, committed=newest(None)) is pool[1]


def test_pick_never_overwrites_the_committed_step():
    pool = slots(4, 5)
    assert pick_slot(pool, None, committed=newest(4)) is pool[1]  # the newer one, since the older is committed
    pool = slots(5, 4)
    assert pick_slot(pool, replaced=3, committed=newest(5)) is pool[1]  # a holder placed anew: 3 is not held


def test_pick_oldest_among_several():
    pool = slots(7, 2, 9)
    assert pick_slot(pool, None, committed=newest(9)) is pool[1]
    assert pick_slot(pool, None, committed=newest(2)) is pool[0]


def test_pick_committed_step_absent():
    pool = slots(7, 8)
    assert pick_slot(pool, None, committed=newest(3)) is pool[0]


def test_slots_are_found_in_a_list_by_identity():
    """An abandoned receiver's slot is looked up in its list to be replaced: comparing the slots' fields
    (their buffers) raised "Boolean value of Tensor ... is ambiguous" and killed the spare."""
    a, b = Slot(), Slot()
    a.reserve(8)
    b.reserve(8)
    assert a in [b, a] and [b, a].index(a) == 1 and a != b and Slot() not in [a, b]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA registers the shared arena)")
def test_a_pinned_slot_is_shared_and_a_mapping_sees_what_the_device_copied_into_it():
    from deadpool.runtime.arena import map_arena
    from deadpool.runtime.slots import host_buffer

    buffer, arena = host_buffer(3 * 2**20 + 5, pinned=True, shared=True)
    assert arena is not None and buffer.is_pinned()
    source = torch.arange(buffer.numel(), device="cuda").to(torch.uint8)
    buffer.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(map_arena(arena), source.cpu())
