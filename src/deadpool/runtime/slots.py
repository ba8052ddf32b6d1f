"""Host-memory slots: one preallocated byte buffer holds one snapshot of one rank, with its checksum."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import torch

from deadpool.runtime.state import Layout


def checksum(meta: bytes, data: torch.Tensor) -> int:
    """CRC-32 over the data bytes, then the metadata (zlib releases the GIL on large buffers)."""
    return checksums(meta, data, 0)[1]


def checksums(meta: bytes, data: torch.Tensor, lead_nbytes: int) -> tuple[int, int]:
    """(CRC-32 of the first `lead_nbytes` bytes, `checksum(meta, data)`) in one pass over the data:
    a CRC continued over the rest is the CRC of the whole."""
    raw = data.numpy().data
    lead = zlib.crc32(raw[:lead_nbytes])
    return lead, zlib.crc32(meta, zlib.crc32(raw[lead_nbytes:], lead))


@dataclass
class Slot:
    """A byte buffer and what it currently holds; `step` is None while it is empty or being written."""

    pinned: bool = False
    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    step: int | None = None
    meta: bytes = b""
    nbytes: int = 0
    crc: int = 0

    def reserve(self, nbytes: int) -> torch.Tensor:
        """Marks the slot empty and returns its first `nbytes` bytes, growing the buffer only if needed."""
        self.step = None
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.nbytes = nbytes
        return self.buffer[:nbytes]

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    def seal(self, step: int, meta: bytes, crc: int) -> None:
        self.meta, self.crc, self.step = meta, crc, step

    def intact(self) -> bool:
        """Recomputes the checksum: a slot whose bytes changed since it was sealed is never restored from."""
        return self.step is not None and checksum(self.meta, self.data) == self.crc

    def tensors(self) -> tuple[dict, list[torch.Tensor], list[bool]]:
        """Private copies of the tensors in this slot, with the skeleton to rebuild the state from."""
        meta = json.loads(self.meta)
        layout = Layout.from_json(meta["tensors"], self.nbytes)
        out = []
        for dtype, shape, offset, n in layout.specs:
            raw = self.buffer[offset: offset + n]
            out.append(raw.view(getattr(torch, dtype)).reshape(shape).clone())
        return meta["skeleton"], out, meta["numpy"]


def make_meta(step: int, skeleton: object, layout: Layout, numpy_flags: list[bool]) -> bytes:
    return json.dumps({"step": step, "skeleton": skeleton, "tensors": layout.to_json(),
                       "numpy": numpy_flags, "nbytes": layout.nbytes}).encode()


def free_slot(slots: list[Slot], committed: int | None, abandoned: list[int]) -> Slot | None:
    """A slot a rank's next snapshot may overwrite, or None: an empty one, one older than the newest
    committed step, or one holding a step some rank skipped (it can never be committed). A durable
    step that may still be committed is kept, and so is the newest committed step."""
    free = [s for s in slots if s.step is None or (committed is not None and s.step < committed)
            or s.step in abandoned]
    return min(free, key=lambda s: -1 if s.step is None else s.step) if free else None


def pick_slot(slots: list[Slot], committed: int | None) -> Slot:
    """The slot a holder receives a replica into: never the one holding the newest committed step (the
    sender only sends a snapshot once its own rule let it write it, so the other slot is no longer needed)."""
    free = [s for s in slots if s.step is None or s.step != committed]
    return min(free, key=lambda s: -1 if s.step is None else s.step)
