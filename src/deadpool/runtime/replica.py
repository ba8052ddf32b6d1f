"""Streams finished snapshots to their holders over a socket of their own, straight into the holder's slot.

One stream per (rank, holder, generation) (runtime/stream.py: the sender listens, the holder connects, each
proves the job's secret):

    sender (worker, rank r)                  holder (spare)
                                             idle: waits for the socket to turn readable
    header frame: [gen, step, nbytes, digest,
      the held byte ranges (two start, end pairs),
      replaced, arena] + the metadata (JSON)  ->  wakes; picks the slot to overwrite
    data: each byte range the slot holds     ->  received into the slot's own buffer, in place
          (slots.held_ranges: a data-parallel piece and the private state, or all of it)
                                             <-  ack frame [step, digest, ok]  (recomputed by the holder)

To a holder on the same machine (Stream.local) a slot in shared memory is not sent: the header says where
its arena is (arena.py: pid, fd, inode, size; zeros when the data follows), the holder maps it (once per
arena) and acknowledges the sender's digest, which it checks before a recovery uses the slot, as it does
for any replica. A holder that cannot map it acknowledges with ok = -1 and the sender streams it instead,
from then on.

The digest (runtime/digest.py: blocked xxh3_64) travels as a signed int64, in a frame
whose MAC proves it came from the job; the data, which it covers, travels raw. The header carries what
the holder needs before the data, so it neither parses the metadata (tens of kB of JSON for a real model)
nor asks the store which step is committed: `replaced` is the step the sender's own slot held before
(slots.pick_slot; -1: none).
"""

from __future__ import annotations

import struct
from typing import Callable

import torch

from deadpool.errors import ChecksumMismatch, ProtocolError
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Handover
from deadpool.runtime.arena import Arena, map_arena
from deadpool.runtime.digest import CHUNK, Digest, new_hasher
from deadpool.runtime.slots import Slot, pick_slot
from deadpool.runtime.stream import Stream, join, offer

RANGES = 2  # held byte ranges a snapshot has at most (slices.held: its piece, then its private state)
HEADER = struct.Struct(f"!{4 + 2 * RANGES + 1 + 4}q")  # gen, step, nbytes, digest, the ranges' bounds, replaced,
# then the arena: pid, fd, inode, its size (pid 0: the data follows)
UNMAPPED = -1  # an ack's `ok` from a holder that could not map the arena: stream it
ACK = struct.Struct("!3q")  # step, digest, ok
IDLE_SLICE_S = 0.25  # an idle holder asks whether to stop this often (closing the stream wakes it at once)


class ReplicaSender:
    """A worker's end of one replica stream. Listens until its holder connects (up to `timeout_s`); a peer
    that cannot prove the job's secret is refused and reported to `refused`."""

    def __init__(self, plane: ControlPlane, prefix: str, secret: bytes, gen: int, timeout_s: float,
                 stopped: Callable[[], bool] = lambda: False,
                 refused: Callable[[str], None] = lambda why: None, share: bool = True) -> None:
        self.stream: Stream = offer(plane, prefix, secret, gen, timeout_s, stopped, refused)
        self.gen = gen
        self.share = share and self.stream.local  # a holder on this machine maps slots in shared memory

    def send(self, slot: Slot, midway: Callable[[], None] = lambda: None, replaced: int | None = None) -> int:
        """Sends one sealed slot and checks the holder's acknowledgement of (step, checksum); returns the
        bytes that crossed the stream (0: the holder mapped the slot's arena). `replaced`: the step this slot
        held before the snapshot (the holder overwrites the same one), if the caller knows it."""
        assert slot.step is not None
        ranges = slot.held()
        assert len(ranges) <= RANGES, ranges
        spans = [bound for span in ranges for bound in span] + [0, 0] * (RANGES - len(ranges))
        arena = slot.arena if self.share else None
        where = (arena.pid, arena.fd, arena.inode, arena.nbytes) if arena else (0, 0, 0, 0)
        self.stream.send_frame(HEADER.pack(self.gen, slot.step, slot.nbytes, slot.digest, *spans,
                                           -1 if replaced is None else replaced, *where) + slot.meta)
        midway()
        if arena is None:
            for start, end in ranges:
                self.stream.send_bytes(slot.data[start:end])
        step, digest, ok = ACK.unpack(self.stream.recv_frame())
        if arena is not None and (step, ok) == (slot.step, UNMAPPED):
            self.share = False
            return self.send(slot, replaced=replaced)
        if (step, digest, ok) != (slot.step, slot.digest, 1):
            raise ProtocolError(f"holder rejected snapshot {slot.step}: acked step {step}, digest {digest:#x} "
                                f"(sent {slot.digest:#x}), ok={ok}")
        return 0 if arena else sum(end - start for start, end in ranges)

    def close(self) -> None:
        """Ends the stream: its holder sees it closed and stops receiving."""
        self.stream.close()


