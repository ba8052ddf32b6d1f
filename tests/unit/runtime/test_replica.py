"""Tests for deadpool/runtime/replica.py over a real store and real sockets: a sliced snapshot crosses as
the byte ranges it holds, and the holder checks it over exactly those."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tests.plane import control_plane

from deadpool.config import JobConfig
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.secret import read_secret
from deadpool.runtime import digest, replica
from deadpool.runtime.context import connect
from deadpool.runtime.pieces import copy_in, piece_of
from deadpool.runtime.replica import ReplicaReceiver, ReplicaSender
from deadpool.runtime.slots import Slot, make_meta
from deadpool.runtime.state import Layout


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the streams listen where a job on one machine's would


def ends(config: JobConfig) -> tuple[ControlPlane, bytes]:
    return ControlPlane(connect(config)), read_secret(config.secret_file)


def sliced_slot(rank: int, world: int, share: bool = False) -> tuple[Slot, Layout]:
    """A sealed slot of rank `rank`'s piece; `share`: in shared memory, as a rank's own slots are."""
    tensors = [torch.randn(40, 5, generator=torch.Generator().manual_seed(1)), torch.full((3,), float(rank))]
    layout = Layout.of(tensors, lead=[True, False])
    piece = piece_of(layout, rank, world)
    slot = Slot()
    digest, _ = copy_in(tensors, layout, slot.reserve(layout.nbytes, share=share), piece, None, stream=None,
                        ready=None, copied=lambda: None, midway=lambda: None)
    meta = make_meta(4, None, layout, [False, False], [False, False], [True, False], True, piece)
    slot.seal(4, meta, digest.finish(meta)[1], trusted=True)
    return slot, layout


def receiving(config: JobConfig, prefix: str, slots: list[Slot], steps: int, got: list[Slot]) -> threading.Thread:
    """A holder's thread that receives `steps` snapshots on stream `prefix` into `slots`, appending each."""

    def hold() -> None:
        plane, secret = ends(config)
        receiver = ReplicaReceiver(plane, prefix, secret, 0, slots, timeout_s=20)
        got.extend(receiver.receive_one(lambda: None, lambda: False) for _ in range(steps))
        receiver.close()

    thread = threading.Thread(target=hold)
    thread.start()
    return thread


def sender(config: JobConfig, prefix: str = "pair/") -> ReplicaSender:
    plane, secret = ends(config)
    return ReplicaSender(plane, prefix, secret, 0, timeout_s=20)


def test_a_sliced_snapshot_crosses_as_its_piece_and_private_state(tmp_path):
    slot, layout = sliced_slot(rank=1, world=3)
    start, end = piece_of(layout, 1, 3)
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        held = [Slot(), Slot()]
        for empty in held:
            empty.reserve(layout.nbytes).fill_(0xEE)  # what the holder had there: bytes no stream writes
        received: list[Slot] = []
        holder = receiving(config, "pair/", held, 1, received)
        sender(config).send(slot)
        holder.join(20)
    [got] = received
    assert (got.step, got.digest, got.meta) == (slot.step, slot.digest, slot.meta) and got.intact()
    assert torch.equal(got.data[start:end], slot.data[start:end])
    assert torch.equal(got.data[layout.lead_nbytes:], slot.data[layout.lead_nbytes:])
    outside = torch.cat([got.data[:start], got.data[end: layout.lead_nbytes]])
    assert outside.numel() and bool((outside == 0xEE).all())  # the other ranks' pieces never crossed


def test_a_holder_hashing_on_threads_as_bytes_land_agrees_with_its_sender_hashing_inline(tmp_path, monkeypatch):
    """Where a holder has hash threads (a GPU host's cores), each landed chunk's blocks are hashed there while
    the receive goes on; the value must be the sender's, computed in its copy without threads."""
    monkeypatch.setattr(digest, "BLOCK", 64)  # blocks that straddle the chunks and the held ranges
    monkeypatch.setattr(replica, "CHUNK", 200)
    slot, _ = sliced_slot(rank=0, world=2)
    with ThreadPoolExecutor(3) as pool, control_plane(tmp_path) as (_, plane):
        monkeypatch.setattr(digest, "hash_pool", lambda: (pool, 3))
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        received: list[Slot] = []
        holder = receiving(config, "pair/", [Slot(), Slot()], 1, received)
        sender(config).send(slot)
        holder.join(20)
        [got] = received
        assert got.digest == slot.digest and got.intact()


def test_streams_opened_at_once_from_several_threads_each_arrive_whole(tmp_path):
    """A holder of several ranks receives them on streams of their own, opened while the others open."""
    slots = {name: sliced_slot(rank=r, world=3)[0] for r, name in enumerate(("a/", "b/", "c/"))}
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        received: dict[str, list[Slot]] = {prefix: [] for prefix in slots}
        holders = [receiving(config, prefix, [Slot(), Slot()], 1, received[prefix]) for prefix in slots]
        senders = [threading.Thread(target=lambda p=prefix: sender(config, p).send(slots[p])) for prefix in slots]
        for thread in senders:
            thread.start()
        for thread in senders + holders:
            thread.join(20)
    for prefix, slot in slots.items():
        [got] = received[prefix]
        assert (got.step, got.digest) == (slot.step, slot.digest) and got.intact()


