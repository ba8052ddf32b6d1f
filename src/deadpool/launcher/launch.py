"""Runs one job on this machine: run directory, config, the coordinator's store, processes, summary."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, TextIO

from deadpool.config import JobConfig
from deadpool.coordinator.nodes import RemoteNodes
from deadpool.coordinator.policy import Decision, place_devices
from deadpool.coordinator.server import Coordinator, Processes
from deadpool.errors import ConfigError
from deadpool.events import EventLog
from deadpool.launcher.address import interface_of
from deadpool.launcher.agent import Agent
from deadpool.launcher.netns import Network
from deadpool.launcher.resume import on_sigterm, prepare_disk
from deadpool.protocol.keys import CONFIG_KEY, Keys
from deadpool.protocol.nodes import NodeHello
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.secret import ENV_SECRET, new_secret, read_secret, write_secret
from deadpool.protocol.store import StoreServer
from deadpool.report import summarize


def host_store(config: JobConfig, secret: bytes) -> StoreServer:
    """The control-plane store lives in the launcher, so no dying rank can take it down. It listens on the
    job's address alone and serves only connections that prove they hold the job's secret."""
    try:
        return StoreServer(config.store_host, config.store_port, secret)
    except OSError as error:
        raise ConfigError(f"cannot host the control-plane store on {config.store_host}:{config.store_port} "
                          f"({error.strerror}); pick a free port with --master-port, or 0 for any") from None


def log_refusals(events: EventLog) -> Callable[[str, str], None]:
    """Every connection the store refuses becomes an event and a line on stderr: someone tried."""

    def refused(peer: str, why: str) -> None:
        events.emit("control_plane_refused", peer=peer, reason=why)
        print(f"[coordinator] refused a connection to the control plane from {peer}: {why}", file=sys.stderr,
              flush=True)
    return refused


# Device nodes of the drivers torch.cuda runs on (NVIDIA's, AMD's ROCm): without one, no process here sees a GPU.
GPU_DRIVERS = ("/dev/nvidiactl", "/dev/kfd")


def count_gpus(config: JobConfig) -> int:
    """The GPUs this node's processes share out: none under gloo, else --gpus-per-node or all visible ones."""
    if config.backend == "gloo":
        return 0
    visible = 0
    if any(Path(device).exists() for device in GPU_DRIVERS):
        import torch  # only here: the launcher and node agents of a CPU job never load torch (~2 s each)

        visible = torch.cuda.device_count()
    gpus = visible if config.gpus_per_node is None else config.gpus_per_node
    if gpus > visible:
        raise ConfigError(f"--gpus-per-node {gpus}, but {visible} GPUs are visible here")
    if config.backend == "nccl" and gpus == 0:
        raise ConfigError("--backend nccl needs GPUs, and none is visible here: use --backend gloo")
    return gpus