class ReplicaReceiver:
    """A holder's end of one replica stream: keeps the rank's two newest snapshots in two slots."""

    def __init__(self, plane: ControlPlane, prefix: str, secret: bytes, gen: int, slots: list[Slot],
                 timeout_s: float, trusted: bool = False, stopped: Callable[[], bool] = lambda: False) -> None:
        self.stream: Stream = join(plane, prefix, secret, gen, timeout_s, stopped)
        self.trusted = trusted  # checked for a recovery that uses it now (not kept for later): Slot.trusted
        self.gen = gen
        self.slots = slots
        self.writing: Slot | None = None  # the slot a receive is filling (unsealed until its checksum passes)
        self.arenas: dict[Arena, torch.Tensor] = {}  # the sender's arenas mapped here, while a slot shows one

    def receive_one(self, committed: Callable[[], int | None], stopped: Callable[[], bool]) -> Slot:
        """Receives the next snapshot into the slot slots.pick_slot chooses (`committed()` asks the store for
        the newest committed step, where the header's `replaced` does not decide). Idle until it comes;
        InterruptedError once `stopped()`. ChecksumMismatch leaves the stream usable; any other error ends it."""
        self.stream.wait_readable(stopped, IDLE_SLICE_S)
        frame = self.stream.recv_frame()
        if len(frame) < HEADER.size:
            raise ProtocolError(f"a replica header of {len(frame)} bytes (expected at least {HEADER.size})")
        gen, step, nbytes, digest, *spans, replaced, pid, fd, inode, size = HEADER.unpack_from(frame)
        if gen != self.gen:
            raise ProtocolError(f"rejected a replica header of generation {gen} (expected {self.gen})")
        meta_bytes = frame[HEADER.size:]
        ranges = _held(spans, nbytes, step)
        slot = self.writing = pick_slot(self.slots, None if replaced < 0 else replaced, committed)
        if pid:
            if not self._adopt(slot, Arena(pid, fd, inode, size), nbytes):
                self.writing = None
                self.stream.send_frame(ACK.pack(step, 0, UNMAPPED))
                return self.receive_one(committed, stopped)  # the sender streams it now
            slot.seal(step, meta_bytes, digest, ranges=ranges)  # checked before a recovery uses it
            self.writing = None
            self.stream.send_frame(ACK.pack(step, digest, 1))
            return slot
        data, hashing = slot.reserve(nbytes), Digest(hasher=new_hasher(parallel=True))
        for start, end in ranges:  # hashed chunk by chunk as it lands (on hash threads: the receive goes on)
            self.stream.recv_bytes(data[start:end], hashing.update, CHUNK)
        got = hashing.finish(meta_bytes)[1]
        ok = int(got == digest)
        if ok:
            slot.seal(step, meta_bytes, digest, trusted=self.trusted, ranges=ranges)
        self.writing = None
        self.stream.send_frame(ACK.pack(step, got, ok))
        if not ok:
            raise ChecksumMismatch(step, f"replica of snapshot {step} failed its checksum ({got:#x} != {digest:#x})")
        return slot

    def _adopt(self, slot: Slot, arena: Arena, nbytes: int) -> bool:
        """Makes `slot` a view of the sender's `arena` (mapped once); False if it cannot be mapped here."""
        if arena.nbytes < nbytes:
            raise ProtocolError(f"a snapshot of {nbytes} bytes announced in an arena of {arena.nbytes}")
        if arena not in self.arenas:
            try:
                self.arenas[arena] = map_arena(arena)
            except ProtocolError:
                return False
        slot.adopt(self.arenas[arena], nbytes)
        self.arenas = {a: m for a, m in self.arenas.items() if any(s.buffer is m for s in self.slots)}
        return True

    def close(self) -> None:
        self.stream.close()


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


def send_replica(plane: ControlPlane, prefix: str, secret: bytes, gen: int, slots: list[Slot], timeout_s: float,
                 stopped: Callable[[], bool] = lambda: False, announced: Callable[[], None] = lambda: None,
                 midway: Callable[[], None] = lambda: None) -> int:
    """Recovery, holder -> taker: streams every snapshot of one rank it holds to the process taking it over,
    unchecked: the taker checks each on arrival anyway (the one pass over the bytes a transfer needs) and
    keeps only those that pass. Returns how many the taker accepted. `announced` runs once the taker knows how
    many come, before the two connect (a planned fault: the holder dies while its taker waits for it);
    `midway` before the first snapshot's data (a planned fault: the holder dies while its taker receives).
    Gives up (InterruptedError) once `stopped()`, while the taker has not connected."""
    sealed = sorted((s for s in slots if s.step is not None), key=lambda s: s.step or 0)
    plane.put(Keys.handover(prefix), Handover(gen, len(sealed)))
    accepted = 0
    if sealed:
        announced()
        sender = ReplicaSender(plane, prefix, secret, gen, timeout_s, stopped)
        try:
            for i, slot in enumerate(sealed):
                try:
                    sender.send(slot, midway if i == 0 else lambda: None)
                    accepted += 1
                except ProtocolError:  # corrupted in the holder's memory: the taker dropped it, reports the rest
                    pass
        finally:
            sender.close()
    return accepted


def receive_replica(plane: ControlPlane, prefix: str, secret: bytes, gen: int, timeout_s: float, deadline: float,
                    stopped: Callable[[], bool]) -> tuple[list[Slot], list[ChecksumMismatch]]:
    """The taker's end of send_replica: two fresh slots holding what arrived intact, and what did not."""
    plane.wait([Keys.handover(prefix)], deadline, give_up=stopped)
    count = plane.get(Keys.handover(prefix), Handover).snapshots
    slots, rejected = [Slot(), Slot()], []
    if count:
        receiver = ReplicaReceiver(plane, prefix, secret, gen, slots, timeout_s, trusted=True, stopped=stopped)
        try:
            for _ in range(count):
                try:
                    receiver.receive_one(lambda: None, stopped)
                except ChecksumMismatch as error:
                    rejected.append(error)
        finally:
            receiver.close()
    return slots, rejected
