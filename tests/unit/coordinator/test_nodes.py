"""Tests for deadpool/coordinator/nodes.py over a real store table: spawn orders, exit reports, node loss."""

import subprocess
import sys
import threading
import time

import pytest

from deadpool.coordinator.nodes import RemoteNodes
from deadpool.coordinator.policy import FAILURE, classify_exit
from deadpool.protocol.keys import Keys
from deadpool.protocol.kinds import Role
from deadpool.protocol.nodes import ProcessExit, SpawnOrder
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.store import Table

KEYS = Keys("tok")


@pytest.fixture
def store():
    return ControlPlane(Table())


def beat(store, node: int, value: int) -> None:
    store.count(KEYS.node_beat(node), value)


def test_rank_r_runs_on_node_r_div_nproc_and_orders_reach_its_agent(store):
    nodes = RemoteNodes(store, KEYS, [0, 1, 2], nproc=2, node_timeout_s=5.0)
    for name, rank in [("w0", 0), ("w1", 1), ("w2", 2), ("w3", 3), ("s0", 4), ("s1", 5)]:
        nodes.spawn(name, Role.of(name), rank)
    assert [nodes.node_of(n) for n in ("w0", "w1", "w2", "w3", "s0", "s1")] == [0, 0, 1, 1, 2, 2]
    assert store.present([KEYS.node_spawn(1, 2), KEYS.node_spawn(1, 3)]) == [True, False]  # two orders for node 1
    assert store.get(KEYS.node_spawn(1, 2), SpawnOrder) == SpawnOrder(1, 2, "w3", Role.WORKER, 3)
    assert nodes.alive() == {"w0", "w1", "w2", "w3", "s0", "s1"}


def test_reported_exits_come_back_once(store):
    nodes = RemoteNodes(store, KEYS, [0], nproc=2, node_timeout_s=5.0)
    nodes.spawn("w0", Role.WORKER, 0)
    nodes.spawn("w1", Role.WORKER, 1)
    beat(store, 0, 1)
    store.put(KEYS.node_exit(0, "w1"), ProcessExit("w1", -9, 4321))
    [exited] = nodes.poll()
    assert (exited.name, exited.returncode, exited.pid, exited.lost_with_node) == ("w1", -9, 4321, None)
    assert nodes.poll() == [] and nodes.alive() == {"w0"}


def test_a_silent_agent_loses_every_process_of_its_node_not_the_others(store):
    nodes = RemoteNodes(store, KEYS, [0, 1], nproc=1, node_timeout_s=0.3)
    nodes.spawn("w0", Role.WORKER, 0)
    nodes.spawn("w1", Role.WORKER, 1)
    beat(store, 0, 1)
    beat(store, 1, 1)
    assert nodes.poll() == []
    deadline = time.monotonic() + 5
    lost = []
    while not lost and time.monotonic() < deadline:
        beat(store, 0, int(time.monotonic() * 1000))  # node 0 keeps beating, node 1 went silent
        lost = nodes.poll()
        time.sleep(0.05)
    [exited] = lost
    assert exited.name == "w1" and exited.lost_with_node.startswith("node 1 (its agent was silent for ")
    verdict = classify_exit(exited.returncode, fenced=False, started=True, script_error=None,
                            lost_with_node=exited.lost_with_node)
    assert verdict.value == FAILURE and verdict.reason.startswith("lost with node 1 (its agent was silent")
    assert nodes.lost_reason(0) == "" and nodes.alive() == {"w0"}


def test_fencing_goes_through_the_store(store):
    nodes = RemoteNodes(store, KEYS, [0], nproc=1, node_timeout_s=5.0)
    nodes.spawn("w0", Role.WORKER, 0)
    nodes.fence("w0")
    assert store.has(KEYS.fence("w0"))


def test_an_agent_started_here_wakes_the_coordinator_as_it_exits_and_its_node_is_lost(store):
    """The coordinator sleeps up to QUIET_TICK_S while the job only trains: a node whose agent this process
    started (a real child, SIGKILLed) must not wait for that tick to be found lost."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    nodes = RemoteNodes(store, KEYS, [0], nproc=1, node_timeout_s=5.0, agents={0: agent})
    nodes.spawn("w0", Role.WORKER, 0)
    woken = threading.Event()
    nodes.on_exit(woken.set)
    assert nodes.poll() == [] and not woken.wait(0.2)
    agent.kill()
    assert woken.wait(5.0)
    [exited] = nodes.poll()
    assert (exited.name, exited.lost_with_node) == ("w0", "node 0 (its agent exited (-9))")
