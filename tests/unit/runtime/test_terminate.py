"""Tests for deadpool/runtime/terminate.py: whether a process's launcher is on its way out."""

from __future__ import annotations

import os
import subprocess
import time

from deadpool.runtime.terminate import exiting


def test_a_parent_that_is_exiting_or_gone_counts_as_gone_and_a_live_one_does_not():
    """A rank that loses the store while its launcher dies sees its old parent still there, exiting (here: a
    child that has exited and is not reaped yet, a zombie, PF_EXITING set); a reaped one has no /proc entry."""
    assert not exiting(os.getpid()) and not exiting(os.getppid())
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    assert exiting(child.pid)
    child.wait(10)
    assert exiting(child.pid)
