"""Nothing of generation g can write into g+1's keys, slots or groups: a stale thread and a stale process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from deadpool.config import Fault, JobConfig
from deadpool.events import EventLog, read_events
from deadpool.protocol.keys import ENV_CONFIG, ENV_PROC, ENV_ROLE, Keys
from deadpool.protocol.kinds import Role
from deadpool.protocol.plan import Plan
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.records import Commit, Durable
from deadpool.protocol.store import Table
from deadpool.runtime.context import Context, connect
from deadpool.runtime.generation import Incarnation
from deadpool.runtime.plane import PlaneStore
from deadpool.runtime.snapshot import SnapshotEngine
from deadpool.runtime.watch import Watch
from tests.plane import control_plane

from .conftest import SCRIPTS, Background
from .test_hot_swap import assert_same_training

STALE = SCRIPTS / "stale_member.py"


class Gate:
    """The engine's fault hook (ctx.faults), used here to hold a snapshot thread in the middle of a copy."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def point(self, phase: str, step: int) -> None:
        if step == 1:
            self.entered.set()
            self.release.wait(30)


class Counter(torch.nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((1000,), value))


def test_a_stale_snapshot_thread_cannot_touch_the_next_generations_slots_or_keys(tmp_path):
    with control_plane(tmp_path) as (server, plane):
        _stale_snapshot_thread(tmp_path, server.table, JobConfig(script="train.py", workers=1, run_dir=str(tmp_path),
                                                                 token="t", **plane))


def _stale_snapshot_thread(tmp_path: Path, master: Table, config: JobConfig) -> None:
    gate, keys = Gate(), Keys("t")
    client = connect(config)
    ctx = Context("w0", Role.WORKER, config, PlaneStore(client), ControlPlane(client), keys,
                  EventLog(tmp_path / "events.jsonl", role="worker", proc="w0"), gate)  # type: ignore[arg-type]
    incs = [Incarnation.of(Plan(generation=g, ranks=("w0",), holders=((),), spares=()), "w0", keys) for g in (0, 1)]
    for inc in incs:
        ControlPlane(master).put(inc.committed_key(), Commit(inc.generation, None, ()))
        master.set(inc.durable_key(), "none yet")
    engine = SnapshotEngine(ctx, torch.device("cpu"))
    watches = [Watch(ctx, inc, None) for inc in incs]
    engine.start(incs[0], watches[0])
    engine.capture(1, {"model": Counter(1.0)})
    assert gate.entered.wait(10)
    stale = engine._run
    engine.stop(timeout_s=0.2)  # gives up on the thread held in its copy: abandoned
    assert stale is not None and stale.thread.is_alive()
    [abandoned] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "snapshot_thread_abandoned"]
    assert abandoned["gen"] == 0

    engine.start(incs[1], watches[1])
    engine.capture(2, {"model": Counter(2.0)})
    engine.wait_copied()
    deadline = time.monotonic() + 10
    while master.get(incs[1].durable_key()) == b"none yet" and time.monotonic() < deadline:
        time.sleep(0.01)
    fresh_report = master.get(incs[1].durable_key())
    slots_before = [(s.step, bytes(s.data.numpy())) for s in engine.slots]

    gate.release.set()  # the stale thread wakes up and finishes its snapshot of step 1
    stale.thread.join(10)
    assert not stale.thread.is_alive()
    assert [(s.step, bytes(s.data.numpy())) for s in engine.slots] == slots_before  # no slot of g1 written
    assert 1 not in [s.step for s in engine.slots]
    assert master.get(incs[1].durable_key()) == fresh_report
    assert Durable.from_json(fresh_report) == Durable(gen=1, rank=0, steps=(2,), skipped=())
    assert master.get(incs[0].durable_key()) != b"none yet"  # it wrote, but only under its own generation
    engine.stop()
    for watch in watches:
        watch.close()


def test_a_stale_process_woken_after_its_replacement_is_refused_everywhere(tmp_path, reference):
    """w1's twin holds generation 0's incarnation, sleeps (SIGSTOP) through w1's replacement, and is woken
    (SIGCONT) in generation 1: its writes land only under generation 0's keys, which nobody reads any more;
    it cannot join a group or stream a replica; its recovery finds itself fenced out. The job is unaffected.
    Its steps are paused 1.5 s (the numbers are the reference's) until the stale process has tried everything:
    the job outlasts it."""
    tried = tmp_path / "tried"
    background = Background(tmp_path / "run", faults=(Fault(kind="kill", rank=1, step=6),),
                            script=SCRIPTS / "slow_steps.py", script_prefix=("1.5", "--until", str(tried)))
    background.wait_for(lambda e: e["event"] == "plan_published")  # the run directory and its config exist
    env = {**os.environ, ENV_CONFIG: str(background.run_dir / "config.json"), ENV_PROC: "w1", ENV_ROLE: "worker"}
    stale = subprocess.Popen([sys.executable, str(STALE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        assert stale.stdout is not None and stale.stdout.readline().strip() == "READY"
        stale.send_signal(signal.SIGSTOP)
        background.wait_for(lambda e: e["event"] == "swap_complete")
        stale.send_signal(signal.SIGCONT)
        out, _ = stale.communicate(timeout=60)
    finally:
        tried.touch()
        stale.kill()
        stale.wait(10)
    job = background.join()
    assert_same_training(job, reference)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines["durable key"] == "g0/durable/1"
    assert lines["rejoin"].startswith("refused (WorkerFailure) w1 was fenced out of generation 1")
    # generation 0's group and replica stream are gone: their old peers refuse it, or never come
    assert lines["join group"].startswith("refused (") and lines["replicate"].startswith("refused (")
    assert not [e for e in job.events if e["proc"] == "w1" and e["t"] > job.named("swap_complete")[0]["t"]]
    assert {e["gen"] for e in job.named("commit") if e["t"] > job.named("swap_complete")[0]["t"]} == {1}
