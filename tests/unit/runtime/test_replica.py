"""Tests for deadpool/runtime/replica.py over a real store and gloo pair group: a sliced snapshot crosses as
the byte ranges it holds, and the holder checks it over exactly those."""

from __future__ import annotations

import threading

import torch
from tests.plane import control_plane

from deadpool.config import JobConfig
from deadpool.protocol.keys import Keys
from deadpool.runtime.context import connect
from deadpool.runtime.pieces import copy_in, piece_of
from deadpool.runtime.plane import PlaneStore
from deadpool.runtime.replica import ReplicaReceiver, ReplicaSender
from deadpool.runtime.slots import Slot, make_meta
from deadpool.runtime.state import Layout


def sliced_slot(rank: int, world: int) -> tuple[Slot, Layout]:
    tensors = [torch.randn(40, 5, generator=torch.Generator().manual_seed(1)), torch.full((3,), float(rank))]
    layout = Layout.of(tensors, lead=[True, False])
    piece = piece_of(layout, rank, world)
    slot = Slot()
    digest, _ = copy_in(tensors, layout, slot.reserve(layout.nbytes), piece, None, stream=None, ready=None,
                        copied=lambda: None, midway=lambda: None)
    meta = make_meta(4, None, layout, [False, False], [False, False], [True, False], True, piece)
    slot.seal(4, meta, digest.finish(meta)[1], trusted=True)
    return slot, layout


def test_a_sliced_snapshot_crosses_as_its_piece_and_private_state(tmp_path):
    slot, layout = sliced_slot(rank=1, world=3)
    start, end = piece_of(layout, 1, 3)
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        held = [Slot(), Slot()]
        for empty in held:
            empty.reserve(layout.nbytes).fill_(0xEE)  # what the holder had there: bytes no stream writes
        received: list[Slot] = []

        def hold() -> None:
            receiver = ReplicaReceiver(PlaneStore(connect(config)), "pair/", "t", 0, held, timeout_s=20)
            received.append(receiver.receive_one(lambda: None, lambda: False))

        holder = threading.Thread(target=hold)
        holder.start()
        ReplicaSender(PlaneStore(connect(config)), "pair/", "t", 0, timeout_s=20).send(slot)
        holder.join(20)
    [got] = received
    assert (got.step, got.digest, got.meta) == (slot.step, slot.digest, slot.meta) and got.intact()
    assert torch.equal(got.data[start:end], slot.data[start:end])
    assert torch.equal(got.data[layout.lead_nbytes:], slot.data[layout.lead_nbytes:])
    outside = torch.cat([got.data[:start], got.data[end: layout.lead_nbytes]])
    assert outside.numel() and bool((outside == 0xEE).all())  # the other ranks' pieces never crossed


def test_every_stream_of_a_process_shares_its_one_gloo_device(tmp_path):
    """A holder of several ranks receives them on one gloo device (one event-loop thread, not one each);
    streams made at once from several threads still make one device, and each arrives whole."""
    from deadpool.runtime import replica

    slots = {name: sliced_slot(rank=r, world=2)[0] for r, name in enumerate(("a/", "b/"))}
    with control_plane(tmp_path) as (_, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        received: dict[str, Slot] = {}

        def hold(prefix: str) -> None:
            receiver = ReplicaReceiver(PlaneStore(connect(config)), prefix, "t", 0, [Slot(), Slot()], timeout_s=20)
            received[prefix] = receiver.receive_one(lambda: None, lambda: False)

        def send(prefix: str) -> None:
            ReplicaSender(PlaneStore(connect(config)), prefix, "t", 0, timeout_s=20).send(slots[prefix])

        threads = [threading.Thread(target=f, args=(p,)) for p in slots for f in (hold, send)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
    assert len(replica._DEVICES) == 1
    for prefix, slot in slots.items():
        got = received[prefix]
        assert (got.step, got.digest) == (slot.step, slot.digest) and got.intact()


def test_a_stream_keeps_only_its_newest_announcement(tmp_path):
    """Every snapshot is announced under a key of its own; a month of them must not pile up in the store, so
    the request that announces a snapshot deletes the previous announcement (the holder is past it by then)."""
    slot, _ = sliced_slot(rank=0, world=2)
    with control_plane(tmp_path) as (server, plane):
        config = JobConfig(script="train.py", workers=1, run_dir=str(tmp_path), token="t", **plane)
        held = [Slot(), Slot()]
        steps: list[int | None] = []

        def hold() -> None:
            receiver = ReplicaReceiver(PlaneStore(connect(config)), "pair/", "t", 0, held, timeout_s=20)
            steps.extend(receiver.receive_one(lambda: None, lambda: False).step for _ in range(3))

        holder = threading.Thread(target=hold)
        holder.start()
        sender = ReplicaSender(PlaneStore(connect(config)), "pair/", "t", 0, timeout_s=20)
        sender.send(slot)
        keys_after_one = server.table.num_keys()
        sender.send(slot)
        sender.send(slot)
        holder.join(20)
        assert server.table.num_keys() == keys_after_one  # the store does not grow with the snapshots
        assert [key for key in server.table.data if "seq/" in key] == [Keys.announce("pair/", 3)]
    assert steps == [4, 4, 4]


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
            receiver = ReplicaReceiver(PlaneStore(connect(config)), "pair/", "t", 0, held, timeout_s=20)
            received.append(receiver.receive_one(never_asked, lambda: False))

        holder = threading.Thread(target=hold)
        holder.start()
        ReplicaSender(PlaneStore(connect(config)), "pair/", "t", 0, timeout_s=20).send(slot, replaced=2)
        holder.join(20)
    assert received == [held[0]] and held[0].step == 4 and held[0].intact()
    assert held[1].step == 3 and bool((held[1].data == 3).all())
