"""The hash that checks a slot's bytes, computed in the same pass that copies them into the slot.

xxHash3 (64-bit) runs at memory speed (tens of GB/s per core), so hashing a chunk right after copying it,
while it is still in cache, costs little more than the copy. zlib's CRC-32 (1.5-2.5 GB/s here) is the
fallback where the `xxhash` package is missing. Both sides of a replica stream must use the same hash:
one installation per job (a holder with the other hash rejects every replica, loudly).

Values are signed 64-bit integers, so they travel in the int64 fields of a replica's header and ack.
"""

from __future__ import annotations

import zlib
from typing import Callable, Protocol, Sequence

import torch

try:
    import xxhash
except ImportError:
    xxhash = None  # type: ignore[assignment]

CHUNK = 2 * 2**20  # copied, then hashed while still in cache (L2 is 1-2 MB per core, L3 a few MB more)
DEVICE_CHUNK = 32 * 2**20  # from a GPU: one copy's completion is waited for and hashed per piece (~0.6 ms of PCIe)


class Hasher(Protocol):
    def update(self, data: memoryview | bytes) -> None: ...
    def intdigest(self) -> int: ...


class Crc32:
    """zlib's CRC-32 behind xxhash's streaming interface: the fallback."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: memoryview | bytes) -> None:
        self.crc = zlib.crc32(data, self.crc)  # releases the GIL on large buffers, as xxhash does

    def intdigest(self) -> int:
        return self.crc


def new_hasher() -> Hasher:
    """xxh3_64 when the package is there, CRC-32 otherwise (the one place the choice is made)."""
    return xxhash.xxh3_64() if xxhash is not None else Crc32()


def hash_name() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


def int64(value: int) -> int:
    """An unsigned 64-bit hash as the signed int64 with the same bits (what an int64 tensor can carry)."""
    return value - (1 << 64) if value >= 1 << 63 else value


class Digest:
    """One streaming pass over the bytes a slot holds (slots.held_ranges), fed in order. The hash of the first
    `lead_nbytes` (the data-parallel fingerprint: the whole replicated state, or this rank's piece of it) is
    read off on the way; the whole checksum continues over the rest and then the metadata, which is what a
    holder computes over what it receives."""

    def __init__(self, lead_nbytes: int = 0, hasher: Hasher | None = None) -> None:
        self._hasher = hasher or new_hasher()
        self._lead_nbytes = lead_nbytes
        self.fed = 0
        self.lead: int | None = int64(self._hasher.intdigest()) if lead_nbytes == 0 else None

    def update(self, data: memoryview) -> None:
        cut = self._lead_nbytes - self.fed
        if 0 < cut < len(data):  # the lead region ends inside this piece: read its hash off at the cut
            self.update(data[:cut])
            data = data[cut:]
        self._hasher.update(data)
        self.fed += len(data)
        if self.lead is None and self.fed == self._lead_nbytes:
            self.lead = int64(self._hasher.intdigest())  # the state goes on: a digest does not finalize it

    def finish(self, meta: bytes) -> tuple[int, int]:
        """(lead fingerprint, whole checksum): the data must all have been fed."""
        assert self.lead is not None, "the lead region was not fed"
        self._hasher.update(meta)
        return self.lead, int64(self._hasher.intdigest())


Source = tuple[torch.Tensor, int, int]  # (flat uint8 bytes, offset in the slot, end of its zeroed padding)


def copy_hashed(sources: Sequence[Source], buffer: torch.Tensor, ranges: Sequence[tuple[int, int]],
                lead_nbytes: int, *, device: bool = False, midway: Callable[[], None] = lambda: None,
                settle: Callable[[], None] = lambda: None) -> Digest:
    """Copies each (flat uint8 source, offset, padded end) into `buffer` in order of offset, in pieces, and
    hashes the buffer right behind the copy, so each byte is read from memory once. The hash is fed exactly
    `ranges` (the byte ranges the snapshot holds, in order: slots.held_ranges), which the sources fill; the
    first `lead_nbytes` of them make the fingerprint. Padding is zeroed: every data-parallel rank must hash
    equal bytes in the replicated state, and the disk tier stores tensors, not padding, so a slot read back
    from disk hashes the same.

    On the CPU a piece is CHUNK bytes, hashed while still in cache. From a `device` (sources on the GPU, the
    current stream a side stream) every piece of DEVICE_CHUNK bytes is queued at once and hashed as soon as
    its copy has landed, so the hash runs beside the copy engine instead of after it. `midway` runs before
    the middle source (a fault point); `settle` once everything is copied (a device copy is synchronized
    there, and training may go on), before the rest is hashed."""
    digest = Digest(lead_nbytes)
    raw = buffer.numpy().data
    hashed, settled = 0, False
    landed: list[tuple[int, torch.cuda.Event]] = []  # device: (end of a piece, its copy's completion)

    def hash_to(end: int) -> None:  # feeds the held bytes in [hashed, end)
        nonlocal hashed
        for a, b in ranges:
            if min(b, end) > max(a, hashed):
                digest.update(raw[max(a, hashed): min(b, end)])
        hashed = end

    ordered = sorted(sources, key=lambda source: source[1])
    for i, (source, offset, padded) in enumerate(ordered):
        if i == len(ordered) // 2:
            midway()
        n = source.numel()
        piece = DEVICE_CHUNK if device else CHUNK
        for start in range(0, n, piece):
            end = offset + min(n, start + piece)
            buffer[offset + start: end].copy_(source[start: start + piece], non_blocking=device)
            if device:
                landed.append((end, torch.cuda.Event()))
                landed[-1][1].record()
            elif end - hashed >= CHUNK:
                hash_to(end)
        if padded > offset + n:
            buffer[offset + n: padded].zero_()
    for end, event in landed:
        event.synchronize()
        if not settled and landed[-1][1].query():  # all of it is in: let training go on, then hash the rest
            settle()
            settled = True
        hash_to(end)
    if not settled:
        settle()
    hash_to(buffer.numel())
    return digest
