"""The bound on every benchmark run: the wait after a fault for the next step, and the kill of a run's whole
process tree, stopped processes included."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool.bench.baselines.bounded import STALLED_EXIT, TIMEOUT_EXIT, FaultWatch, wait_bounded


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def event(name: str, t: float) -> str:
    return json.dumps({"event": name, "rank": 0, "step": 1, "t": t}) + "\n"


def test_watch_says_stalled_only_past_the_wait_with_no_step_after_the_fault(tmp_path):
    path = tmp_path / "events.jsonl"
    watch = FaultWatch(path, wait_s=10.0)
    assert not watch.stalled(now=100.0)  # no file yet
    append(path, event("step", 1.0) + event("fault_injected", 2.0))
    assert not watch.stalled(now=12.0)
    assert watch.stalled(now=12.5)
    append(path, event("step", 1.5))  # written late by another rank, but finished before the fault
    assert watch.stalled(now=12.5)
    append(path, event("step", 3.0)[:10])  # a line still being written
    assert watch.stalled(now=12.5)
    append(path, event("step", 3.0)[10:])
    assert not watch.stalled(now=50.0)


def test_watch_does_not_take_a_straggling_survivor_for_a_recovery(tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [{"event": "step", "rank": 0, "pid": 1, "step": 3, "t": 1.0},
             {"event": "step", "rank": 1, "pid": 2, "step": 4, "t": 1.5},
             {"event": "fault_injected", "rank": 1, "step": 5, "t": 2.0},
             {"event": "step", "rank": 0, "pid": 1, "step": 4, "t": 2.1}]  # began before the fault
    append(path, "".join(json.dumps(e) + "\n" for e in lines))
    assert FaultWatch(path, wait_s=1.0).stalled(now=3.5)


def test_watch_without_a_wait_never_stalls(tmp_path):
    path = tmp_path / "events.jsonl"
    append(path, event("fault_injected", 0.0))
    assert not FaultWatch(path, wait_s=None).stalled(now=1e9)


# A run that injects a hang: writes its fault, starts a worker in a session of its own (as torchrun does),
# records the worker's pid, then SIGSTOPs itself.
HUNG_RUN = """
import json, os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
open(sys.argv[2], "w").write(str(worker.pid))
open(sys.argv[1], "a").write(json.dumps({"event": "fault_injected", "t": time.monotonic()}) + "\\n")
os.kill(os.getpid(), signal.SIGSTOP)
"""


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (an orphan waits there for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(60)
def test_a_stalled_run_is_killed_with_every_process_it_started(tmp_path):
    events, worker_pid, log = tmp_path / "events.jsonl", tmp_path / "worker.pid", tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", HUNG_RUN, str(events), str(worker_pid)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        code = wait_bounded(proc, FaultWatch(events, wait_s=0.5), timeout_s=30, log=out)
    assert code == STALLED_EXIT and proc.returncode == -9  # SIGKILLed while stopped, and reaped
    pid = int(worker_pid.read_text())
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)
    assert "no step within 0.5 s of the fault" in log.read_text()


@pytest.mark.timeout(60)
def test_a_run_past_its_deadline_is_killed(tmp_path):
    with open(tmp_path / "run.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=out,
                                start_new_session=True)
        assert wait_bounded(proc, FaultWatch(tmp_path / "events.jsonl", 0.5), timeout_s=0.5, log=out) == TIMEOUT_EXIT
    assert proc.returncode == -9
