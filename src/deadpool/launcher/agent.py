"""The agent of one node: starts that node's workers and spares, relays their output, reports exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, TextIO

from deadpool.config import JobConfig
from deadpool.coordinator.policy import place_devices
from deadpool.protocol.keys import ENV_CONFIG, ENV_DEVICE, ENV_PROC, ENV_ROLE, torchrun_env

_print_lock = threading.Lock()

# Started in front of each process: asks the kernel to send it SIGTERM when its parent (the launcher, or a node's
# agent) dies (PR_SET_PDEATHSIG, kept across exec), exits if the parent is already gone, then becomes the
# training process (same pid). Nothing outlives a launcher killed by SIGKILL or the OOM killer for long: the
# process writes its newest commit to disk and exits within --stop-grace (runtime/terminate.py). A shim
# rather than Popen's preexec_fn: Python code between fork and exec in a threaded parent can deadlock.
DIE_WITH_PARENT = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 15); "
                   "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def process_env(config: JobConfig, config_path: Path, name: str, role: str, rank: int,
                inherited: Mapping[str, str]) -> dict[str, str]:
    """The environment of one training process: its identity (DeadPool's and torchrun's), its GPU, and
    the settings its correctness depends on. Values the user set win, except NCCL's error handling."""
    device = None
    if config.gpus_per_node:
        # On nodes, each node's processes share its own GPUs: a worker node's workers, or a spare node's spares.
        nproc = config.nproc_per_node
        devices = (place_devices(nproc, 0, config.gpus_per_node) if nproc
                   else place_devices(config.workers, config.spares, config.gpus_per_node)).value
        device = devices[rank % nproc if nproc else rank] if devices else None
    env = {**inherited, ENV_CONFIG: str(config_path), ENV_PROC: name, ENV_ROLE: role,
           ENV_DEVICE: "" if device is None else str(device), "PYTHONUNBUFFERED": "1",
           **torchrun_env(rank, config.world_size, config.nproc_per_node, device)}
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks on one host must not oversubscribe
    env.setdefault("PYTHONHASHSEED", str(config.seed))  # str hashes, hence set order, the same every run
    return runtime_settings(config, env)


def runtime_settings(config: JobConfig, env: dict[str, str]) -> dict[str, str]:
    """`env` with the settings DeadPool's runtime reads once the process runs (so a process that no launcher
    started can take them too: runtime/standalone.py). Values the user set win, except NCCL's error handling."""
    if config.interface:  # gloo listens where the job lives (loopback on one machine), unless the user chose
        env.setdefault("GLOO_SOCKET_IFNAME", config.interface)
    # DeadPool aborts a failed generation's communicator itself (runtime/comms.abandon_group); NCCL's watchdog
    # must neither abort it first nor kill the process, as torch asks of callers of abort.
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    if config.deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: deterministic GEMMs
    return env


@dataclass
class Child:
    name: str
    role: str
    popen: subprocess.Popen
    label: str
    pump: threading.Thread | None = None
    held: list[str] | None = None  # an idle spare's output lines, kept from the console until it takes a rank
    returncode: int | None = None
    reported: bool = field(default=False)

    @property
    def pid(self) -> int:
        return self.popen.pid


class Agent:
    """Runs the training script once per process, each line of its output prefixed with who said it."""

    def __init__(self, config: JobConfig, config_path: Path, echo: TextIO | None = sys.stdout,
                 prefix: str = "") -> None:
        self.config = config
        self.config_path = config_path
        self.echo = echo
        self.prefix = prefix    # before each process's name in its output lines (a node agent's: "n1:")
        # An idle spare runs the script up to deadpool.init(): its banner would read as if it trained. Its
        # output goes to its log only until relabel() says it took a rank (the coordinator says so on one
        # machine; a node's agent, from the plans it reads: launcher/node.py).
        self.children: dict[str, Child] = {}
        self.wake: Callable[[], None] = lambda: None  # called as each child exits
        self.log_dir = Path(config.run_dir) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, role: str, rank: int) -> Child:
        """Starts one process as `rank` (a spare: a placeholder rank past the workers'). Its pid is in child.pid."""
        env = process_env(self.config, self.config_path, name, role, rank, os.environ)
        command = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()),
                   sys.executable, "-u", self.config.script, *self.config.script_args]
        popen = subprocess.Popen(command, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 text=True, errors="replace")
        child = Child(name, role, popen, label=f"{self.prefix}{name}",
                      held=[] if role == "spare" else None)
        child.pump = threading.Thread(target=self._pump, args=(child,), name=f"pump-{name}", daemon=True)
        child.pump.start()
        self.children[name] = child
        return child

    def _pump(self, child: Child) -> None:
        assert child.popen.stdout is not None  # spawned with stdout=PIPE
        with open(self.log_dir / f"{child.name}.log", "w") as log:
            for line in child.popen.stdout:
                log.write(line)
                log.flush()
                with _print_lock:
                    if child.held is not None:
                        child.held.append(line)
                    else:
                        self._echo(child, [line])
        code = child.popen.wait()  # its output ends as it exits (unless a child of its own still holds it)
        self.wake()
        if code != 0:  # a spare that failed while idle: its traceback must be seen
            self._release(child)

    def on_exit(self, wake: Callable[[], None]) -> None:
        """Calls `wake` as each child exits: the coordinator looks at once instead of at its next tick."""
        self.wake = wake

    def _echo(self, child: Child, lines: list[str]) -> None:
        """Called with _print_lock held."""
        if self.echo is not None and lines:
            self.echo.write("".join(f"[{child.label}] {line}" for line in lines))
            self.echo.flush()

    def _release(self, child: Child) -> None:
        """Echoes a spare's held output, and what follows as it comes."""
        with _print_lock:
            held, child.held = child.held, None
            self._echo(child, held or [])

    def poll(self) -> list[Child]:
        """Children that exited since the last call."""
        exited = []
        for child in self.children.values():
            if child.returncode is None and child.popen.poll() is not None:
                child.returncode = child.popen.returncode
                exited.append(child)
        return exited

    def joined(self) -> dict[int, str]:
        """On one machine no node can join."""
        return {}

    def relabel(self, name: str, label: str) -> None:
        """Changes the prefix of a process's output lines (a spare that took a rank: "s0=r2")."""
        if name in self.children:
            self.children[name].label = f"{self.prefix}{label}"
            self._release(self.children[name])

    def alive(self) -> set[str]:
        return {name for name, c in self.children.items() if c.returncode is None and c.popen.poll() is None}

    def fence(self, name: str) -> None:
        """Kills a process for good (SIGKILL cannot be caught or ignored)."""
        child = self.children[name]
        if child.popen.poll() is None:
            child.popen.send_signal(signal.SIGKILL)

    def stop_all(self, grace_s: float) -> None:
        """Waits up to `grace_s` for children to leave by themselves, then kills the rest; drains output."""
        deadline = time.monotonic() + grace_s
        for child in self.children.values():
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fence(child.name)
        for child in self.children.values():
            child.popen.wait(5.0)
            if child.returncode is None:
                child.returncode = child.popen.returncode
            if child.pump is not None:
                child.pump.join(5.0)
