"""The node agents' records: an agent joins, is ordered to start processes, and reports their pids and exits.

    agent        --NodeHello (node/{n}), beat counter (node/{n}/beat)-->    coordinator (coordinator/nodes.py)
    coordinator  --SpawnOrder (node/{n}/spawn/{k}, k = 1, 2, ...)-->        agent of node n
    agent        --Pid (pid/{proc}), ProcessExit (node/{n}/exit/{proc})-->  coordinator
    a process that no launcher started --Pid, ProcessExit (exited/{proc})--> its host (launcher/inprocess.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool.protocol.kinds import Role
from deadpool.protocol.record import Record


@dataclass(frozen=True)
class NodeHello(Record):
    """Node `node`'s agent joined the job. Key node/{n}. Writer: that agent (launcher/node.py), once.
    Readers: the launcher (waits for every node) and the coordinator (spare nodes joining later)."""

    node: int
    host: str
    pid: int


@dataclass(frozen=True)
class SpawnOrder(Record):
    """Start process `name` as `role`, rank `rank` (a spare's: a placeholder). Orders of a node are numbered
    from 1 without gaps, so the agent reads the next one until it is absent. Key node/{n}/spawn/{k}.
    Writer: the coordinator (coordinator/nodes.py). Reader: the agent of node `node`."""

    node: int
    index: int
    name: str
    role: Role
    rank: int


@dataclass(frozen=True)
class Pid(Record):
    """The pid of process `proc`, known only where it runs. Key pid/{proc}. Writer: its node agent, or the
    process itself when no launcher started it (runtime/standalone.py). Readers: the coordinator's side of the
    nodes (coordinator/nodes.py, launcher/inprocess.py)."""

    proc: str
    pid: int


@dataclass(frozen=True)
class ProcessExit(Record):
    """Process `proc` ended with `code` (negative: killed by that signal). Key node/{n}/exit/{proc}, written by
    the agent of node n; or exited/{proc}, written by a process that no launcher started as it exits.
    Reader: the coordinator's side of the nodes (coordinator/nodes.py, launcher/inprocess.py)."""

    proc: str
    code: int
    pid: int | None
