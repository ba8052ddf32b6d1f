"""Slices: where a data-parallel rank's piece of the replicated state begins and ends in a slot (pure).

Under data parallelism every rank's parameters and optimizer state (the slot's *lead* region, state.Layout)
are the same bytes, so each of the N ranks snapshots, hashes and replicates only its own piece of that region,
plus its private state (the rest of the slot). Pieces are cut at dim-0 row boundaries of the lead tensors
(or where a tensor's padded end is), so a piece is a set of whole rows of global tensors: chunks that the
disk tier writes as they are (DCP). A restore puts the pieces of the N ranks back together.

A slot that holds a piece says so in its metadata ("slice": [start, end]); `held` gives the byte ranges it
holds, which is what its checksum covers (slots.checksum), what a holder receives and what is copied out.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache

from deadpool.runtime.state import ALIGN, Layout

Span = tuple[int, int, int]  # (tensor index, first row, end row): rows [first, end) of a lead tensor


def _rows(shape: tuple[int, ...]) -> int:
    """Rows along dim 0: a 0-dim tensor is one row."""
    return shape[0] if shape else 1


def _lead(layout: Layout) -> list[tuple[int, str, tuple[int, ...], int, int]]:
    """The lead tensors (those inside the lead region), by offset: (index, dtype, shape, offset, nbytes)."""
    found = [(i, d, s, o, n) for i, (d, s, o, n) in enumerate(layout.specs) if o < layout.lead_nbytes and n]
    return sorted(found, key=lambda t: t[3])


@lru_cache(maxsize=16)  # asked for every snapshot of a generation; a walk over every tensor
def cuts(layout: Layout, n: int) -> tuple[int, ...]:
    """n + 1 offsets 0 = c0 <= c1 <= ... <= cn = lead_nbytes; piece i is [c_i, c_i+1). Each inner cut is the
    row boundary nearest to i/n of the lead region (a tensor's last row ends at its padded end), so pieces
    hold about equal bytes; a tensor with one huge row stays whole, and a piece may then be empty."""
    if n < 1:
        raise ValueError(f"cannot cut the replicated state into {n} pieces")
    lead = _lead(layout)
    starts = [o for _, _, _, o, _ in lead]
    out = [0]
    for i in range(1, n):
        target = layout.lead_nbytes * i // n
        k = bisect_right(starts, target) - 1
        if k < 0:
            out.append(max(out[-1], 0))
            continue
        _, _, shape, offset, nbytes = lead[k]
        rows = _rows(shape)
        row = round((target - offset) / (nbytes / rows))
        row = min(max(row, 0), rows)
        cut = offset + row * (nbytes // rows) if row < rows else offset - (-nbytes // ALIGN) * ALIGN
        out.append(max(out[-1], cut))
    out.append(layout.lead_nbytes)
    return tuple(out)


def spans(layout: Layout, start: int, end: int) -> list[Span]:
    """The rows of lead tensors inside bytes [start, end) of the lead region (a piece: cut at row
    boundaries); padding after a tensor belongs to the piece that holds the tensor's last row."""
    out: list[Span] = []
    for i, _, shape, offset, nbytes in _lead(layout):
        rows = _rows(shape)
        row_bytes = nbytes // rows
        first = min(max(start - offset, 0) // row_bytes, rows) if start > offset else 0
        last = min(max(end - offset, 0) // row_bytes, rows) if end < offset + nbytes else rows
        if last > first:
            out.append((i, first, last))
    return out


def held(lead_nbytes: int, nbytes: int, piece: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The byte ranges of a slot that a snapshot holds, in order: its piece of the lead region (None: the
    whole of it) and everything after it (private state), as one range where they touch (one message
    fewer to send)."""
    start, end = (0, lead_nbytes) if piece is None else piece
    if end == lead_nbytes:
        return [(start, nbytes)] if nbytes > start else []
    return [(a, b) for a, b in [(start, end), (lead_nbytes, nbytes)] if b > a]
