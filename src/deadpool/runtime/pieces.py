"""A data-parallel rank's piece of the replicated state at work: what the snapshot engine copies, the audit
of another rank's piece that keeps the divergence check whole, and the gather that makes a restored slot whole.

Where the pieces lie is slices.py (pure); this module moves and hashes their bytes.

    snapshot k, rank r of N:  copy + hash piece r and the private state (one pass)  -> piece hash P_r(k)
                              unless r == j = k mod N: hash piece j of the live tensors (no copy) -> A_r(k)
    coordinator:              A_r(k) == P_j(k) for every rank r != j (divergence.check_replicas)
    restore of step C:        the ranks whose live state is not C's receive the pieces from their owners
"""

from __future__ import annotations

import functools
import json
import time
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from deadpool.runtime.comms import collective, communicating
from deadpool.runtime.digest import CHUNK, Digest, Source, copy_hashed, int64, new_hasher
from deadpool.runtime.slices import cuts, held, spans
from deadpool.runtime.slots import Slot
from deadpool.runtime.state import ALIGN, Flat, Layout

Piece = tuple[int, int]


def piece_of(layout: Layout, rank: int, world: int) -> Piece:
    """Rank's piece of the lead region when the replicated state is cut among `world` ranks."""
    c = cuts(layout, world)
    return c[rank], c[rank + 1]


def audited(world: int, taken: int) -> int:
    """The piece every rank but its owner audits in the `taken`-th snapshot of a generation (counted alike on
    every rank): each of the N pieces in turn, so that each snapshot compares N opinions of one piece (a
    majority names the odd rank out) and every N snapshots compare all of the replicated state."""
    return taken % world


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@functools.lru_cache(maxsize=16)
def _rows(layout: Layout, piece: Piece) -> tuple[tuple[int, int, int, bool], ...]:
    """(tensor index, first byte, end byte, whether the tensor's padding follows) of the piece's rows. Worked
    out once per layout and piece: every snapshot of a generation asks again (a walk over every tensor)."""
    out = []
    for i, first, last in spans(layout, *piece):
        _, shape, _, nbytes = layout.specs[i]
        row = nbytes // (shape[0] if shape else 1)
        out.append((i, first * row, last * row, last * row == nbytes))
    return tuple(out)


def sources(tensors: Sequence[torch.Tensor], layout: Layout, piece: Piece | None) -> list[Source]:
    """What a snapshot copies (digest.copy_hashed): the rows of `piece` (None: every lead tensor whole) and
    every private tensor, as flat bytes with their place in the slot and the end of their zeroed padding."""
    lead = layout.lead_nbytes
    out: list[Source] = []
    for i, start, end, last in _rows(layout, piece or (0, lead)):
        offset, nbytes = layout.specs[i][2], layout.specs[i][3]
        data = _bytes(tensors[i])
        out.append((data if (start, end) == (0, nbytes) else data[start:end], offset + start,
                    offset + (_padded(nbytes) if last else end)))
    for i, (_, _, offset, nbytes) in enumerate(layout.specs):
        if offset >= lead:
            out.append((_bytes(tensors[i]), offset, offset + _padded(nbytes)))
    return out


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def copy_in(tensors: Sequence[torch.Tensor], layout: Layout, buffer: torch.Tensor, piece: Piece | None,
            other: Piece | None, *, stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None,
            copied: Callable[[], None], midway: Callable[[], None]) -> tuple[Digest, int | None]:
    """One snapshot: copies `piece` of the replicated state (None: all of it) and the private tensors into
    their places in the slot and hashes them in the same pass (digest.copy_hashed); on GPU through `stream`
    (after the training stream's `ready`) into pinned memory, hashed once it has landed. Then it audits piece
    `other` of the live tensors, which the next optimizer step will change: training may go on (`copied`)
    once that is done and the last byte is in the slot; the hash of the last chunk does not hold it up.
    Returns the digest and the audit's hash (None without `other`)."""
    seen: list[int] = []

    def settle() -> None:
        if stream is not None:
            stream.synchronize()
        if other is not None:
            seen.append(audit(tensors, layout, other))
        copied()

    ranges = held(layout.lead_nbytes, layout.nbytes, piece)
    lead = layout.lead_nbytes if piece is None else piece[1] - piece[0]
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        if ready is not None and stream is not None:
            stream.wait_event(ready)
        digest = copy_hashed(sources(tensors, layout, piece), buffer, ranges, lead, device=stream is not None,
                             midway=midway, settle=settle)
    return digest, seen[0] if seen else None


