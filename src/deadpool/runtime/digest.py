"""The hash that checks a slot's bytes, computed in the same pass that copies them into the slot.

xxHash3 (64-bit) runs at memory speed (tens of GB/s per core), so hashing a chunk right after copying it,
while it is still in cache, costs little more than the copy. It is taken over fixed blocks (`Blocked`:
the xxh3 of each BLOCK of the stream, then the xxh3 of those), so that where cores are spare (a GPU
host's) the blocks are hashed on several threads at once, and the value does not depend on how many.
`xxhash` is a dependency; zlib's CRC-32 (1.5-2.5 GB/s here), the hash before it, is kept only to verify
checkpoints written with it.

Values are signed 64-bit integers, so they travel in the int64 fields of a replica's header and ack.
"""

from __future__ import annotations

import os
import sys
import zlib
from array import array
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Callable, Iterator, Protocol, Sequence

import torch
import xxhash

CHUNK = 2 * 2**20  # copied, then hashed while still in cache (L2 is 1-2 MB per core, L3 a few MB more)
DEVICE_CHUNK = 32 * 2**20  # from a GPU: one copy's completion is waited for and hashed per piece (~0.6 ms of PCIe)
BLOCK = 2**20  # the blocks `Blocked` hashes one by one: the unit of parallel work (~30-150 us of xxh3 each)
MAX_HASH_THREADS = 8  # xxh3 on 8 threads of an H200 host's VM: 26-46 GB/s, past the device's copy into the slot


class Hasher(Protocol):
    def update(self, data: memoryview | bytes) -> None: ...
    def intdigest(self) -> int: ...
    def mark(self) -> Callable[[], int]: ...


