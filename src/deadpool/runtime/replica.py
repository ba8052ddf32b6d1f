"""Streams finished snapshots to their holders over two-process gloo groups, straight into the holder's slot.

One group per (rank, holder, generation); the sender is group rank 0, the holder group rank 1.

    sender (worker, rank r)                  holder (spare)
    Announce at {stream}seq/{n}, deleting    ->  wakes (idle waits are on the store: interruptible)
      seq/{n-1} in the same request (the holder is past it: a month of snapshots must not pile up)
    header [magic, token, gen, step, meta_len, nbytes, digest,
            the held byte ranges (two start, end pairs), replaced]  ->  pick the slot to overwrite
    meta (JSON bytes)                        ->
    data: each byte range the slot holds     ->  received into the slot's own buffer, in place
          (slots.held_ranges: a data-parallel piece and the private state, or all of it)
                                             <-  ack [step, digest, ok]  (recomputed by the holder)

The digest (runtime/digest.py: xxh3_64, or CRC-32 without xxhash) travels as a signed int64. The header
carries what the holder needs before the data, so it neither parses the metadata (tens of kB of JSON
for a real model) nor asks the store which step is committed: `replaced` is the step the sender's own
slot held before (slots.pick_slot; -1: none).
"""

from __future__ import annotations

import hashlib
import os
import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from deadpool.errors import ChecksumMismatch, ProtocolError
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Announce, Handover
from deadpool.runtime.plane import PlaneStore
from deadpool.runtime.slots import Slot, checksum, pick_slot

MAGIC = 0x44504F4F4C  # "DPOOL"
RANGES = 2  # held byte ranges a snapshot has at most (slices.held: its piece, then its private state)
HEADER = 8 + 2 * RANGES
IDLE_SLICE_S = 0.25  # a holder's wait for the next snapshot, per store request, until its generation or job ends


def token_id(token: str) -> int:
    """The job token as a 62-bit integer that fits an int64 header field."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:8], "little") >> 2


_DEVICES: list[Any] = []  # this process's gloo devices, shared by all its pair groups (below)
_DEVICES_MADE = threading.Lock()  # a holder makes its groups in a thread per held rank


def pair_group(store: PlaneStore, prefix: str, me: int, timeout_s: float) -> Any:  # a ProcessGroupGloo (untyped stubs)
    """A two-process gloo group on this process's gloo device. Each device runs a thread that wakes every
    10 ms (gloo's event loop), idle or not: a spare holding 4 ranks had 4 of them, 400 wake-ups a second
    that cost it more CPU than receiving the snapshots. The device is made once, as torch makes one for
    each group: on the interfaces GLOO_SOCKET_IFNAME names, else on the hostname's address."""
    with _DEVICES_MADE:
        if not _DEVICES:
            names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
            _DEVICES.extend([dist.ProcessGroupGloo.create_device(interface=name) for name in names]
                            or [dist.ProcessGroupGloo.create_default_device()])
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (the stubs omit it)
    options._devices, options._timeout, options._threads = _DEVICES, timedelta(seconds=timeout_s), 2 * len(_DEVICES)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), me, 2, options)


def _wait(work: dist.Work, timeout_s: float) -> None:
    """A gloo send/recv completes, fails at once if the peer's socket closes, or times out.

    (gloo's point-to-point work reports completion only through wait(), so it cannot be polled.)
    """
    work.wait(timedelta(seconds=timeout_s))


class ReplicaSender:
    """A worker's end of one replica stream."""

    def __init__(self, store: PlaneStore, prefix: str, token: str, gen: int, timeout_s: float) -> None:
        self.group = pair_group(store, prefix, 0, timeout_s)
        self.plane, self.prefix, self.sent = ControlPlane(store.client), prefix, 0
        self.token = token_id(token)
        self.gen = gen
        self.timeout_s = timeout_s

    def send(self, slot: Slot, midway: Callable[[], None] = lambda: None, replaced: int | None = None) -> None:
        """Sends one sealed slot and checks the holder's acknowledgement of (step, checksum). `replaced`: the
        step this slot held before the snapshot (the holder overwrites the same one), if the caller knows it."""
        assert slot.step is not None
        ranges = slot.held()
        assert len(ranges) <= RANGES, ranges
        spans = [bound for span in ranges for bound in span] + [0, 0] * (RANGES - len(ranges))
        header = torch.tensor([MAGIC, self.token, self.gen, slot.step, len(slot.meta), slot.nbytes, slot.digest,
                               *spans, -1 if replaced is None else replaced], dtype=torch.int64)
        meta = torch.frombuffer(bytearray(slot.meta), dtype=torch.uint8)
        self.sent += 1
        self.plane.put(Keys.announce(self.prefix, self.sent), Announce(self.gen, slot.step),  # wakes the idle holder
                       drop=Keys.announce(self.prefix, self.sent - 1) if self.sent > 1 else None)
        for tag, tensor in enumerate((header, meta)):
            _wait(self.group.send([tensor], 1, tag), self.timeout_s)
        midway()
        for start, end in ranges:  # in order on one tag: gloo matches them in order
            _wait(self.group.send([slot.data[start:end]], 1, 2), self.timeout_s)
        ack = torch.zeros(3, dtype=torch.int64)
        _wait(self.group.recv([ack], 1, 3), self.timeout_s)
        step, digest, ok = ack.tolist()
        if (step, digest, ok) != (slot.step, slot.digest, 1):
            raise ProtocolError(f"holder rejected snapshot {slot.step}: acked step {step}, digest {digest:#x} "
                                f"(sent {slot.digest:#x}), ok={ok}")


