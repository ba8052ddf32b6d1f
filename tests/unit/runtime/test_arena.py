"""Tests for deadpool/runtime/arena.py: a slot arena outlives the process that made it while a holder maps it,
only the announced arena is mapped, and machines are told apart down to the network namespace."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from deadpool.errors import ProtocolError
from deadpool.runtime.arena import Arena, machine, map_arena, shared_buffer

OWNER = """
import sys, time, torch
from deadpool.runtime.arena import shared_buffer
buffer, arena = shared_buffer(int(sys.argv[1]))
buffer.copy_(torch.arange(buffer.numel()) % 251)
print(arena.pid, arena.fd, arena.inode, arena.nbytes, flush=True)
time.sleep(60)
"""


def test_a_mapped_arena_keeps_its_bytes_after_its_owner_is_killed():
    """A rank's process dies (SIGKILL) with its slots in an arena its holder maps: the holder still reads
    every byte the rank wrote."""
    nbytes = 3 * 2**20 + 5
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        arena = Arena(*map(int, owner.stdout.readline().split()))
        mapped = map_arena(arena)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
    assert owner.returncode == -signal.SIGKILL and not os.path.exists(f"/proc/{arena.pid}/fd/{arena.fd}")
    expected = (torch.arange(nbytes) % 251).to(torch.uint8)
    assert arena.nbytes == nbytes and torch.equal(mapped, expected)


def test_only_the_announced_arena_is_mapped():
    buffer, arena = shared_buffer(4096)
    buffer.fill_(3)
    assert bool((map_arena(arena) == 3).all())
    with pytest.raises(ProtocolError, match=r"is not the announced snapshot arena \(inode"):
        map_arena(dataclasses.replace(arena, inode=arena.inode + 1))
    with pytest.raises(ProtocolError, match="is not the announced snapshot arena"):
        map_arena(dataclasses.replace(arena, nbytes=8192))
    with pytest.raises(ProtocolError, match="could not open the snapshot arena at /proc/"):
        map_arena(dataclasses.replace(arena, fd=2**20))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_process_in_another_network_namespace_is_another_machine():
    """Nodes in network namespaces of their own (`deadpool run --netns`) receive streams, as machines do."""
    here = machine().decode()
    there = subprocess.run(["unshare", "--net", sys.executable, "-c",
                            "from deadpool.runtime.arena import machine; print(machine().decode())"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    boot, net, user = here.split("/")
    assert there.split("/")[0::2] == [boot, user] and there.split("/")[1] != net
