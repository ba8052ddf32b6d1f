"""One agent per node: starts, watches and fences that node's processes, and reports to the coordinator.

The coordinator and its agents talk only through the coordinator's store (no other connection), so an
agent can run on any host that reaches it (`deadpool agent --coordinator HOST:PORT`):

    agent                                         coordinator (coordinator/nodes.py)
    count(node/{n}/claim) == 1, or refused
    NodeHello at node/{n}                   -->   waits until every node joined; nodes 0..M-1 work, the rest
                                                  are spares (rank r runs on node r // nproc-per-node)
    (--spare: n = job's nodes + count(nodes/joined) - 1, then node/{n} as above: a spare node joins the
     running job; the coordinator starts its spares and, once they started, adds them to the pool)
    count(node/{n}/beat) every 0.1 s        -->   a beat that stops for --node-timeout: the node is lost
                                            <--   SpawnOrder at node/{n}/spawn/{k}, k = 1, 2, ...
    starts each process (logs/{name}.log),
    Pid at pid/{name}
    ProcessExit at node/{n}/exit/{name}     -->   the process's exit, classified as before
                                            <--   Fence at fence/{name}: SIGKILL it
                                            <--   Published gen, Plan at plan/{g}: a spare of this node that
                                                  took a rank has its output echoed from then on (held in its
                                                  log till then)
                                            <--   Shutdown: stop the processes (grace), then exit
(the records: protocol/nodes.py)

The processes an agent starts die with it (PR_SET_PDEATHSIG), as they would with their machine: killing
the agent kills the node.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from deadpool.config import JobConfig
from deadpool.coordinator.policy import place_devices
from deadpool.errors import AuthenticationError, ConfigError, ControlPlaneError
from deadpool.launcher.address import interface_of
from deadpool.launcher.agent import Agent
from deadpool.launcher.launch import count_gpus
from deadpool.protocol.keys import CONFIG_KEY, Keys
from deadpool.protocol.nodes import NodeHello, Pid, ProcessExit, SpawnOrder
from deadpool.protocol.plan import Plan
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Published
from deadpool.protocol.secret import find_secret, write_secret
from deadpool.protocol.store import StoreClient

BEAT_EVERY_S = 0.1
STOP_GRACE_S = 10.0


def connect_to_coordinator(address: str, secret: bytes, timeout_s: float) -> StoreClient:
    """An authenticated client of the coordinator's store at HOST:PORT, retried until `timeout_s` (it may
    start after us)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--coordinator must be HOST:PORT, got {address!r}")
    try:
        return StoreClient(host.strip("[]"), int(port), secret, timeout_s)
    except AuthenticationError as error:
        raise ConfigError(f"the coordinator at {address} refused this agent: {error}") from None
    except ControlPlaneError as error:
        raise ConfigError(f"{error}: is `deadpool coordinator` running there?") from None


