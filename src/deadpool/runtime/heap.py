"""glibc's heap, kept between steps instead of handed back to the kernel and faulted in again.

A training step allocates and frees the same large temporaries every time (matmul outputs, the optimizer's
`sqrt` and `div` of each parameter-sized moment). glibc serves an allocation above its mmap threshold with a
fresh mapping, and trims the heap's free top above its trim threshold; both give the pages back, so the next
step faults them in again, one zeroed 4 KiB page at a time. Measured on the 50M example, 2 ranks, snapshots
off: 71,000 minor faults a second (47,000 a step) against 2,000 for torchrun's DDP run of the same model,
and 10-15 % of the step time (docs/benchmarks.md). Why glibc's dynamic thresholds settle in the DDP run and
not in ours is not pinned down (our gradients stay in their buckets, so the step's free memory differs).

`keep_heap` raises both thresholds once per process: mappings only from 32 MiB (glibc's own ceiling for its
dynamic threshold), trimming only once 1 GiB lies free at the top. A training process reaches its peak every
step anyway; what it keeps between steps is at most that. A user who set any MALLOC_* tunable (or
GLIBC_TUNABLES) in the environment keeps glibc as told (that is the way to opt out), and a libc without
`mallopt` is left alone.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_heap() -> str:
    """Raises glibc's mmap and trim thresholds for this process; returns what was done, for the events."""
    # MALLOC_ARENA_MAX, MALLOC_TOP_PAD_, ... and GLIBC_TUNABLES (glibc.malloc.*): any says the user tunes glibc
    told = sorted(name for name in os.environ if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES")
    if told:
        return f"left as the environment sets it ({', '.join(told)})"
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return "left alone (no mallopt in this libc)"
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "left alone (mallopt refused the thresholds)"
    return f"kept (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB)"
