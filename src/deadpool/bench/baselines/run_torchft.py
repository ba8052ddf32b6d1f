"""Launches the torchft baseline (torchft_gpt.py) on one machine and returns its events.

torchft has no launcher that restarts a replica on a single machine, so this one plays the scheduler:
it runs torchft's lighthouse on loopback, starts one process per replica group (releasing them together
through a TCPStore barrier once every replica's manager is up), and restarts a replica that died from
SIGKILL as soon as it sees it gone (once per run). A SIGSTOPped replica is alive to it, as to any
scheduler that watches processes: it stays stopped until the run ends.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import torch.distributed as dist

from deadpool.bench.baselines.bounded import STALLED_EXIT, TIMEOUT_EXIT, FaultWatch
from deadpool.events import read_events

SCRIPT = Path(__file__).resolve().with_name("torchft_gpt.py")
POLL_S = 0.02  # how often the launcher looks for exited replicas: bounds its restart delay
FINISH_GRACE_S = 10.0  # once one replica has finished, how long the others get to finish too
LISTENING = re.compile(r"Lighthouse listening on: http://[^\s:]+:(\d+)")


def torchft_available() -> bool:
    """torchft is an optional extra (pip install -e ".[torchft]")."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def _lighthouse_command(min_replicas: int, heartbeat_timeout_ms: int) -> list[str]:
    """torchft_lighthouse is the console script torchft installs next to the interpreter. Port 0: the
    lighthouse picks a free one and logs it. Its join and tick timings are torchft's defaults."""
    return [shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or "torchft_lighthouse",
            "--bind", "127.0.0.1:0", "--min_replicas", str(min_replicas),
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]


def _wait_for_port(log_path: Path, proc: subprocess.Popen, deadline: float) -> int:
    """The lighthouse's port, read from its "listening on" log line."""
    while time.monotonic() < deadline:
        found = LISTENING.search(log_path.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited with {proc.returncode}; see {log_path}")
        time.sleep(POLL_S)
    raise TimeoutError(f"torchft_lighthouse did not report its port; see {log_path}")


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILLs each process's group (each runs in a session of its own) and reaps it."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.wait(timeout=30)


def run_torchft(out_dir: Path, *, workers: int, steps: int, kill: tuple[int, int] | None,
                hang: tuple[int, int] | None = None, script_args: tuple[str, ...] = (), timeout_s: float = 300,
                hang_wait_s: float | None = None, heartbeat_timeout_ms: int = 5000) -> tuple[int, list[dict]]:
    """Runs the example GPT as `workers` torchft replica groups of one process each, min_replica_size
    workers-1; `kill=(replica, step)` makes that replica SIGKILL itself in the backward pass of that step,
    and the launcher then starts it again at once; `hang=(replica, step)` makes it SIGSTOP itself there
    instead, and it is left stopped. Returns 0 if the job finished (replicas still running, or stopped,
    FINISH_GRACE_S after the first one finished are killed: a restarted replica that arrives after the
    last step never gets a quorum), the exit status of the first replica that failed otherwise (128 +
    signal for a signal), TIMEOUT_EXIT if the run was killed after timeout_s, or STALLED_EXIT if it was
    killed for committing no step within hang_wait_s (None: no such bound) of the fault; and the events
    of every replica and incarnation, in file order.

    heartbeat_timeout_ms is the lighthouse's (torchft's default 5000): how long a dead replica's last
    heartbeat keeps it in the lighthouse's view, so roughly how long the survivors wait for a new quorum.
    Writes out_dir/events.jsonl (cleared first) and out_dir/torchft.log (the lighthouse's and replicas'
    stdout and stderr, and the launcher's notes).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    events_path, log_path = out_dir / "events.jsonl", out_dir / "torchft.log"
    events_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    deadline = time.monotonic() + timeout_s
    min_replicas = max(1, workers - 1)
    start_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs: list[subprocess.Popen] = []

    def spawn(cmd: list[str], log: IO[bytes]) -> subprocess.Popen:
        log.write(f"[run_torchft] {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        procs.append(proc)
        return proc

    with open(log_path, "wb") as log:
        try:
            lighthouse = spawn(_lighthouse_command(min_replicas, heartbeat_timeout_ms), log)
            port = _wait_for_port(log_path, lighthouse, deadline)

            def replica(index: int, incarnation: int) -> subprocess.Popen:
                cmd = [sys.executable, str(SCRIPT), "--replica", str(index), "--replicas", str(workers),
                       "--min-replicas", str(min_replicas), "--incarnation", str(incarnation),
                       "--lighthouse", f"http://127.0.0.1:{port}", "--start-store", f"127.0.0.1:{start_store.port}",
                       "--steps", str(steps), "--events", str(events_path), *script_args]
                if kill is not None:
                    cmd += ["--kill-rank", str(kill[0]), "--kill-step", str(kill[1])]
                if hang is not None:
                    cmd += ["--hang-rank", str(hang[0]), "--hang-step", str(hang[1])]
                return spawn(cmd, log)

            running = {index: (replica(index, 0), 0) for index in range(workers)}
            restarts_left, code, finished_at = 1, 0, None
            watch = FaultWatch(events_path, hang_wait_s)
            while running and code == 0:
                if time.monotonic() > deadline:
                    log.write(f"\n[run_torchft] killed after {timeout_s} s\n".encode())
                    code = TIMEOUT_EXIT
                    break
                if watch.stalled(time.monotonic()):
                    log.write(f"\n[run_torchft] no step within {hang_wait_s:g} s of the fault: killed\n".encode())
                    code = STALLED_EXIT
                    break
                if finished_at is not None and time.monotonic() > finished_at + FINISH_GRACE_S:
                    # The job has committed its last step. A restarted replica that had not healed in by
                    # then waits for a quorum that will never come; a scheduler would stop it too.
                    log.write(f"[run_torchft] job finished; stopping replicas {sorted(running)}\n".encode())
                    break
                for index, (proc, incarnation) in list(running.items()):
                    status = proc.poll()
                    if status is None:
                        continue
                    del running[index]
                    if status == -signal.SIGKILL and restarts_left > 0:
                        restarts_left -= 1
                        log.write(f"[run_torchft] replica {index} was SIGKILLed: restarting it\n".encode())
                        running[index] = (replica(index, incarnation + 1), incarnation + 1)
                    elif status != 0:
                        log.write(f"[run_torchft] replica {index} exited with {status}\n".encode())
                        code = 128 - status if status < 0 else status
                    elif finished_at is None:
                        finished_at = time.monotonic()
                time.sleep(POLL_S)
        finally:  # also on KeyboardInterrupt and the like: leave nothing running
            _kill(procs)
    events = list(read_events(events_path)) if events_path.is_file() else []
    return code, events