def audit(tensors: Sequence[torch.Tensor], layout: Layout, piece: Piece) -> int:
    """The hash of `piece` of this rank's live replicated state, fed the very byte stream its owner's snapshot
    hashes (rows, then zero padding), so it equals the owner's piece hash exactly when the bytes are equal.
    Read straight from the tensors: no copy into a slot (from a GPU, staged to the host chunk by chunk)."""
    hasher = new_hasher()
    for i, start, end, last in _rows(layout, piece):
        data = _bytes(tensors[i])
        if data.is_cuda:
            for a in range(start, end, CHUNK):
                hasher.update(data[a: min(end, a + CHUNK)].cpu().numpy().data)
        else:  # a row of a small tensor costs its Python calls more than its bytes: one view, sliced for free
            raw = data.numpy().data
            for a in range(start, end, CHUNK):
                hasher.update(raw[a: min(end, a + CHUNK)])
        if last:
            nbytes = layout.specs[i][3]
            hasher.update(bytes(_padded(nbytes) - nbytes))
    return int64(hasher.intdigest())


def gather(slot: Slot, rank: int, world: int, device: torch.device, interrupted: Callable[[], bool],
           timeout_s: float, live: Flat | None = None) -> dict[str, Any]:
    """Makes the lead region of `slot` whole, every rank of the generation calling it with the same step; a
    peer's failure or the generation's abort raises PeerFailure (comms.collective), bounded by `timeout_s`.

    On the CPU the ranks first tell each other, in one all-gather, whether they need anything: a rank whose
    slot is whole (read from disk) does not, nor one whose `live` state still equals the snapshot piece for
    piece (a survivor of a failure before its next optimizer step: its hash of each piece of its live tensors
    equals the piece's owner's hash of its slot), which copies its live tensors into its slot instead. The
    others (a spare that took a rank, a survivor past the snapshot) receive the pieces: sent point to point by
    their owners when they are at most half of the ranks, else by N broadcasts. On a GPU the N broadcasts go
    through one piece-sized buffer on the device, since NCCL moves device memory."""
    meta = json.loads(slot.meta)
    layout = Layout(Layout.from_json(meta["tensors"], slot.nbytes).specs, slot.nbytes, meta["lead"])
    c = cuts(layout, world)
    pieces = list(zip(c, c[1:]))
    assert "slice" not in meta or tuple(meta["slice"]) == pieces[rank], "a slot of another rank's piece"
    start = time.monotonic()
    if device.type == "cuda":
        return {"received": _broadcasts(slot, pieces, rank, device, interrupted, timeout_s), "mode": "broadcast",
                "seconds": time.monotonic() - start}
    usable = live is not None and Layout.of(live.tensors, lead=live.stable).specs == layout.specs
    mine = torch.zeros(world + 2, dtype=torch.int64)
    mine[0] = _slot_hash(slot, pieces[rank])
    mine[1] = 2 if "slice" not in meta else 1 if usable else 0
    if usable:
        assert live is not None
        mine[2:] = torch.tensor([audit(live.tensors, layout, piece) for piece in pieces], dtype=torch.int64)
    table = [torch.zeros_like(mine) for _ in range(world)]
    collective(lambda: dist.all_gather(table, mine, async_op=True), interrupted, timeout_s,
               f"telling which ranks need pieces of snapshot {slot.step}")
    owners = torch.stack([row[0] for row in table])
    needy = [r for r, row in enumerate(table) if row[1] == 0 or (row[1] == 1 and not torch.equal(row[2:], owners))]
    if 2 * len(needy) > world:  # most ranks need the pieces: every rank receives every piece, as before
        received = _broadcasts(slot, pieces, rank, device, interrupted, timeout_s)
        return {"received": received, "mode": "broadcast", "needy": needy, "seconds": time.monotonic() - start}
    if rank not in needy and "slice" in meta:  # the others' pieces are this rank's live tensors: copied in
        assert live is not None
        for owner, piece in enumerate(pieces):
            if owner != rank:
                _fill(live.tensors, layout, piece, slot.buffer)
    received, mode = (_point_to_point(slot, pieces, rank, needy, timeout_s), "point-to-point") if needy else (0, "none")
    return {"received": received, "mode": mode, "needy": needy, "seconds": time.monotonic() - start}