def start_nodes(config: JobConfig, plane: ControlPlane, events: EventLog, echo: TextIO | None,
                start_agents: bool, network: Network | None) -> RemoteNodes:
    """Starts one agent per node on this machine if asked (`deadpool run --nnodes`; `deadpool coordinator`
    waits for agents started elsewhere), each in its own network namespace with --netns, and waits until
    every node joined."""
    keys, agents = Keys(config.token), {}
    if start_agents:
        out = None if echo is not None else subprocess.DEVNULL
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"} if network else None  # gloo: the node's own interface
        for node in range(config.nodes):
            argv = [sys.executable, "-m", "deadpool.launcher.cli", "agent", "--coordinator",
                    f"{config.store_host}:{config.store_port}", "--node-rank", str(node), "--secret-file",
                    config.secret_file]
            agents[node] = subprocess.Popen(network.command(node, argv) if network else argv, env=env, stdout=out,
                                            stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    else:
        print(f"[coordinator] waiting for {config.nodes} node agents: on each node run `deadpool agent "
              f"--coordinator {config.store_host}:{config.store_port} --node-rank K --secret-file SECRET` "
              f"(K = 0..{config.nodes - 1}; {config.workers // config.nproc_per_node} worker nodes first, then spare "
              f"nodes; SECRET: a copy of {config.secret_file}, mode 600, or the variable {ENV_SECRET})", flush=True)
    deadline = time.monotonic() + config.connect_timeout_s
    missing = list(range(config.nodes))
    while missing:
        missing = [n for n, ok in zip(missing, plane.present([keys.node(n) for n in missing])) if not ok]
        dead = [n for n, agent in agents.items() if agent.poll() is not None]
        if dead or (missing and time.monotonic() > deadline):
            for agent in agents.values():
                agent.kill()
            what = f"the agents of nodes {dead} exited" if dead else f"nodes {missing} did not join"
            raise ConfigError(f"{what} within {config.connect_timeout_s:g} s of the job's start")
        time.sleep(0.02)
    joined = [plane.get(keys.node(n), NodeHello) for n in range(config.nodes)]
    events.emit("nodes_joined", nodes=config.nodes, nproc_per_node=config.nproc_per_node,
                hosts=[j.host for j in joined], agent_pids=[j.pid for j in joined])
    return RemoteNodes(plane, keys, list(range(config.nodes)), config.nproc_per_node, config.node_timeout_s, agents)


def launch(config: JobConfig, echo: TextIO | None = sys.stdout, start_agents: bool = True) -> tuple[int, dict]:
    """Runs the job to its end and returns (exit code, summary). The summary is also in run_dir/summary.json.
    With nodes (config.nproc_per_node), the processes run under one agent per node; `start_agents` False
    waits for agents started by hand or by a scheduler instead of starting them here."""
    if not Path(config.script).is_file():
        raise ConfigError(f"training script {config.script!r} does not exist")
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").unlink(missing_ok=True)
    if not config.nproc_per_node:  # on nodes, each agent counts its own machine's GPUs (launcher/node.py)
        config = replace(config, gpus_per_node=count_gpus(config))
    devices = place_devices(config.workers, config.spares, config.gpus_per_node or 0)
    if not devices.ok:
        raise ConfigError(devices.reason)
    config, skipped, moved = prepare_disk(config, echo)  # damaged ones skipped, newer ones set aside: logged below
    network = Network(config.nodes).create() if config.netns else None
    secret = read_secret(config.secret_file) if config.secret_file else new_secret()
    store, events = None, None
    try:
        if network is not None:
            config = replace(config, store_host=network.host_address)  # the bridge: the nodes' only way in
        store = host_store(config, secret)
        events = EventLog(run_dir / "events.jsonl", role="coordinator", proc="coordinator")
        store.on_refused = log_refusals(events)
        for p, why in skipped:
            events.emit("checkpoint_skipped", path=str(p), reason=why)
        for old, aside in moved:
            events.emit("checkpoint_set_aside", path=str(old), to=str(aside))
        config = replace(config, store_port=store.port, token=config.token or secrets.token_hex(8),
                         secret_file=str(Path(config.secret_file).resolve() if config.secret_file else
                                         write_secret(run_dir.resolve() / "secret", secret)),
                         interface=config.interface or interface_of(config.store_host),
                         run_dir=str(run_dir.resolve()), script=str(Path(config.script).resolve()))
        code = _run(config, ControlPlane(store.table), events, devices, echo, start_agents, network)
    finally:
        if store is not None:
            store.close()
        if events is not None:
            events.close()
        if network is not None:
            network.remove()
    summary = summarize(run_dir / "events.jsonl", exit_code=code, faults=config.faults)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    for line in closing_lines(summary) if echo is not None else ():
        print(f"[deadpool] {line}", file=echo, flush=True)
    return code, summary


def closing_lines(summary: dict) -> list[str]:
    """What the console is told once the job ended, beyond its exit: faults asked for that never fired, and
    checkpoints that could not be written (each one otherwise only an event)."""
    failures = summary["persist_failures"]
    unwritten = [f"{len(failures)} checkpoint(s) not written (the last, step {failures[-1]['step']}: "
                 f"{failures[-1]['reason']}): see persist_failures in summary.json"] if failures else []
    return [*summary["faults_not_fired"], *unwritten]


def _run(config: JobConfig, plane: ControlPlane, events: EventLog, devices: Decision, echo: TextIO | None,
         start_agents: bool, network: Network | None) -> int:
    """The job itself, once its store (and network) exist: config file, events, processes, the coordinator."""
    config_path = Path(config.run_dir) / "config.json"
    config.write(config_path)
    plane.put(CONFIG_KEY, config)  # what node agents read first; one that finds no nodes says so
    events.emit("job_start", workers=config.workers, spares=config.spares, port=config.store_port,
                snapshot_every=config.snapshot_every, devices=devices.value, placement=devices.reason)
    if network is not None:
        events.emit("network", bridge=network.bridge, host_address=network.host_address,
                    addresses=[network.address(n) for n in range(config.nodes)],
                    links=[network.link(n) for n in range(config.nodes)],
                    namespaces=[network.namespace(n) for n in range(config.nodes)])
    started = time.monotonic()
    agent: Processes = (start_nodes(config, plane, events, echo, start_agents, network) if config.nproc_per_node
                        else Agent(config, config_path, echo=echo))
    coordinator = Coordinator(config, plane, events, agent)
    try:
        with on_sigterm(coordinator.request_stop):
            code = coordinator.run()
    except BaseException:
        for name in agent.alive():
            agent.fence(name)
        agent.stop_all(grace_s=0.0)
        raise
    events.emit("job_end", exit_code=code, duration_s=time.monotonic() - started)
    return code