def test_snapshots_add_nothing_to_the_store(tmp_path):
    """An idle holder is woken by its socket, not by an announcement in the store: a month of snapshots
    leaves the store as the first one did (one key: where the sender listens)."""
    slot, _ = sliced_slot(rank=0, world=2)
    with control_plane(tmp_path) as (server, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        received: list[Slot] = []
        holder = receiving(config, "pair/", [Slot(), Slot()], 3, received)
        stream = sender(config)
        stream.send(slot)
        keys_after_one = server.table.num_keys()
        stream.send(slot)
        stream.send(slot)
        holder.join(20)
        assert server.table.num_keys() == keys_after_one
        assert [key for key in server.table.data if key.startswith("pair/")] == ["pair/addr"]
    assert [got.step for got in received] == [4, 4, 4]


def test_a_sender_that_dies_mid_snapshot_leaves_the_holders_slot_unsealed(tmp_path):
    """The socket closes in the middle of the data: the holder's receive fails at once, and the slot it
    was filling is not taken for a snapshot."""
    slot, layout = sliced_slot(rank=0, world=1)
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        held = [Slot(), Slot()]
        errors: list[BaseException] = []

        def hold() -> None:
            plane_, secret = ends(config)
            receiver = ReplicaReceiver(plane_, "pair/", secret, 0, held, timeout_s=20)
            try:
                receiver.receive_one(lambda: None, lambda: False)
            except BaseException as error:
                errors.append(error)

        holder = threading.Thread(target=hold)
        holder.start()
        dying = sender(config)
        with pytest.raises(OSError):
            dying.send(slot, midway=dying.close)
        holder.join(20)
    assert not holder.is_alive() and isinstance(errors[0], ConnectionError)
    assert all(s.step is None for s in held)


def test_the_holder_overwrites_the_slot_whose_step_its_sender_replaced_without_asking_the_store(tmp_path):
    """The header names the step the sender's slot held before (free_slot let it go: never the newest
    committed step again), so the holder overwrites its copy of that step and leaves the other alone."""
    slot, layout = sliced_slot(rank=0, world=2)
    held = [Slot(), Slot()]
    for step, old in zip((2, 3), held):
        old.reserve(layout.nbytes).fill_(step)
        old.seal(step, b"{}", 0)

    def never_asked() -> int | None:
        raise AssertionError("the holder asked the store for the committed step")

    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        received: list[Slot] = []

        def hold() -> None:
            plane_, secret = ends(config)
            receiver = ReplicaReceiver(plane_, "pair/", secret, 0, held, timeout_s=20)
            received.append(receiver.receive_one(never_asked, lambda: False))

        holder = threading.Thread(target=hold)
        holder.start()
        sender(config).send(slot, replaced=2)
        holder.join(20)
    assert received == [held[0]] and held[0].step == 4 and held[0].intact()
    assert held[1].step == 3 and bool((held[1].data == 3).all())


def test_a_holder_on_the_same_machine_maps_the_senders_slot_instead_of_receiving_it(tmp_path):
    """Nothing crosses the stream but the header: the holder's slot is the sender's arena, checked before a
    recovery uses it like any replica, so a later write by its sender shows there (and fails the check)."""
    slot, layout = sliced_slot(rank=1, world=3, share=True)
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        held, received = [Slot(), Slot()], []
        holder = receiving(config, "pair/", held, 1, received)
        streams = sender(config)
        sent = streams.send(slot)
        holder.join(20)
    [got] = received
    assert sent == 0 and streams.share and got.mapped and not got.trusted and got.arena is None
    assert (got.step, got.digest, got.meta, got.nbytes) == (slot.step, slot.digest, slot.meta, slot.nbytes)
    assert got.usable() and torch.equal(got.data, slot.data)
    slot.data[layout.lead_nbytes] ^= 0xFF  # the sender writes its arena again (a later snapshot)
    assert torch.equal(got.data, slot.data) and not got.usable()
    got.reserve(layout.nbytes).fill_(7)  # a stream into this slot later goes into the holder's own memory
    assert not got.mapped and not bool((slot.data == 7).all())


def test_a_holder_that_cannot_map_the_arena_is_sent_the_bytes_from_then_on(tmp_path):
    """An arena the holder cannot open (here: announced with another inode) is acknowledged with
    UNMAPPED; the sender streams that snapshot at once, and the next ones."""
    slot, layout = sliced_slot(rank=0, world=1, share=True)
    assert slot.arena is not None
    slot.arena = dataclasses.replace(slot.arena, inode=slot.arena.inode + 1)
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        held, received = [Slot(), Slot()], []
        holder = receiving(config, "pair/", held, 2, received)
        streams = sender(config)
        sent = [streams.send(slot), streams.send(slot, replaced=4)]
        holder.join(20)
    assert sent == [layout.nbytes] * 2 and not streams.share
    assert [g.step for g in received] == [4, 4] and not any(g.mapped for g in received)
    assert all(g.intact() and torch.equal(g.data, slot.data) for g in received)


def test_a_sender_told_not_to_share_streams_to_a_holder_on_its_machine(tmp_path):
    slot, layout = sliced_slot(rank=0, world=1, share=True)
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        held, received = [Slot(), Slot()], []
        holder = receiving(config, "pair/", held, 1, received)
        plane_, secret = ends(config)
        streams = ReplicaSender(plane_, "pair/", secret, 0, timeout_s=20, share=False)
        sent = streams.send(slot)
        holder.join(20)
    assert sent == layout.nbytes and streams.stream.local and not received[0].mapped and received[0].intact()
