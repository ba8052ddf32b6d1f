"""Tests for deadpool/runtime/heap.py, in fresh processes (the thresholds are process-wide): a step's worth of
temporaries freed and allocated again is faulted in once with the heap kept, at every step without (glibc
trims the free top above twice the largest chunk it has unmapped), and a user's MALLOC_* or GLIBC_TUNABLES
setting is kept."""

from __future__ import annotations

import os
import subprocess
import sys

CHURN = """
import resource, sys
from deadpool.runtime.heap import keep_heap
done = keep_heap() if sys.argv[1] == "keep" else "not asked"
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # a step: 32 MiB of 1 MiB temporaries, zeroed (every page touched), then all freed
    buffers = [bytearray(1 << 20) for _ in range(32)]
    del buffers
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, done, sep="|")
"""
PAGES = (32 << 20) // 4096


def churn(mode: str, **env: str) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=60,
                         env=environ, check=True).stdout.strip()
    faults, done = out.split("|")
    return int(faults), done


def test_a_kept_heap_faults_a_freed_buffer_in_once_not_at_every_allocation():
    kept, done = churn("keep")
    assert done.startswith("kept (mmap threshold 32 MiB, trim threshold 1024 MiB)")
    assert kept < 2 * PAGES  # the first allocation's pages, then the same memory again
    given_back, _ = churn("default")
    assert given_back > 10 * PAGES  # trimmed and faulted in anew: about 20 x PAGES


def test_a_users_own_malloc_setting_is_left_as_it_is():
    _, done = churn("keep", MALLOC_TRIM_THRESHOLD_="0")
    assert done == "left as the environment sets it (MALLOC_TRIM_THRESHOLD_)"
    _, done = churn("keep", MALLOC_ARENA_MAX="2", GLIBC_TUNABLES="glibc.malloc.tcache_count=0")
    assert done == "left as the environment sets it (GLIBC_TUNABLES, MALLOC_ARENA_MAX)"