class Blocked:
    """xxh3_64 over the xxh3_64 of each BLOCK bytes of the stream (the last block may be short), as
    little-endian 64-bit words. Whole blocks go to `pool` when there is one, so `update` returns at once
    and the hashing runs on other cores; `intdigest` waits for them. The value is the same with or without
    a pool, however the stream was cut into updates. Bytes handed to `update` must not change until the
    digest is read."""

    def __init__(self, pool: Executor | None = None, threads: int = 1) -> None:
        self._pool, self._threads = pool, threads
        self._blocks: list[list[int] | Future[list[int]]] = []  # digests of whole blocks, in stream order
        self._part = xxhash.xxh3_64()  # the block being filled
        self._part_n = 0

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if self._part_n:  # first complete the block the last update left short
            take = min(BLOCK - self._part_n, len(view))
            self._part.update(view[:take])
            self._part_n += take
            view = view[take:]
            if self._part_n == BLOCK:
                self._blocks.append([self._part.intdigest()])
                self._part, self._part_n = xxhash.xxh3_64(), 0
        whole = len(view) // BLOCK * BLOCK
        if whole:
            self._hash_blocks(view[:whole])
        if whole < len(view):
            self._part.update(view[whole:])
            self._part_n = len(view) - whole

    def _hash_blocks(self, view: memoryview) -> None:
        """Whole blocks: inline without a pool, else cut in up to `threads` runs of blocks, one task each."""
        if self._pool is None:
            self._blocks.append(_block_digests(view))
            return
        blocks = len(view) // BLOCK
        per_task = -(-blocks // min(self._threads, blocks)) * BLOCK
        for start in range(0, len(view), per_task):
            self._blocks.append(self._pool.submit(_block_digests, view[start: start + per_task]))

    def mark(self) -> Callable[[], int]:
        """The digest of the stream so far, to be read later (after more updates) without waiting now."""
        blocks, part = list(self._blocks), self._part.copy() if self._part_n else None
        return lambda: _outer(blocks, part)

    def intdigest(self) -> int:
        return self.mark()()


def _block_digests(view: memoryview) -> list[int]:
    return [xxhash.xxh3_64_intdigest(view[i: i + BLOCK]) for i in range(0, len(view), BLOCK)]


def _outer(blocks: list[list[int] | Future[list[int]]], part: xxhash.xxh3_64 | None) -> int:
    words = array("Q")
    for run in blocks:
        words.extend(run if isinstance(run, list) else run.result())
    if part is not None:
        words.append(part.intdigest())
    if sys.byteorder == "big":
        words.byteswap()
    return xxhash.xxh3_64_intdigest(words.tobytes())


class Crc32:
    """zlib's CRC-32 behind xxhash's streaming interface, the hash before xxh3: kept to verify checkpoints
    written with it."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: memoryview | bytes) -> None:
        self.crc = zlib.crc32(data, self.crc)  # releases the GIL on large buffers, as xxhash does

    def intdigest(self) -> int:
        return self.crc

    def mark(self) -> Callable[[], int]:
        crc = self.crc
        return lambda: crc


class Xxh3:
    """Plain streaming xxh3_64, the hash before blocks: kept to verify checkpoints written with it."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        self._hasher.update(data)

    def intdigest(self) -> int:
        return self._hasher.intdigest()

    def mark(self) -> Callable[[], int]:
        return self._hasher.copy().intdigest


@lru_cache(maxsize=1)
def hash_pool() -> tuple[Executor, int] | None:
    """Threads for hashing beside a process's own work, with how many: a quarter of the cores this process
    may use, at most MAX_HASH_THREADS, and none below two (on a small machine the training's threads
    need every core, and a handoff would only add work)."""
    threads = min(MAX_HASH_THREADS, len(os.sched_getaffinity(0)) // 4)
    if threads < 2:
        return None
    return ThreadPoolExecutor(threads, thread_name_prefix="deadpool-hash"), threads


def new_hasher(parallel: bool = False) -> Hasher:
    """Blocked xxh3, the hash of every slot and replica. `parallel`: its blocks are hashed on the process's
    hash threads (hash_pool), where it has any."""
    pool = hash_pool() if parallel else None
    return Blocked(*pool) if pool is not None else Blocked()


def hash_name() -> str:
    return f"xxh3_64/{BLOCK >> 20}MiB"


def hasher_named(name: str) -> Hasher:
    """A hasher for bytes hashed elsewhere with hash `name` (a checkpoint on disk says which); ValueError if
    it is none DeadPool ever wrote."""
    known: dict[str, Callable[[], Hasher]] = {hash_name(): Blocked, "xxh3_64": Xxh3, "crc32": Crc32}
    if name not in known:
        raise ValueError(f"hash {name!r} is unknown to this DeadPool (it computes {', '.join(sorted(known))})")
    return known[name]()


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
        self._lead = self._hasher.mark() if lead_nbytes == 0 else None

    def update(self, data: memoryview) -> None:
        cut = self._lead_nbytes - self.fed
        if 0 < cut < len(data):  # the lead region ends inside this piece: read its hash off at the cut
            self.update(data[:cut])
            data = data[cut:]
        self._hasher.update(data)
        self.fed += len(data)
        if self._lead is None and self.fed == self._lead_nbytes:
            self._lead = self._hasher.mark()  # read at the end: its blocks may still be being hashed

    @property
    def lead(self) -> int:
        assert self._lead is not None, "the lead region was not fed"
        return int64(self._lead())

    def finish(self, meta: bytes) -> tuple[int, int]:
        """(lead fingerprint, whole checksum): the data must all have been fed."""
        self._hasher.update(meta)
        return self.lead, int64(self._hasher.intdigest())


Source = tuple[torch.Tensor, int, int]  # (flat uint8 bytes, offset in the slot, end of its zeroed padding)


def _runs(ordered: Sequence[Source]) -> Iterator[tuple[int, int, list[torch.Tensor], bool]]:
    """The CPU copy's units, (start, end, parts, middle): sources whose places in the slot follow each other,
    with their padding as zeros between them, up to about CHUNK bytes a run (a bigger source is cut in CHUNK
    parts), so that a model's many small tensors cost a few calls, not a few each. Each run's parts fill
    exactly [start, end) (torch.cat would otherwise resize its `out`). `middle`: the run that begins with the
    middle source (copy_hashed's `midway` runs before it)."""
    start = end = 0
    parts: list[torch.Tensor] = []
    middle = False
    for i, (source, offset, padded) in enumerate(ordered):
        if parts and (offset != end or i == len(ordered) // 2):
            yield start, end, parts, middle
            parts, middle = [], False
        if not parts:
            start = end = offset
        middle = middle or i == len(ordered) // 2
        n = source.numel()
        for a in range(0, n, CHUNK):
            if parts and end - start >= CHUNK:
                yield start, end, parts, middle
                parts, middle, start = [], False, end
            part = source[a: a + CHUNK] if n > CHUNK else source
            parts.append(part)
            end += part.numel()
        if padded > end:
            parts.append(_zeros(padded - end))
            end = padded
    if parts:
        yield start, end, parts, middle


@lru_cache(maxsize=64)
def _zeros(n: int) -> torch.Tensor:
    """n zero bytes, to copy as a tensor's padding (slots align tensors to 64 bytes, so n < 64)."""
    return torch.zeros(n, dtype=torch.uint8)


def copy_hashed(sources: Sequence[Source], buffer: torch.Tensor, ranges: Sequence[tuple[int, int]],
                lead_nbytes: int, *, device: bool = False, midway: Callable[[], None] = lambda: None,
                settle: Callable[[], None] = lambda: None) -> Digest:
    """Copies each (flat uint8 source, offset, padded end) into `buffer` in order of offset, in pieces, and
    hashes the buffer right behind the copy, so each byte is read from memory once. The hash is fed exactly
    `ranges` (the byte ranges the snapshot holds, in order: slots.held_ranges), which the sources fill; the
    first `lead_nbytes` of them make the fingerprint. Padding is zeroed: every data-parallel rank must hash
    equal bytes in the replicated state, and the disk tier stores tensors, not padding, so a slot read back
    from disk hashes the same.

    On the CPU the sources go in runs of about CHUNK bytes (`_runs`), each hashed while still in cache. From
    a `device` (sources on the GPU, the current stream a side stream) every piece of DEVICE_CHUNK bytes is
    queued at once and hashed as soon as its copy has landed, so the hash runs beside the copy engine
    instead of after it. `midway` runs before
    the middle source (a fault point); `settle` once everything is copied (a device copy is synchronized
    there, and training may go on), before the rest is hashed."""
    digest = Digest(lead_nbytes, new_hasher(parallel=device))
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
    if device:
        for i, (source, offset, padded) in enumerate(ordered):
            if i == len(ordered) // 2:
                midway()
            n = source.numel()
            for start in range(0, n, DEVICE_CHUNK):
                end = offset + min(n, start + DEVICE_CHUNK)
                buffer[offset + start: end].copy_(source[start: start + DEVICE_CHUNK], non_blocking=True)
                landed.append((end, torch.cuda.Event()))
                landed[-1][1].record()
            if padded > offset + n:
                buffer[offset + n: padded].zero_()
    else:
        for start, end, parts, middle in _runs(ordered):
            if middle:
                midway()
            if len(parts) == 1:
                buffer[start:end].copy_(parts[0])
            else:  # several small tensors and their padding: one call, not a few per tensor
                torch.cat(parts, out=buffer[start:end])
            if end - hashed >= CHUNK:
                hash_to(end)
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