class ReplicaReceiver:
    """A holder's end of one replica stream: keeps the rank's two newest snapshots in two slots."""

    def __init__(self, store: PlaneStore, prefix: str, token: str, gen: int, slots: list[Slot],
                 timeout_s: float, trusted: bool = False) -> None:
        self.group = pair_group(store, prefix, 1, timeout_s)
        self.trusted = trusted  # checked for a recovery that uses it now (not kept for later): Slot.trusted
        self.plane, self.prefix, self.received = ControlPlane(store.client), prefix, 0
        self.token = token_id(token)
        self.gen = gen
        self.slots = slots
        self.timeout_s = timeout_s
        self.writing: Slot | None = None  # the slot a receive is filling (unsealed until its checksum passes)

    def receive_one(self, committed: Callable[[], int | None], stopped: Callable[[], bool],
                    endings: Sequence[str] = ()) -> Slot:
        """Receives the next snapshot into the slot slots.pick_slot chooses (`committed()` asks the store for
        the newest committed step, where the header's `replaced` does not decide). `endings`:
        keys written when whoever stops this receiver is about to (the generation's abort, the job's end)."""
        self.received += 1
        announce = Keys.announce(self.prefix, self.received)
        # idle between snapshots is normal: the wait blocks in the store, asking `stopped` once a slice, a long
        # one while the endings are not written (a few requests a second per held rank), 50 ms once they are
        if self.plane.wait([announce, *endings], float("inf"), give_up=stopped, slice_s=IDLE_SLICE_S) != announce:
            self.plane.wait([announce], float("inf"), give_up=stopped)
        header = torch.zeros(HEADER, dtype=torch.int64)
        _wait(self.group.recv([header], 0, 0), self.timeout_s)
        magic, token, gen, step, meta_len, nbytes, digest, *spans, replaced = header.tolist()
        if magic != MAGIC or token != self.token or gen != self.gen:
            raise ProtocolError(f"rejected replica header: magic {magic:#x}, token ok={token == self.token}, "
                                f"generation {gen} (expected {self.gen})")
        meta = torch.empty(meta_len, dtype=torch.uint8)
        _wait(self.group.recv([meta], 0, 1), self.timeout_s)
        meta_bytes = meta.numpy().tobytes()
        ranges = _held(spans, nbytes, step)
        slot = self.writing = pick_slot(self.slots, None if replaced < 0 else replaced, committed)
        data = slot.reserve(nbytes)
        for start, end in ranges:
            _wait(self.group.recv([data[start:end]], 0, 2), self.timeout_s)
        got = checksum(meta_bytes, slot.data, ranges)
        ok = int(got == digest)
        if ok:
            slot.seal(step, meta_bytes, digest, trusted=self.trusted, ranges=ranges)
        self.writing = None
        _wait(self.group.send([torch.tensor([step, got, ok], dtype=torch.int64)], 0, 3), self.timeout_s)
        if not ok:
            raise ChecksumMismatch(step, f"replica of snapshot {step} failed its checksum ({got:#x} != {digest:#x})")
        return slot


def _held(spans: list[int], nbytes: int, step: int) -> list[tuple[int, int]]:
    """The byte ranges an arriving snapshot holds, from its header's (start, end) pairs, empty ones left out.
    Not trusted: they must lie in order inside its `nbytes`, and the checksum, computed over them and the
    metadata, must then match the sender's (which covered the ranges its metadata names)."""
    ranges = [(a, b) for a, b in zip(spans[::2], spans[1::2]) if (a, b) != (0, 0)]
    ends = [0] + [b for _, b in ranges[:-1]]
    if any(not end <= a < b <= nbytes for (a, b), end in zip(ranges, ends)):
        raise ProtocolError(f"replica of snapshot {step}: held ranges {ranges} out of order or outside its "
                            f"{nbytes} bytes")
    return ranges


def send_replica(store: PlaneStore, prefix: str, token: str, gen: int, slots: list[Slot], timeout_s: float,
                 announced: Callable[[], None] = lambda: None, midway: Callable[[], None] = lambda: None) -> int:
    """Recovery, holder -> taker: streams every snapshot of one rank it holds to the process taking it over,
    unchecked: the taker checks each on arrival anyway (the one pass over the bytes a transfer needs) and
    keeps only those that pass. Returns how many the taker accepted. `announced` runs once the taker knows how
    many come, before the two connect (a planned fault: the holder dies while its taker waits for it);
    `midway` before the first snapshot's data (a planned fault: the holder dies while its taker receives)."""
    sealed = sorted((s for s in slots if s.step is not None), key=lambda s: s.step or 0)
    ControlPlane(store.client).put(Keys.handover(prefix), Handover(gen, len(sealed)))
    accepted = 0
    if sealed:
        announced()
        sender = ReplicaSender(store, prefix, token, gen, timeout_s)
        for i, slot in enumerate(sealed):
            try:
                sender.send(slot, midway if i == 0 else lambda: None)
                accepted += 1
            except ProtocolError:  # corrupted in the holder's memory: the taker dropped it and reports the rest
                pass
    return accepted


def receive_replica(store: PlaneStore, prefix: str, token: str, gen: int, timeout_s: float, deadline: float,
                    stopped: Callable[[], bool]) -> tuple[list[Slot], list[ChecksumMismatch]]:
    """The taker's end of send_replica: two fresh slots holding what arrived intact, and what did not."""
    plane = ControlPlane(store.client)
    plane.wait([Keys.handover(prefix)], deadline, give_up=stopped)
    count = plane.get(Keys.handover(prefix), Handover).snapshots
    slots, rejected = [Slot(), Slot()], []
    if count:
        receiver = ReplicaReceiver(store, prefix, token, gen, slots, timeout_s, trusted=True)
        for _ in range(count):
            try:
                receiver.receive_one(lambda: None, stopped)
            except ChecksumMismatch as error:
                rejected.append(error)
    return slots, rejected