def _slot_hash(slot: Slot, piece: Piece) -> int:
    """The hash of a piece's bytes in a slot: the stream `audit` hashes from live tensors (rows, then padding)."""
    hasher = new_hasher()
    raw = slot.buffer.numpy().data
    for a in range(piece[0], piece[1], CHUNK):
        hasher.update(raw[a: min(piece[1], a + CHUNK)])
    return int64(hasher.intdigest())


def _fill(tensors: Sequence[torch.Tensor], layout: Layout, piece: Piece, buffer: torch.Tensor) -> None:
    """Copies `piece` of the live replicated state into its place in a slot, padding zeroed: the bytes its
    owner's snapshot holds, when the live tensors hash as that snapshot's piece."""
    for i, start, end, last in _rows(layout, piece):
        offset, nbytes = layout.specs[i][2], layout.specs[i][3]
        buffer[offset + start: offset + end].copy_(_bytes(tensors[i])[start:end])
        if last:
            buffer[offset + nbytes: offset + _padded(nbytes)].zero_()


def _point_to_point(slot: Slot, pieces: list[Piece], rank: int, needy: list[int], timeout_s: float) -> int:
    """Each owner sends its piece to every needy rank, all at once; returns the bytes this rank received.
    gloo's sends and receives complete only in `wait` (they have no future), bounded by `timeout_s`; an abort
    shuts the group's connections (comms.abandon_group), which fails the wait at once."""
    works, received = [], 0
    with communicating(f"sending the pieces of snapshot {slot.step} to ranks {needy}"):
        for owner, (a, b) in enumerate(pieces):
            for taker in needy:
                if b == a or taker == owner or rank not in (owner, taker):
                    continue
                view = slot.buffer[a:b]
                if rank == owner:
                    work = dist.isend(view, taker, tag=owner)
                else:
                    work = dist.irecv(view, owner, tag=owner)
                    received += b - a
                assert work is not None  # every rank is in the default group
                works.append(work)
        deadline = time.monotonic() + timeout_s
        for work in works:
            work.wait(timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())))
    return received


def _broadcasts(slot: Slot, pieces: list[Piece], rank: int, device: torch.device, interrupted: Callable[[], bool],
                timeout_s: float) -> int:
    """Rank i broadcasts piece i over the default group, straight from and into each slot's own bytes (no second
    copy of the state in memory; on a GPU through one piece-sized device buffer); returns the bytes received."""
    stage = torch.empty(max(b - a for a, b in pieces), dtype=torch.uint8, device=device) \
        if device.type == "cuda" else None
    received = 0
    for owner, (a, b) in enumerate(pieces):
        if b == a:
            continue
        view = slot.buffer[a:b]
        wire = view if stage is None else stage[: b - a]
        if stage is not None and owner == rank:
            wire.copy_(view)
        collective(partial(dist.broadcast, wire, src=owner, async_op=True), interrupted, timeout_s,
                   f"gathering piece {owner} of snapshot {slot.step}")
        if owner != rank:
            if stage is not None:
                view.copy_(wire)
            received += b - a
    return received