class NodeAgent:
    """The agent of node `node`: registers, then runs the processes the coordinator assigns it."""

    def __init__(self, store: StoreClient, beat_store: StoreClient, secret: bytes, node: int,
                 run_dir: Path | None = None, joining: bool = False) -> None:
        self.plane, self.beat_plane, self.node = ControlPlane(store), ControlPlane(beat_store), node
        config = self.plane.get(CONFIG_KEY, JobConfig)
        if not joining and not 0 <= node < config.nodes:
            raise ConfigError(f"--node-rank {node}: this job has nodes 0..{config.nodes - 1}")
        here = store.channel.sock.getsockname()[0]  # this node's address on the way to the coordinator
        config = replace(config, gpus_per_node=count_gpus(config), interface=interface_of(here))
        devices = place_devices(config.nproc_per_node, 0, config.gpus_per_node or 0)
        if not devices.ok:
            raise ConfigError(f"node {node}: {devices.reason}")
        run = Path(run_dir or config.run_dir)
        run.mkdir(parents=True, exist_ok=True)
        config_path = run / f"config.node{node}.json"
        config = replace(config, secret_file=str(write_secret(run.resolve() / f"secret.node{node}", secret)))
        config.write(config_path)
        self.config, self.keys = config, Keys(config.token)
        self.local = Agent(config, config_path, prefix=f"n{node}:")  # its processes die with it
        self.spawned = 0
        self.generation = -1  # the newest plan read

    def run(self) -> int:
        """Until the job's shutdown: beat, start what is ordered, report exits, fence what is fenced. An agent
        that loses its coordinator (no answer within the store's timeout) stops its node's processes: the
        coordinator has replaced them by then."""
        keys, plane = self.keys, self.plane
        if plane.count(keys.node_claim(self.node)) != 1:  # atomic: of two agents started at once, one is refused
            raise ConfigError(f"node {self.node} has already joined this job: give each agent its own --node-rank "
                              "(a machine that stands in for a lost node joins with --spare)")
        plane.put(keys.node(self.node), NodeHello(self.node, socket.gethostname(), os.getpid()))
        threading.Thread(target=self._beat, name="deadpool-node-beat", daemon=True).start()
        try:
            while not plane.has(keys.shutdown()):
                self._start_assigned()
                self._report_exits()
                self._release_takers()
                alive = sorted(self.local.alive())
                for name, fenced in zip(alive, plane.present([keys.fence(name) for name in alive])):
                    if fenced:
                        self.local.fence(name)
                time.sleep(BEAT_EVERY_S)
        except ControlPlaneError as error:
            if not self.local.alive():  # the job ended between two looks: the coordinator wrote its shutdown,
                return 0                # saw this node's processes exit (reported above) and closed its store
            print(f"[n{self.node}] lost the coordinator ({str(error).splitlines()[0]}); stopping this node",
                  file=sys.stderr, flush=True)
            self.local.stop_all(grace_s=0.0)
            return 1
        self.local.stop_all(grace_s=STOP_GRACE_S)
        self._report_exits()
        return 0

    def _beat(self) -> None:
        """The node's heartbeat, on a thread and a store client of its own: starting a process (a fork of
        this one) or a slow store call in the main loop must not look like a lost node."""
        try:
            while True:
                self.beat_plane.count(self.keys.node_beat(self.node))
                time.sleep(BEAT_EVERY_S)
        except ControlPlaneError:  # the coordinator is gone; the main loop says so
            return

    def _start_assigned(self) -> None:
        while (order := self.plane.poll(self.keys.node_spawn(self.node, self.spawned + 1), SpawnOrder)) is not None:
            self.spawned += 1
            child = self.local.spawn(order.name, order.role, order.rank)
            self.plane.put(self.keys.node_pid(order.name), Pid(order.name, child.pid))

    def _release_takers(self) -> None:
        """Once a new generation's plan gives one of this node's spares a rank, its output (held in its log
        while it idled) is echoed, labelled as on one machine ("n2:s0=r2"). The coordinator writes the
        generation number after its plan, so the plan it names is there."""
        published = self.plane.poll(self.keys.generation(), Published)
        gen = -1 if published is None else published.gen
        if gen == self.generation:
            return
        self.generation = gen
        for rank, name in enumerate(self.plane.get(self.keys.plan(gen), Plan).ranks):
            child = self.local.children.get(name)
            if child is not None and child.role == "spare":
                self.local.relabel(name, f"{name}=r{rank}")

    def _report_exits(self) -> None:
        for child in self.local.poll():
            assert child.returncode is not None
            self.plane.put(self.keys.node_exit(self.node, child.name), ProcessExit(child.name, child.returncode,
                                                                                  child.pid))


def agent_main(address: str, node: int | None, run_dir: Path | None, timeout_s: float,
               secret_file: Path | None = None) -> int:
    """`deadpool agent`: joins the job of the coordinator at `address` as node `node`, until it ends; with
    node None (--spare), as a spare node of the running job, under the next node number. The job's secret
    comes from `secret_file` or the environment, never from the command line."""
    secret = find_secret(secret_file)
    store = connect_to_coordinator(address, secret, timeout_s)
    plane = ControlPlane(store)
    try:  # the coordinator publishes the job once it is listening
        plane.wait([CONFIG_KEY], time.monotonic() + timeout_s)
    except TimeoutError:
        raise ConfigError(f"the coordinator at {address} published no job within {timeout_s:g} s") from None
    job = plane.get(CONFIG_KEY, JobConfig)
    if not job.nproc_per_node:
        raise ConfigError(f"the job at {address} runs without nodes (no --nnodes): no node agent can join it")
    joining = node is None
    if node is None:
        node = job.nodes + plane.count(Keys(job.token).nodes_joined()) - 1  # atomic: no two take one number
    what = "spare node" if joining else "node"
    print(f"[n{node}] agent of {what} {node} joined the coordinator at {address}", file=sys.stderr, flush=True)
    beat_store = connect_to_coordinator(address, secret, timeout_s)
    return NodeAgent(store, beat_store, secret, node, run_dir, joining).run()
