"""Slices of the replicated state: cuts at row boundaries, about equal pieces, and what a sliced slot holds."""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.runtime.slices import cuts, held, spans
from deadpool.runtime.slots import checksum, held_ranges, make_meta
from deadpool.runtime.state import ALIGN, Layout


def _layout() -> tuple[list[torch.Tensor], Layout]:
    tensors = [torch.arange(300, dtype=torch.float32).reshape(100, 3),  # 12-byte rows
               torch.tensor(7.0),                                      # 0-dim: one row
               torch.arange(50, dtype=torch.int64).reshape(10, 5),     # 40-byte rows
               torch.ones(33, dtype=torch.uint8)]                      # private (not lead)
    return tensors, Layout.of(tensors, lead=[True, True, True, False])


def _row_boundaries(layout: Layout) -> set[int]:
    found = {0, layout.lead_nbytes}
    for _dtype, shape, offset, nbytes in layout.specs:
        if offset < layout.lead_nbytes:
            rows = shape[0] if shape else 1
            found |= {offset + r * (nbytes // rows) for r in range(rows)}
            found.add(offset - (-nbytes // ALIGN) * ALIGN)
    return found


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_cuts_are_ordered_row_boundaries_that_cover_the_lead_region(n: int) -> None:
    _, layout = _layout()
    c = cuts(layout, n)
    assert len(c) == n + 1 and c[0] == 0 and c[-1] == layout.lead_nbytes
    assert list(c) == sorted(c)
    assert set(c) <= _row_boundaries(layout)


def test_pieces_are_about_equal() -> None:
    tensors = [torch.zeros(1000, 16) for _ in range(3)]
    layout = Layout.of(tensors, lead=[True] * 3)
    c = cuts(layout, 4)
    sizes = [b - a for a, b in zip(c, c[1:])]
    assert max(sizes) - min(sizes) <= 64  # one 64-byte row at most


def test_spans_of_all_pieces_cover_every_row_once() -> None:
    _, layout = _layout()
    c = cuts(layout, 5)
    rows: dict[int, list[int]] = {}
    for a, b in zip(c, c[1:]):
        for i, first, end in spans(layout, a, b):
            rows.setdefault(i, []).extend(range(first, end))
    assert rows == {0: list(range(100)), 1: [0], 2: list(range(10))}


def test_spans_of_one_piece_are_its_bytes() -> None:
    _, layout = _layout()
    offset = layout.specs[0][2]
    assert spans(layout, offset + 24, offset + 120) == [(0, 2, 10)]


def test_held_ranges_are_the_piece_then_the_private_state_joined_where_they_touch() -> None:
    assert held(100, 160, None) == [(0, 160)]
    assert held(100, 160, (40, 80)) == [(40, 80), (100, 160)]
    assert held(100, 160, (60, 100)) == [(60, 160)]  # the last piece
    assert held(100, 160, (100, 100)) == [(100, 160)]  # an empty piece: the private state only
    assert held(100, 100, (0, 0)) == []


def test_checksum_of_a_sliced_slot_covers_only_its_bytes() -> None:
    tensors, layout = _layout()
    piece = cuts(layout, 2)[:2]
    meta = make_meta(3, None, layout, [False] * 4, [False] * 4, [True, True, True, False], True, piece)
    assert json.loads(meta)["slice"] == list(piece)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    before = checksum(meta, data)
    data[piece[1]] = 1  # the other piece: not held, not covered
    assert checksum(meta, data) == before
    data[piece[0]] = 1
    assert checksum(meta, data) != before
    assert held_ranges(meta, layout.nbytes) == [piece, (layout.lead_nbytes, layout.nbytes)]


def test_an_unsliced_slot_is_checked_whole() -> None:
    _, layout = _layout()
    meta = make_meta(3, None, layout, [False] * 4, [False] * 4, [True, True, True, False], True)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    before = checksum(meta, data)
    data[1] = 1
    assert checksum(meta, data) != before
