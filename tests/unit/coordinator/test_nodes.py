"""Tests for deadpool/coordinator/nodes.py against a real TCPStore: spawn orders, exit reports, node loss."""

import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool.coordinator.nodes import RemoteNodes
from deadpool.coordinator.policy import FAILURE, classify_exit
from deadpool.coordinator.protocol import Keys

KEYS = Keys("tok")


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def beat(store, node: int, value: int) -> None:
    store.set(KEYS.node_beat(node), str(value))


def test_rank_r_runs_on_node_r_div_nproc_and_orders_reach_its_agent(store):
    nodes = RemoteNodes(store, KEYS, [0, 1, 2], nproc=2, node_timeout_s=5.0)
    for name, rank in [("w0", 0), ("w1", 1), ("w2", 2), ("w3", 3), ("s0", 4), ("s1", 5)]:
        nodes.spawn(name, "spare" if name[0] == "s" else "worker", rank)
    assert [nodes.node_of(n) for n in ("w0", "w1", "w2", "w3", "s0", "s1")] == [0, 0, 1, 1, 2, 2]
    assert store.get(KEYS.node_spawned(1)) == b"2"
    assert json.loads(store.get(KEYS.node_spawn(1, 2))) == ["w3", "worker", 3]
    assert nodes.alive() == {"w0", "w1", "w2", "w3", "s0", "s1"}


def test_reported_exits_come_back_once(store):
    nodes = RemoteNodes(store, KEYS, [0], nproc=2, node_timeout_s=5.0)
    nodes.spawn("w0", "worker", 0)
    nodes.spawn("w1", "worker", 1)
    beat(store, 0, 1)
    store.set(KEYS.node_exit(0, "w1"), json.dumps({"code": -9, "pid": 4321}))
    [exited] = nodes.poll()
    assert (exited.name, exited.returncode, exited.pid, exited.lost_with_node) == ("w1", -9, 4321, None)
    assert nodes.poll() == [] and nodes.alive() == {"w0"}


def test_a_silent_agent_loses_every_process_of_its_node_not_the_others(store):
    nodes = RemoteNodes(store, KEYS, [0, 1], nproc=1, node_timeout_s=0.3)
    nodes.spawn("w0", "worker", 0)
    nodes.spawn("w1", "worker", 1)
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
    nodes.spawn("w0", "worker", 0)
    nodes.fence("w0")
    assert store.check([KEYS.fence("w0")])
