"""Tests for deadpool/runtime/pieces.py: a sliced snapshot's one-pass copy, its seal, the pieces put back
together, and the audit of another rank's piece from live tensors."""

from __future__ import annotations

import pytest
import torch

from deadpool.runtime import digest as digest_module
from deadpool.runtime.digest import Digest, copy_hashed
from deadpool.runtime.pieces import audit, audited, copy_in, piece_of, sources
from deadpool.runtime.slices import held
from deadpool.runtime.slots import Slot, checksum, held_ranges, make_meta
from deadpool.runtime.state import Layout


def rank_state(rank: int) -> tuple[list[torch.Tensor], list[bool]]:
    """Replicated tensors of awkward shapes (rows that do not fill 64 bytes, a 0-dim one, one huge row),
    equal on every rank, and private ones that differ."""
    g = torch.Generator().manual_seed(0)
    replicated = [torch.randn(50, 7, generator=g), torch.tensor(3.5), torch.randint(0, 9, (13, 3), generator=g),
                  torch.randn(1, 300, generator=g), torch.randn(37, generator=g).double()]
    private = [torch.full((5,), float(rank)), torch.arange(rank + 3)]
    return [*replicated[:2], private[0], *replicated[2:], private[1]], [True, True, False, True, True, True, False]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(digest_module, "CHUNK", 96)  # chunks that straddle rows, tensors and pieces


def snapshot(rank: int, world: int) -> tuple[Slot, Layout, int, tuple[int, int]]:
    """Rank's sliced snapshot, as the engine takes it: into a slot full of garbage, sealed with its digest."""
    tensors, stable = rank_state(rank)
    layout = Layout.of(tensors, lead=stable)
    piece = piece_of(layout, rank, world)
    slot = Slot()
    buffer = slot.reserve(layout.nbytes)
    buffer.fill_(0xA5 + rank)
    digest, _ = copy_in(tensors, layout, buffer, piece, None, stream=None, ready=None, copied=lambda: None,
                        midway=lambda: None)
    meta = make_meta(7, None, layout, [False] * 7, [False] * 7, stable, True, piece)
    fingerprint, whole = digest.finish(meta)
    slot.seal(7, meta, whole, trusted=True)
    return slot, layout, fingerprint, piece


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_seal_is_the_checksum_of_what_the_slot_holds(world: int) -> None:
    for rank in range(world):
        slot, layout, _, piece = snapshot(rank, world)
        assert slot.intact() and checksum(slot.meta, slot.data) == slot.digest
        assert held_ranges(slot.meta, slot.nbytes) == held(layout.lead_nbytes, layout.nbytes, piece)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_pieces_of_all_ranks_put_together_are_the_whole_replicated_state(world: int) -> None:
    tensors, stable = rank_state(0)
    layout = Layout.of(tensors, lead=stable)
    whole = torch.full((layout.nbytes,), 0x11, dtype=torch.uint8)
    copy_hashed(sources(tensors, layout, None), whole, held(layout.lead_nbytes, layout.nbytes, None),
                layout.lead_nbytes)
    together = torch.empty(layout.lead_nbytes, dtype=torch.uint8)
    for rank in range(world):
        slot, _, _, (start, end) = snapshot(rank, world)
        together[start:end] = slot.data[start:end]
        private = slot.data[layout.lead_nbytes:]
        expected = rank_state(rank)[0]
        assert bytes(private[: 20].numpy()) == expected[2].numpy().tobytes()  # its own private state, whole
    assert torch.equal(together, whole[: layout.lead_nbytes])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_an_audit_of_piece_j_from_live_tensors_equals_owner_js_piece_hash(world: int) -> None:
    owners = [snapshot(rank, world)[2] for rank in range(world)]
    for rank in range(world):
        tensors, stable = rank_state(rank)
        layout = Layout.of(tensors, lead=stable)
        for j in range(world):
            assert audit(tensors, layout, piece_of(layout, j, world)) == owners[j]


def test_an_audit_sees_a_changed_byte_in_its_piece_only() -> None:
    tensors, stable = rank_state(1)
    layout = Layout.of(tensors, lead=stable)
    before = [audit(tensors, layout, piece_of(layout, j, 3)) for j in range(3)]
    tensors[0][49, 6] += 1  # the last row of the first tensor
    after = [audit(tensors, layout, piece_of(layout, j, 3)) for j in range(3)]
    assert [a != b for a, b in zip(before, after)].count(True) == 1


def test_an_empty_piece_hashes_as_nothing() -> None:
    tensors, stable = rank_state(0)
    layout = Layout.of(tensors, lead=stable)
    assert audit(tensors, layout, (0, 0)) == Digest(0).lead


@pytest.mark.parametrize("world", [2, 3, 4, 6])
def test_audits_cover_every_piece_once_every_n_snapshots(world: int) -> None:
    assert [audited(world, taken) for taken in range(2 * world)] == [*range(world)] * 2


def test_the_audit_is_done_before_training_may_change_the_weights() -> None:
    """copy_in returns the audit of the other piece, computed before `copied` lets the optimizer step run."""
    tensors, stable = rank_state(0)
    layout = Layout.of(tensors, lead=stable)
    calls: list[str] = []
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    _, seen = copy_in(tensors, layout, buffer, piece_of(layout, 0, 3), piece_of(layout, 2, 3), stream=None,
                      ready=None, copied=lambda: calls.append("copied"), midway=lambda: calls.append("midway"))
    assert calls == ["midway", "copied"]
    assert seen == snapshot(2, 3)[2]
