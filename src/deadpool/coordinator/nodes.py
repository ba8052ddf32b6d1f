"""The coordinator's side of the node agents (launcher/node.py): processes started, watched and fenced
through the store, one agent per node. No torch here either.

A node is lost when its agent stops beating for `node_timeout_s`, or at once when the agent is a child
of this process (`deadpool run --nnodes`) and has exited. Every process of a lost node that has not
reported an exit is then reported as lost with it: a failure, replaced like a crash. A spare node may
join the running job (`deadpool agent --spare`); `joined` reports it, and it is watched from then on.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from deadpool.protocol.keys import Keys
from deadpool.protocol.kinds import Role
from deadpool.protocol.nodes import NodeHello, Pid, ProcessExit, SpawnOrder
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Fence


@dataclass
class Exited:
    """A process that ended, as the coordinator sees it (the same fields as launcher.agent.Child)."""

    name: str
    returncode: int
    pid: int | None
    lost_with_node: str | None = None  # it did not report an exit: its node was lost ("node 2: why")


@dataclass
class Ordered:
    """A process ordered on a node. Its agent starts it later, so its pid is not known here yet (the agent
    publishes it under pid/{name}, which `RemoteNodes.pid` reads)."""

    name: str
    node: int
    pid: int | None = None


@dataclass
class _Node:
    node: int
    procs: list[str] = field(default_factory=list)
    ordered: int = 0
    beat: int = 0
    beat_t: float = 0.0
    lost: str = ""  # why the node counts as lost, once it does


class RemoteNodes:
    """Processes on nodes whose agents joined the coordinator's store, `nproc` per node: rank r (a spare's
    placeholder rank included) runs on node r // nproc, so worker nodes come first, then spare nodes."""

    def __init__(self, plane: ControlPlane, keys: Keys, nodes: list[int], nproc: int, node_timeout_s: float,
                 agents: dict[int, subprocess.Popen] | None = None) -> None:
        self.plane, self.keys, self.nproc, self.node_timeout_s = plane, keys, nproc, node_timeout_s
        self.nodes = {n: _Node(n, beat_t=time.monotonic()) for n in nodes}
        self.agents = agents or {}  # node -> its agent, when this process started it
        self.first_joined = max(nodes, default=-1) + 1  # the number the first node to join a running job takes
        self.where: dict[str, int] = {}
        self.done: dict[str, Exited] = {}

    def spawn(self, name: str, role: Role, rank: int) -> Ordered:
        """Orders the agent of rank's node to start process `name` as `rank`."""
        node = rank // self.nproc
        entry = self.nodes[node]
        entry.procs.append(name)
        entry.ordered += 1
        self.where[name] = node
        self.plane.put(self.keys.node_spawn(node, entry.ordered), SpawnOrder(node, entry.ordered, name, role, rank))
        return Ordered(name, node)

    def joined(self) -> dict[int, str]:
        """Spare nodes whose agents joined the running job since the last call: node -> its host. An agent
        takes its number from the nodes/joined counter before it registers, so each number is checked
        until its agent registers (one that dies in between leaves a number unused)."""
        count = self.plane.counters([self.keys.nodes_joined()])[0]
        found = {}
        for node in range(self.first_joined, self.first_joined + count):
            hello = None if node in self.nodes else self.plane.poll(self.keys.node(node), NodeHello)
            if hello is not None:
                self.nodes[node] = _Node(node, beat_t=time.monotonic())
                found[node] = hello.host
        return found

    def pid(self, name: str) -> int | None:
        known = self.plane.poll(self.keys.node_pid(name), Pid)
        return None if known is None else known.pid

    def node_of(self, name: str) -> int | None:
        return self.where.get(name)

    def poll(self) -> list[Exited]:
        """Processes whose exit was reported since the last call, and those of nodes lost meanwhile."""
        now, exited = time.monotonic(), []
        for entry in self.nodes.values():
            waiting = [name for name in entry.procs if name not in self.done]
            reports = self.plane.poll_all([self.keys.node_exit(entry.node, name) for name in waiting], ProcessExit)
            for report in reports:
                if report is not None:
                    self.done[report.proc] = Exited(report.proc, report.code, report.pid)
                    exited.append(self.done[report.proc])
            if entry.lost:
                continue
            entry.lost = self._lost(entry, now)
            if not entry.lost:
                continue
            for name in entry.procs:
                if name not in self.done:
                    self.fence(name)  # a partitioned node's agent kills them as soon as it hears us again
                    lost = f"node {entry.node} ({entry.lost})"
                    self.done[name] = Exited(name, -9, self.pid(name), lost_with_node=lost)
                    exited.append(self.done[name])
        return exited

    def _lost(self, entry: _Node, now: float) -> str:
        """Why the node counts as lost ("" if it does not): its agent exited, or stopped beating."""
        agent = self.agents.get(entry.node)
        if agent is not None and agent.poll() is not None:
            return f"its agent exited ({agent.returncode})"
        beat = self.plane.counters([self.keys.node_beat(entry.node)])[0]
        if beat != entry.beat:
            entry.beat, entry.beat_t = beat, now
        silent = now - entry.beat_t
        return f"its agent was silent for {silent:.1f} s" if silent > self.node_timeout_s else ""

    def lost_reason(self, node: int) -> str:
        return self.nodes[node].lost

    def fence(self, name: str) -> None:
        """SIGKILLs a process through its agent (a lost node's processes are beyond reach: the new
        generation refuses them instead)."""
        self.plane.put(self.keys.fence(name), Fence(name))

    def alive(self) -> set[str]:
        return {name for name in self.where if name not in self.done}

    def relabel(self, name: str, label: str) -> None:
        """Output prefixes are the agents' own ([n1:w2]); nothing to change here."""

    def on_exit(self, wake: Callable[[], None]) -> None:
        """The agents report their processes' exits to the store, and the report wakes the coordinator itself;
        an agent this process started wakes it as it exits (its node is lost at once: `_lost`)."""
        def wake_at_exit(agent: subprocess.Popen) -> None:
            agent.wait()
            wake()

        for agent in self.agents.values():
            threading.Thread(target=wake_at_exit, args=(agent,), name="deadpool-agent-exit", daemon=True).start()

    def stop_all(self, grace_s: float) -> None:
        """After the shutdown key: waits for the agents to stop their processes and report, then fences the rest."""
        deadline = time.monotonic() + grace_s + 2.0
        while self.alive() and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.05)
        for name in self.alive():
            self.fence(name)
        for agent in self.agents.values():
            try:
                agent.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(5.0)
