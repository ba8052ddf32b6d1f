"""Tests for deadpool/runtime/pieces.py: a sliced snapshot's one-pass copy, its seal, the pieces put back
together, and the audit of another rank's piece from live tensors."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deadpool.runtime import digest as digest_module
from deadpool.runtime.digest import Digest, copy_hashed
from deadpool.runtime.pieces import _fill, _slot_hash, audit, audited, copy_in, gather, piece_of, sources
from deadpool.runtime.slices import held
from deadpool.runtime.slots import Slot, checksum, held_ranges, make_meta
from deadpool.runtime.state import Flat, Layout


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


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_slots_piece_hashes_as_its_owners_fingerprint_and_live_pieces_fill_the_rest(world: int) -> None:
    """What lets a survivor skip the gather: the hash of its slot's piece is its fingerprint, and the others'
    pieces copied from equal live tensors make the slot's lead region exactly the whole snapshot's."""
    tensors, stable = rank_state(0)
    layout = Layout.of(tensors, lead=stable)
    whole = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copy_hashed(sources(tensors, layout, None), whole, held(layout.lead_nbytes, layout.nbytes, None),
                layout.lead_nbytes)
    for rank in range(world):
        slot, _, fingerprint, piece = snapshot(rank, world)  # the slot's other bytes are garbage
        assert _slot_hash(slot, piece) == fingerprint
        live = rank_state(rank)[0]
        for j in range(world):
            if j != rank:
                _fill(live, layout, piece_of(layout, j, world), slot.buffer)
        assert torch.equal(slot.data[: layout.lead_nbytes], whole[: layout.lead_nbytes])


def _gather_rank(rank: int, world: int, port: int, out: "mp.Queue[tuple]") -> None:
    """One rank of three gathers, each from fresh sliced slots: only rank 2's live state differs from the
    snapshot (a spare that took a rank), every rank's does (all past it), and no rank gives its live state."""
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for scenario, differs in (("taker", rank == 2), ("all past it", True), ("no live state", None)):
        slot, layout, _, _ = snapshot(rank, world)
        tensors, stable = rank_state(rank)
        if differs:
            tensors = [t + 1 if s else t for t, s in zip(tensors, stable)]
        live = None if differs is None else Flat(None, tensors, stable, [False] * 7, [False] * 7, [])
        took = gather(slot, rank, world, torch.device("cpu"), lambda: False, 30.0, live=live)
        out.put((scenario, rank, took["mode"], took["needy"], took["received"],
                 bytes(slot.data[: layout.lead_nbytes].numpy())))
    dist.destroy_process_group()


def test_only_the_ranks_whose_live_state_differs_receive_pieces_and_every_slot_ends_whole() -> None:
    """Real gloo processes: a taker alone gets the pieces point to point (the survivors copy theirs from their
    live tensors); when most ranks need them, N broadcasts; every slot's replicated region ends exactly the
    whole snapshot's."""
    world = 3
    tensors, stable = rank_state(0)
    layout = Layout.of(tensors, lead=stable)
    whole = torch.zeros(layout.nbytes, dtype=torch.uint8)
    copy_hashed(sources(tensors, layout, None), whole, held(layout.lead_nbytes, layout.nbytes, None),
                layout.lead_nbytes)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=_gather_rank, args=(rank, world, port, out)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=60) for _ in range(3 * world)]
    finally:
        for proc in procs:
            proc.join(10)
            proc.kill()
    pieces = [piece_of(layout, r, world) for r in range(world)]
    others = [layout.lead_nbytes - (b - a) for a, b in pieces]
    got = {(scenario, rank): tuple(rest) for scenario, rank, *rest in results}
    assert all(got[("taker", r)][:3] == ("point-to-point", [2], others[2] if r == 2 else 0) for r in range(world))
    for scenario in ("all past it", "no live state"):
        assert all(got[(scenario, r)][:3] == ("broadcast", [0, 1, 2], others[r]) for r in range(world))
    assert all(rest[3] == bytes(whole[: layout.lead_nbytes].numpy()) for rest in got.values())
