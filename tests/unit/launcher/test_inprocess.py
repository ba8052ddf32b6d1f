"""Tests for deadpool/launcher/inprocess.py: the coordinator's view of processes that no launcher started
(exits they publish, pids that vanish, fences by pid) with a real store table and real child processes."""

import os
import signal
import subprocess
import sys

from deadpool.launcher.inprocess import VANISHED, Peers, running
from deadpool.protocol.keys import Keys
from deadpool.protocol.nodes import Pid, ProcessExit
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.store import Table

KEYS = Keys("token")


def peers(nproc: int = 0) -> tuple[Peers, ControlPlane]:
    table = ControlPlane(Table())
    found = Peers(table, KEYS, own="w0", nproc=nproc)
    for rank in range(3):
        found.spawn(f"w{rank}", "worker", rank)
    return found, table


def test_spawn_starts_nothing_and_knows_only_its_own_pid():
    found, _ = peers()
    assert found.spawn("w0", "worker", 0).pid == os.getpid()
    assert found.spawn("w1", "worker", 1).pid is None


def test_an_exit_a_process_published_is_reported_once():
    found, table = peers()
    table.put(KEYS.exited("w1"), ProcessExit("w1", 0, 42))
    [exited] = found.poll()
    assert (exited.name, exited.returncode, exited.pid, exited.lost_with_node) == ("w1", 0, 42, None)
    assert found.poll() == []
    assert found.alive() == {"w2"}  # never w0: the host ends by itself


def test_a_local_process_that_vanished_without_a_word_is_a_failure():
    found, table = peers()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid is gone
    table.put(KEYS.node_pid("w2"), Pid("w2", child.pid))
    [exited] = found.poll()
    assert (exited.name, exited.returncode, exited.lost_with_node) == ("w2", -signal.SIGKILL, VANISHED)


def test_a_rank_stopped_by_sigterm_comes_after_one_that_died_in_the_same_poll():
    """torchrun SIGTERMs the other ranks once one dies: seen together, the dead one is named first."""
    found, table = peers()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    table.put(KEYS.exited("w0"), ProcessExit("w0", -signal.SIGTERM, 41))
    table.put(KEYS.node_pid("w1"), Pid("w1", child.pid))
    table.put(KEYS.exited("w2"), ProcessExit("w2", 1, 43))
    assert [(x.name, x.returncode) for x in found.poll()] == [("w1", -signal.SIGKILL), ("w2", 1),
                                                              ("w0", -signal.SIGTERM)]


def test_a_process_on_another_machine_is_judged_by_what_it_publishes_only():
    found, table = peers(nproc=2)  # w2 runs on node 1
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    table.put(KEYS.node_pid("w2"), Pid("w2", child.pid))
    assert found.poll() == []


def test_fence_kills_a_local_process_by_its_pid():
    found, table = peers()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        table.put(KEYS.node_pid("w1"), Pid("w1", child.pid))
        assert running(child.pid)
        found.fence("w1")
        assert child.wait(10) == -signal.SIGKILL
        assert table.has(KEYS.fence("w1"))
    finally:
        child.kill()
        child.wait()


def test_stop_all_fences_what_did_not_exit_in_time():
    found, table = peers()
    table.put(KEYS.exited("w1"), ProcessExit("w1", 0, 1))
    found.stop_all(grace_s=0.05)
    assert found.fenced == {"w2"} and found.alive() == {"w2"}  # w2 never published a pid: fenced by key only
