"""The CPU time a whole job spends, sampled from /proc: this process (the bench, which runs DeadPool's launcher
in-process) and every process below it (workers, spares, torchrun's agent), alive or already reaped.

Step times on a shared machine drift by more than the few per cent a benchmark must resolve (rounds of one
variant spread 15-20 % here). Where the drift is other processes' load, CPU seconds per step do not follow
it: another tenant slows our steps but adds nothing to our CPU time. Where it is the cores' own speed (this
development VM: CPU per step tracked step time exactly, docs/benchmarks.md), they drift alike. Reported
beside step times, never instead of them: a step that waits (on the network, on a peer) costs time and no
CPU.

Linux only (/proc/<pid>/stat, /proc/<pid>/task/<tid>/children); elsewhere the sampler records nothing.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from types import TracebackType

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
EVERY_S = 0.5  # a sample reads a few files per process of the job: ~1 ms


def process_cpu_s(pid: int) -> float:
    """A process's user and system time, its threads' and its reaped children's: what it and everything it
    waited for have spent. A child that exits moves from the live tree into its parent's figure, so the sum
    over a tree (tree_cpu_s) grows continuously."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces; fields 3.. follow it
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return (utime + stime + cutime + cstime) * TICK_S


def children(pid: int) -> list[int]:
    """The live children of a process, forked by any of its threads."""
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return found


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and all its descendants (a process that ends meanwhile is skipped: its time
    reaches its parent once reaped)."""
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += process_cpu_s(pid)
            todo += children(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


class JobCpu:
    """Samples tree_cpu_s(this process) every EVERY_S in a thread, stamped with time.monotonic() (the clock
    of every event), while the context is open; `between` reads the CPU spent in a window of a run."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []  # (monotonic time, cumulative CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="deadpool-bench-cpu", daemon=True)
        self._supported = Path(f"/proc/{os.getpid()}/task").is_dir()

    def __enter__(self) -> JobCpu:
        if self._supported:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10 * self.every_s)

    def _sample(self) -> None:
        root = os.getpid()
        while True:
            self.samples.append((time.monotonic(), tree_cpu_s(root)))
            if self._stop.wait(self.every_s):
                self.samples.append((time.monotonic(), tree_cpu_s(root)))
                return

    def at(self, t: float) -> float | None:
        """Cumulative CPU seconds at `t`, interpolated between the samples around it (None outside them)."""
        times = [s[0] for s in self.samples]
        i = bisect.bisect_left(times, t)
        if not self.samples or i == len(times) or (i == 0 and t < times[0]):
            return None
        if times[i] == t:
            return self.samples[i][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def between(self, start: float, end: float) -> float | None:
        """CPU seconds the job spent from `start` to `end` (monotonic), or None if not sampled over all of it."""
        a, b = self.at(start), self.at(end)
        return None if a is None or b is None else b - a
