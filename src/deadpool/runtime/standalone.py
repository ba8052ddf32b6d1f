"""Joins a job that no launcher started: `python train.py` (a job of one rank) or plain `torchrun` (its
ranks), without spares, on the same code path as under `deadpool run`.

deadpool.init() calls `join()` when the DeadPool environment is absent. Rank 0 hosts the job's control
plane in its own process (launcher/inprocess.py: the store and the launcher's coordinator, in threads);
every rank then takes the identity the launcher would have given it (the DeadPool environment, torchrun's
variables), and init() goes on as under the launcher: snapshots, commits, the divergence check, events.
With no spare, a failure ends the job, as it would under torchrun.

    rank 0                                          rank k > 0 (torchrun)
    ------                                          ---------------------
    writes the secret (0600, in a 0700 directory    reads it from that file once it exists
      named after torchrun's run), or takes           (one machine), or from $DEADPOOL_SECRET
      $DEADPOOL_SECRET
    hosts the store on MASTER_ADDR's interface,     connects there, reads the job's config
      MASTER_PORT + 1; the config; the coordinator
    each: publishes its pid; at exit, its exit code (Keys.exited), which the coordinator reads
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from deadpool.config import JobConfig
from deadpool.errors import AuthenticationError, ConfigError, ControlPlaneError
from deadpool.launcher.address import interface_of
from deadpool.launcher.agent import runtime_settings
from deadpool.launcher.inprocess import HostedJob
from deadpool.protocol.keys import CONFIG_KEY, ENV_CONFIG, ENV_DEVICE, ENV_PROC, ENV_ROLE, Keys, torchrun_env
from deadpool.protocol.kinds import Role
from deadpool.protocol.nodes import Pid, ProcessExit
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.secret import ENV_SECRET, find_secret, new_secret, read_secret, write_secret
from deadpool.protocol.store import StoreClient
from deadpool.runtime.terminate import at_exit

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CONNECT_S = 60.0  # how long a rank waits for rank 0's secret and store (JobConfig's connect timeout)


@dataclass(frozen=True)
class Shape:
    """Who this process is in a job that no launcher started: torchrun's identity, or a job of one rank."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    run_id: str = ""  # torchrun's run and restart: what every rank of this attempt knows alike

    @property
    def torchrun(self) -> bool:
        return bool(self.run_id)

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


def shape_of(env: Mapping[str, str]) -> Shape:
    """torchrun's identity when all of its variables are set, else a job of one rank."""
    if not all(name in env for name in TORCHRUN_VARIABLES):
        return Shape()
    run = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return Shape(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
                 local_world_size=int(env["LOCAL_WORLD_SIZE"]), master_addr=env["MASTER_ADDR"],
                 master_port=int(env["MASTER_PORT"]), run_id=run)


def store_address(shape: Shape) -> tuple[str, int]:
    """Where rank 0 hosts the control plane: loopback on any free port for a job of one; under torchrun,
    MASTER_ADDR (loopback when it names this host's loopback) on MASTER_PORT + 1, which every rank can
    derive (torchrun's own store is on MASTER_PORT)."""
    if not shape.torchrun:
        return "127.0.0.1", 0
    host = "127.0.0.1" if shape.master_addr in ("localhost", "127.0.0.1") else shape.master_addr
    return host, shape.master_port + 1


def gpu_of(shape: Shape, visible: int) -> int | None:
    """The GPU a process trains on, torchrun's rule: its LOCAL_RANK, when every local rank has one; else the CPU."""
    return shape.local_rank if visible >= shape.local_world_size else None


def start_line(shape: Shape, run_dir: str) -> str:
    """The one line rank 0 prints at start: what kind of job this is, and where its events are."""
    what = (f"running under torchrun as {shape.world_size} ranks" if shape.torchrun else "running as one rank")
    return (f"[deadpool] no launcher: {what} without spares (start with `deadpool run` for fault tolerance); "
            f"run directory {run_dir}")


def secret_file(shape: Shape, run_dir: Path) -> Path:
    """Where this job's secret lives on each machine: under torchrun, in a directory only this user may enter,
    named after torchrun's run, which every rank knows before it can talk to anyone; else in the run directory."""
    if not shape.torchrun:
        return run_dir / "secret"
    private = Path(tempfile.gettempdir()) / f"deadpool-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    if private.stat().st_uid != os.getuid() or private.stat().st_mode & 0o077:
        raise ConfigError(f"{private} must be a directory of yours that only you can enter (chmod 700 {private})")
    return private / f"torchrun-{shape.run_id}.secret"


def launched() -> bool:
    """Whether `deadpool run` (or a node's agent) started this process: it gave it the config's path."""
    return ENV_CONFIG in os.environ


