"""One `deadpool run` of a chaos scenario, in a session of its own: its events followed, a deadline it cannot
outlive, and everything it started killed by pid at the end, so that no scenario hangs the matrix or leaks into
the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from deadpool.events import read_events

POLL_S = 0.02  # how often the runner looks at a job's events: well under the example's step


class Job:
    """`deadpool run ARGV` started now, to be ended by `deadline` (a time.monotonic() value, the clock of the
    events' "t" on Linux). Its output goes to run_dir/launch.log."""

    def __init__(self, run_dir: Path, argv: list[str], deadline: float) -> None:
        self.run_dir, self.deadline = run_dir, deadline
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "launch.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "deadpool.launcher.cli", "run", *argv],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.code: int | None = None

    def events(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        return list(read_events(path)) if path.exists() else []

    def wait_for(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """The first event `wanted` accepts, as soon as it is written; None if the job ended or passed its
        deadline without one."""
        while time.monotonic() < self.deadline:
            found = next((e for e in self.events() if wanted(e)), None)
            if found is not None or self.proc.poll() is not None:
                return found
            time.sleep(POLL_S)
        return None

    def pid(self, proc: str) -> int | None:
        return next((e["pid"] for e in self.events() if e["event"] == "process_spawned" and e["proc"] == proc), None)

    def finish(self) -> int | None:
        """The launcher's exit code (negative: the signal that ended it), or None: killed at the deadline."""
        try:
            self.code = self.proc.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.code = None
        return self.code

    def started(self) -> list[int]:
        """Every process the job started, as its events name them: training processes and node agents."""
        pids = [self.proc.pid]
        for e in self.events():
            if e["event"] in ("process_spawned", "process_start"):
                pids.append(e["pid"])
            elif e["event"] == "nodes_joined":
                pids += e["agent_pids"]
        return list(dict.fromkeys(pids))

    def alive(self) -> list[int]:
        mark = str(self.run_dir.resolve()).encode()
        return [pid for pid in self.started() if _ours(pid, mark)]

    def cleanup(self) -> list[int]:
        """SIGKILLs (stopped ones too) what the job left running, removes network namespaces it left, reaps
        the launcher; returns the pids that had to be killed."""
        left = self.alive()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for e in self.events():
            if e["event"] == "network":  # a launcher killed at the deadline never removed them
                for ns in e["namespaces"]:
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                subprocess.run(["ip", "link", "del", e["bridge"]], capture_output=True)
        return [pid for pid in left if pid != self.proc.pid]


def _ours(pid: int, mark: bytes) -> bool:
    """Alive (not a zombie) and still one of this job's processes (a launcher or agent by its command line, a
    training process by its config path, in its environment): a pid reused since by another is left alone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return "zombie" not in status.lower() and (b"deadpool.launcher.cli" in cmdline or mark in environ)
