"""Slot arenas that a holder on the same machine maps instead of receiving a copy.

A rank's own slots live in anonymous shared memory (memfd). A holder on the same machine (same kernel,
network namespace and user: `machine()`) is told where an arena is, in the authenticated header of the
replica stream, opens it through /proc/PID/fd and maps it: the snapshot's bytes never cross loopback,
are not copied again, and are not hashed again at arrival (nothing was transferred). The protection is
the one a copy on the same machine gave: the memory lives while any process maps it, so a holder still
has a rank's snapshots after that rank's process died or was fenced; neither survives the machine, and
holders on other machines (or nodes in network namespaces of their own) receive a stream, as before.

A mapped slot is never written by its holder: a later snapshot that arrives as a stream goes into a
fresh buffer of the holder's own (Slot.reserve). Slots pinned for a GPU's copies are shared too, the
arena registered with CUDA in place; where CUDA refuses that, they stay private and their holders are
streamed the bytes (slots.host_buffer).
"""

from __future__ import annotations

import functools
import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from deadpool.errors import ProtocolError


@dataclass(frozen=True)
class Arena:
    """Where a process's shared slot arena can be opened: /proc/{pid}/fd/{fd}, checked by its inode."""

    pid: int
    fd: int
    inode: int
    nbytes: int


@functools.lru_cache(maxsize=1)
def machine() -> bytes:
    """What two processes must share for one to map the other's arenas: the kernel's boot, the network
    namespace (nodes in namespaces of their own stay apart, as machines would) and the user."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}/{os.getuid()}".encode()


def shared_buffer(nbytes: int) -> tuple[torch.Tensor, Arena]:
    """`nbytes` of shared memory (nbytes > 0) as a uint8 tensor, and where holders open it; the memory
    goes when the tensor and every holder's mapping are gone."""
    fd = os.memfd_create("deadpool-slot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        memory = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    buffer = torch.frombuffer(memory, dtype=torch.uint8)  # keeps `memory` alive as long as it lives
    weakref.finalize(buffer, os.close, fd)  # the descriptor holders open it by, closed with it
    return buffer, Arena(os.getpid(), fd, os.fstat(fd).st_ino, nbytes)


def map_arena(arena: Arena) -> torch.Tensor:
    """Maps another process's arena (ProtocolError if what is at that descriptor is not that arena)."""
    path = f"/proc/{arena.pid}/fd/{arena.fd}"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as error:
        raise ProtocolError(f"could not open the snapshot arena at {path}: {error}") from None
    try:
        found = os.fstat(fd)
        if (found.st_ino, found.st_size) != (arena.inode, arena.nbytes):
            raise ProtocolError(f"{path} is not the announced snapshot arena (inode {found.st_ino}, "
                                f"{found.st_size} bytes; expected {arena.inode}, {arena.nbytes})")
        memory = mmap.mmap(fd, arena.nbytes)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return torch.frombuffer(memory, dtype=torch.uint8)