def join() -> None:
    """Makes this process a rank of a job with a control plane of its own (hosting it on rank 0), and sets the
    environment the launcher would have set, so that deadpool.init() goes on as under `deadpool run`."""
    shape = shape_of(os.environ)
    if shape.nodes > 1 and not os.environ.get(ENV_SECRET):
        raise ConfigError(f"torchrun on {shape.nodes} machines: DeadPool's control plane needs a secret shared "
                          f"by every rank; set {ENV_SECRET} (64 hex digits, e.g. from `openssl rand -hex 32`) "
                          "in every rank's environment, or start the job with `deadpool run --nnodes`")
    gpu = gpu_of(shape, torch.cuda.device_count())
    config, hosted = _host(shape, gpu) if shape.rank == 0 else (_follow(shape), None)
    proc = f"w{shape.rank}"
    keys = Keys(config.token)
    plane = ControlPlane(StoreClient(config.store_host, config.store_port, read_secret(config.secret_file), CONNECT_S))
    plane.put(keys.node_pid(proc), Pid(proc, os.getpid()))
    terminated = _exit_on_sigterm()
    report = lambda code: plane.put(keys.exited(proc), ProcessExit(proc, code, os.getpid()))  # noqa: E731
    at_exit(lambda: _exit(report, hosted, config, terminated))
    identity = {ENV_CONFIG: str(Path(config.run_dir) / "config.json"), ENV_PROC: proc, ENV_ROLE: Role.WORKER.value,
                ENV_DEVICE: "" if gpu is None else str(gpu),
                **torchrun_env(shape.rank, shape.world_size, config.nproc_per_node, gpu)}
    os.environ.update(runtime_settings(config, {**os.environ, **identity}))
    if shape.rank == 0:
        print(start_line(shape, config.run_dir), flush=True)


def _host(shape: Shape, gpu: int | None) -> tuple[JobConfig, HostedJob]:
    """Rank 0: the run directory, the secret, the config, and the control plane, started."""
    run_dir = (Path("deadpool-runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}").resolve()
    run_dir.mkdir(parents=True, mode=0o700)
    secret = find_secret(None) if os.environ.get(ENV_SECRET) else new_secret()
    path = write_secret(secret_file(shape, run_dir), secret)
    if shape.torchrun:  # this machine's ranks read it while they run, and end first; nobody needs it after
        at_exit(lambda: path.unlink(missing_ok=True))
    host, port = store_address(shape)
    config = JobConfig(script=str(Path(sys.argv[0]).resolve()), script_args=tuple(sys.argv[1:]),
                       workers=shape.world_size, run_dir=str(run_dir), store_host=host, store_port=port,
                       token=secrets.token_hex(8), secret_file=str(path), interface=interface_of(host),
                       backend="auto" if gpu is not None else "gloo", gpus_per_node=0 if gpu is None else None,
                       nproc_per_node=shape.local_world_size if shape.nodes > 1 else 0)
    hosted = HostedJob(config, secret, own="w0")
    return hosted.config, hosted.start()


def _follow(shape: Shape) -> JobConfig:
    """Rank k > 0: the secret (rank 0's file on this machine, or the environment's), then the job's config
    from rank 0's store; a copy of the config file and the secret where this machine lacks them."""
    path: Path | None = None
    if os.environ.get(ENV_SECRET):
        secret = find_secret(None)
    else:
        path, deadline = secret_file(shape, Path()), time.monotonic() + CONNECT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise ConfigError(f"rank 0 did not write the job's secret ({path}) within {CONNECT_S:g} s")
            time.sleep(0.02)
        secret = read_secret(path)
    client = _connect_to_rank_0(shape, secret, path)
    try:
        plane = ControlPlane(client)
        plane.wait([CONFIG_KEY], time.monotonic() + CONNECT_S)
        config = plane.get(CONFIG_KEY, JobConfig)
    finally:
        client.close()
    if shape.nodes > 1:  # on another machine than rank 0's, each local rank writes the same, atomically
        run_dir = Path(config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = run_dir / f".config.{os.getpid()}.json"
        config.write(temporary)
        temporary.replace(run_dir / "config.json")
        write_secret(Path(config.secret_file), secret)
    return config


def _connect_to_rank_0(shape: Shape, secret: bytes, path: Path | None) -> StoreClient:
    """A client of rank 0's control plane. A secret file of an earlier torchrun with the same run id (its rank 0
    was killed before removing it) may have been read: rank 0 replaces the file before its control plane
    listens, so a rank refused with a file's secret reads the file again, and tries once more if it changed."""
    host, port = store_address(shape)
    try:
        return StoreClient(host, port, secret, CONNECT_S)
    except AuthenticationError as error:
        if path is not None and read_secret(path) != secret:
            return _connect_to_rank_0(shape, read_secret(path), None)
        raise ConfigError(f"rank 0's control plane at {host}:{port} refused rank {shape.rank} ({error}): every rank "
                          f"must have the same {ENV_SECRET}") from None


def _exit_on_sigterm() -> list[bool]:
    """Makes SIGTERM (torchrun's way of stopping the other ranks when one fails) exit through Python, so that
    exit handlers run: rank 0's coordinator then ends the job and writes its summary. A script's own
    handler stays. Returns a flag that says whether it came."""
    came: list[bool] = []

    def handler(signum: int, frame: object) -> None:
        came.append(True)
        raise SystemExit(128 + signum)

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, handler)
    return came


def _exit(publish: Callable[[int], None], hosted: HostedJob | None, config: JobConfig, terminated: list[bool]) -> None:
    """As the process exits: tells the coordinator how (killed by SIGTERM; 1 after an uncaught exception,
    which Python records in sys.last_value before exit handlers run; else 0, since a `sys.exit(N)` code is
    not visible here), and on rank 0 waits for the job to end before its control plane goes."""
    code = -signal.SIGTERM if terminated else 1 if getattr(sys, "last_value", None) is not None else 0
    try:
        publish(code)
    except ControlPlaneError:  # rank 0, and with it the job, is gone: nobody to tell
        pass
    if hosted is not None:
        hosted.finish(config.collective_timeout_s)
