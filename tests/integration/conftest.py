"""Shared helpers for integration tests: run real jobs of the example GPT, and check nothing leaks."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import pytest

from deadpool.config import Fault, JobConfig
from deadpool.events import read_events
from deadpool.launcher.launch import launch

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "gpt" / "train.py"
SCRIPTS = Path(__file__).parent / "scripts"  # test scripts: the example wrapped, or scripts with habits
# A smaller GPT than the demo's, so a 10-step job takes seconds; every behaviour under test is the same.
SMALL = ("--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--batch-size", "4", "--log-samples")


def _children() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """A test fails if any process it started is still running afterwards."""
    before = set(_children())
    yield
    leaked = set(_children()) - before
    assert not leaked, f"test leaked child processes {sorted(leaked)}"


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read().lower()
    except FileNotFoundError:
        return False


def job_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events a job has written so far (none before its events file exists)."""
    path = run_dir / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


class Job:
    """The outcome of one finished job: exit code, summary, and its events."""

    def __init__(self, run_dir: Path, code: int, summary: dict[str, Any]) -> None:
        self.run_dir, self.code, self.summary = run_dir, code, summary
        self.events = list(read_events(run_dir / "events.jsonl"))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def batches(self) -> dict[tuple[int, int], list[int]]:
        """(step, rank) -> sample ids of the execution that counts (the last one: replays supersede)."""
        return {(e["step"], e["rank"]): e["samples"] for e in self.named("batch")}


def run_job(run_dir: Path, *, steps: int | None = 10, workers: int = 4, spares: int = 1, faults: tuple[Fault, ...] = (),
            script_args: tuple[str, ...] = SMALL, script: Path = TRAIN, script_prefix: tuple[str, ...] = (),
            echo: TextIO | None = None, **config: Any) -> Job:
    """Runs one job of `script` (the example by default) to its end; `script_prefix` goes before its arguments,
    then `--steps STEPS` unless `steps` is None. The processes' output goes to `echo` (and to the console, where
    node agents run), as `deadpool run` prints it."""
    step_args = () if steps is None else ("--steps", str(steps))
    job_config = JobConfig(script=str(script), script_args=(*script_prefix, *step_args, *script_args),
                           workers=workers, spares=spares, run_dir=str(run_dir), faults=faults, **config)
    code, summary = launch(job_config, echo=echo)
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    return Job(run_dir, code, summary)


class Background:
    """A job running in a thread, so that a test can act on it (send signals) while it runs."""

    def __init__(self, run_dir: Path, **job: Any) -> None:
        self.run_dir, self.result = run_dir, {}
        self.thread = threading.Thread(target=lambda: self.result.update(job=run_job(run_dir, **job)))
        self.thread.start()

    def events(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        return list(read_events(path)) if path.exists() else []

    def wait_for(self, event: Callable[[dict[str, Any]], bool], timeout_s: float = 60) -> list[dict[str, Any]]:
        """Polls the job's events until one satisfies `event`; returns them all (fails at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and "job" not in self.result:
            events = self.events()
            if any(event(e) for e in events):
                return events
            time.sleep(0.01)
        raise AssertionError(f"the job never logged the awaited event within {timeout_s} s")

    def pid(self, proc: str) -> int:
        return next(e["pid"] for e in self.events() if e["event"] == "process_spawned" and e["proc"] == proc)

    def join(self, timeout_s: float = 120) -> Job:
        self.thread.join(timeout_s)
        return self.result["job"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The failure-free run every fault test must reproduce bit for bit (4 workers, 1 spare, 10 steps)."""
    job = run_job(tmp_path_factory.mktemp("reference"))
    assert job.code == 0 and job.summary["swaps"] == 0
    return job
