"""Bounds a benchmark run: a deadline for the whole run and one for its recovery after the injected fault;
past either, every process of the run is SIGKILLed (stopped ones too) and the run's own process reaped.

A hung worker can leave a system waiting for a very long time (torchrun's survivors sit in an all-reduce
until gloo's 30-minute timeout), so the benchmark gives every system the same wait after the fault and
records one that has not completed a step by then as not recovered.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Any

TIMEOUT_EXIT = 124  # the run was killed for exceeding its deadline, as `timeout` reports it
STALLED_EXIT = 125  # the run was killed for completing no step within the wait after its fault
POLL_S = 0.1  # how often a bounded wait looks at the run


def steps_after(events: list[dict[str, Any]], fault: dict[str, Any]) -> list[dict[str, Any]]:
    """The step events completed after the fault, in time order, less stragglers: in lockstep data
    parallelism a survivor can be a step behind the faulted rank and finish step fault-1 just after the
    fault, which is work from before it, not a recovery. So a process's first step after the fault is
    left out when it is step fault-1 and the process's last step before the fault was fault-2. Events
    are ordered by time ("t"), not file order, as several processes append to one file."""
    last_before: dict[tuple[Any, int], int] = {}  # (pid, rank) -> its last step before the fault
    after = []
    for e in sorted((e for e in events if e["event"] == "step"), key=lambda e: e["t"]):
        key = (e.get("pid"), e["rank"])
        if e["t"] < fault["t"]:
            last_before[key] = e["step"]
            continue
        previous = last_before.pop(key, None)  # only a process's first step after the fault can straggle
        if not (previous == fault["step"] - 2 and e["step"] == fault["step"] - 1):
            after.append(e)
    return after


class FaultWatch:
    """Follows a run's events file and tells when the run has gone `wait_s` past its injected fault
    without completing a step after it (`steps_after`). Event times are time.monotonic(), system-wide
    on Linux, so they compare with this process's clock."""

    def __init__(self, path: Path, wait_s: float | None) -> None:
        self.path, self.wait_s = Path(path), wait_s
        self.fault: dict[str, Any] | None = None
        self.recovered = False
        self._steps: list[dict[str, Any]] = []
        self._offset, self._torn = 0, b""

    def stalled(self, now: float) -> bool:
        if self.wait_s is None or self.recovered:
            return False
        self._read_new_lines()
        if self.fault is None or now - self.fault["t"] <= self.wait_s:
            return False
        self.recovered = bool(steps_after(self._steps, self.fault))
        return not self.recovered

    def _read_new_lines(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self._offset += len(chunk)
        *lines, self._torn = (self._torn + chunk).split(b"\n")  # the last piece may be a line still being written
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "fault_injected" and self.fault is None:
                self.fault = event
            elif event.get("event") == "step":
                self._steps.append(event)


def descendants(root: int) -> list[int]:
    """Every live process below `root`. torchrun starts each worker in a session of its own, so killing
    torchrun's process group would miss them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILLs proc's process group and every process below proc (found before any dies, as an orphan
    leaves the tree), then reaps proc. SIGKILL ends a SIGSTOPped process too."""
    victims = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def wait_bounded(proc: subprocess.Popen, watch: FaultWatch, timeout_s: float, log: IO[bytes]) -> int:
    """proc's exit code, or, once its whole tree is killed, TIMEOUT_EXIT past timeout_s or STALLED_EXIT
    when `watch` says the run stalled after its fault. proc must lead a session of its own."""
    deadline = time.monotonic() + timeout_s

    def give_up(why: str, code: int) -> int:
        kill_tree(proc)
        log.write(f"\n[bounded] {why}: killed every process of the run\n".encode())
        return code

    try:
        while (code := proc.poll()) is None:
            now = time.monotonic()
            if now > deadline:
                return give_up(f"still running after {timeout_s:g} s", TIMEOUT_EXIT)
            if watch.stalled(now):
                return give_up(f"no step within {watch.wait_s:g} s of the fault", STALLED_EXIT)
            time.sleep(POLL_S)
        return code
    except BaseException:  # KeyboardInterrupt and the like: leave nothing running
        kill_tree(proc)
        raise
