"""The launcher's contract with real processes: bad input fails clearly, a spare that dies loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool.config import JobConfig
from deadpool.errors import ConfigError
from deadpool.launcher.launch import launch

from .conftest import REPO, SMALL, TRAIN, Background, alive, job_events


def test_port_in_use_is_a_clear_error(tmp_path):
    taken = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    config = JobConfig(script=str(TRAIN), workers=2, run_dir=str(tmp_path), store_port=taken.port)
    with pytest.raises(ConfigError, match=f"127.0.0.1:{taken.port}.*--master-port"):
        launch(config, echo=None)
    assert not (tmp_path / "events.jsonl").exists()  # nothing was started


def test_cli_reports_bad_input_with_exit_code_2(tmp_path):
    cases = [
        (["run", "--workers", "0", str(TRAIN)], "--workers must be at least 1"),
        (["run", "--workers", "2", str(tmp_path / "missing.py")], "does not exist"),
        (["run", "--fault", "kill:9:3", "--workers", "2", str(TRAIN)], "fault targets rank 9"),
        (["run", "--recovery-timeout", "90", str(TRAIN)], "timeouts must satisfy"),
    ]
    for argv, message in cases:
        command = [sys.executable, "-m", "deadpool.launcher.cli", argv[0], "--out", str(tmp_path / "r"), *argv[1:]]
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (argv, out.stderr)
        assert message in out.stderr, (argv, out.stderr)


def test_every_process_start_is_recorded(tmp_path, reference):
    spawned = {e["proc"]: e for e in reference.named("process_spawned")}
    assert {p: (e["role"], e["rank"]) for p, e in spawned.items()} == {
        "w0": ("worker", 0), "w1": ("worker", 1), "w2": ("worker", 2), "w3": ("worker", 3), "s0": ("spare", None)}
    started = {e["proc"]: e["pid"] for e in reference.named("process_start")}
    assert started == {p: e["pid"] for p, e in spawned.items()}


def test_the_events_carry_the_fields_the_readme_documents(reference):
    """What `events.jsonl` says of the reference job (4 workers, a spare on the same machine, a snapshot every
    step), field by field as the README describes them."""
    [start] = reference.named("job_start")
    assert (start["workers"], start["spares"], start["devices"]) == (4, 1, [None] * 5) and start["placement"]
    assert sorted((e["proc"], e["world_size"], e["device"]) for e in reference.named("group_joined")) == [
        (f"w{r}", 4, "cpu") for r in range(4)]
    told = [name for name in os.environ if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES"]
    heaps = {e["heap"] for e in reference.named("process_start")}
    assert len(heaps) == 1 and heaps.pop().startswith("left as the environment sets it" if told else "kept (")
    for rank in range(4):
        steps = [e for e in reference.named("step") if e["rank"] == rank]
        assert [e["step"] for e in steps] == list(range(1, 11))
        assert all(e["wait_s"] >= 0 for e in steps)
        # the step function's own time: less than from one step's end to the next (capture and agreement between)
        assert all(0 < b["dur_s"] < b["t"] - a["t"] for a, b in zip(steps, steps[1:]))
        snapshots = [e for e in reference.named("snapshot") if e["rank"] == rank]
        assert [e["step"] for e in snapshots] == list(range(0, 11))  # the initial state too
        for e in snapshots:
            assert 0 <= e["landed_s"] <= e["copy_s"] <= e["total_s"] - e["slot_wait_s"] and e["cpu_s"] > 0
            assert 0 < e["held"] < e["bytes"] and e["slice"] is not None and e["hash"] == "xxh3_64/1MiB"
            assert (e["holders"], e["sent"]) == (["s0"], 0)  # the spare maps the slot: no byte is sent


def test_a_spare_killed_while_holding_replicas_loses_nothing(tmp_path, reference):
    """SIGKILL the only spare mid-run: the coordinator re-places replicas (nowhere: no spare left),
    the workers roll back to the last commit, and the run is still bit-for-bit the reference."""
    job = Background(tmp_path / "run")
    job.wait_for(lambda e: e["event"] == "step" and e["step"] >= 4)  # training is under way: kill the spare
    os.kill(job.pid("s0"), signal.SIGKILL)
    job = job.join()
    assert job.code == 0, job.summary["error"]
    [lost] = job.named("failure_detected")
    assert lost["proc"] == "s0" and lost["exit"] == "killed by SIGKILL"
    assert job.named("plan_published")[-1]["spares"] == []
    assert job.summary["rank_state_sha256"] == reference.summary["rank_state_sha256"]
    assert job.summary["losses"] == reference.summary["losses"]


@pytest.mark.parametrize("how, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_launcher_that_is_stopped_takes_its_processes_with_it(tmp_path, how, code):
    """A scheduler cancelling the job (SIGTERM), or the OOM killer (SIGKILL): no training process is left
    behind holding its memory and ports. SIGTERM unwinds the launcher, which fences them; on SIGKILL the
    kernel kills them (PR_SET_PDEATHSIG). (Meanwhile a would-be spare node is refused: this job has no nodes.)"""
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "deadpool.launcher.cli", "run", "--workers", "2", "--spares",
                                 "1", "--out", str(out), str(TRAIN), "--steps", "1000", *SMALL], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, started = time.monotonic() + 120, {}
        while time.monotonic() < deadline and not any(e["event"] == "step" for e in job_events(out)):
            time.sleep(0.1)
        started = {e["proc"]: e["pid"] for e in job_events(out) if e["event"] == "process_start"}
        assert sorted(started) == ["s0", "w0", "w1"]
        [start] = [e for e in job_events(out) if e["event"] == "job_start"]
        joiner = subprocess.run([sys.executable, "-m", "deadpool.launcher.cli", "agent", "--coordinator",
                                 f"127.0.0.1:{start['port']}", "--spare", "--secret-file", str(out / "secret")],
                                capture_output=True, text=True, timeout=60)
        assert joiner.returncode == 2 and "runs without nodes (no --nnodes): no node agent can join it" in joiner.stderr
        launcher.send_signal(how)
        assert launcher.wait(30) == code
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [p for p in started.values() if alive(p)]:
            time.sleep(0.1)
        assert not [p for p in started.values() if alive(p)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)

