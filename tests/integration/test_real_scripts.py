"""Real training scripts under DeadPool: a torchrun DDP script and its port, the habits of real scripts
(identity from the environment, the default group, unseeded RNGs, an early stop), and the divergence
check that catches state DeadPool was not told about.

Oracles are exact: final weights compared tensor by tensor with torch.equal, state hashes, every printed
loss, the step at which every rank stopped.
"""

from __future__ import annotations

import difflib
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deadpool.config import Fault
from tests.integration.conftest import REPO, SCRIPTS, SMALL, Background, Job, run_job

EXAMPLE = REPO / "examples" / "gpt"
PLAIN, PORT = EXAMPLE / "train_ddp.py", EXAMPLE / "train_ddp_deadpool.py"
PORT_ARGS = ("--max-iters", "20")  # eval and checkpoint on rank 0 at iterations 0, 5, 10, 15; 4 micro-steps
LOSS_LINE = re.compile(r"iter (\d+): loss (\S+),")


def changed_lines() -> list[str]:
    """The port's diff against the plain script: added and removed lines."""
    diff = difflib.unified_diff(PLAIN.read_text().splitlines(), PORT.read_text().splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def test_the_port_changes_the_lines_the_readme_counts_and_shows_them_all() -> None:
    changed = changed_lines()
    added, removed = sum(line[0] == "+" for line in changed), sum(line[0] == "-" for line in changed)
    readme = (REPO / "README.md").read_text()
    counted = re.search(r"ports by changing (\d+) lines\s+\((\d+) added, (\d+) removed\)", readme)
    assert counted, "README's count of the port's changed lines"
    assert (len(changed), added, removed) == tuple(map(int, counted.groups())) and len(changed) <= 10, changed
    for line in changed:
        assert line in readme, f"README's port diff lacks: {line}"


def losses(job: Job) -> dict[int, str]:
    """Every loss rank 0 printed, by iteration; a replayed iteration must print the same bits (a repr)."""
    seen: dict[int, str] = {}
    for log in sorted((job.run_dir / "logs").glob("*.log")):
        for match in LOSS_LINE.finditer(log.read_text()):
            it, value = int(match[1]), match[2]
            assert seen.setdefault(it, value) == value, f"iteration {it} printed {seen[it]} and {value}"
    return seen


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def run_port(run_dir: Path, *faults: Fault, script: Path = PORT, prefix: tuple[str, ...] = ()) -> Job:
    job = run_job(run_dir, steps=None, workers=2, spares=1, faults=faults, script=script, script_prefix=prefix,
                  script_args=(*PORT_ARGS, "--out-dir", str(run_dir / "out")))
    assert job.code == 0, job.summary
    return job


@pytest.fixture(scope="module")
def port_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    job = run_port(tmp_path_factory.mktemp("port-reference"))
    assert job.summary["swaps"] == 0 and sorted(losses(job)) == list(range(20))
    return job


def test_the_port_trains_bit_for_bit_like_the_plain_script_under_torchrun_ddp(port_reference: Job,
                                                                              tmp_path: Path) -> None:
    """Two ranks, 4 micro-steps of gradient accumulation with require_backward_grad_sync: one reduction
    per optimizer step with DDP's arithmetic, so the weights are DDP's to the last bit."""
    out = tmp_path / "torchrun"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(PLAIN), *PORT_ARGS, "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    # torch 2.13's own teardown: about 1 run in 6 of this plain script (no DeadPool in it) aborts after its
    # last line, in destroy_process_group (C++ "terminate called without an active exception"). Its output
    # is whole by then, and the comparisons below check all of it.
    torch_teardown = "terminate called without an active exception" in done.stderr and (out / "final.pt").exists()
    assert done.returncode == 0 or torch_teardown, done.stderr[-3000:]
    assert_same_weights(weights(out / "final.pt"), weights(port_reference.run_dir / "out" / "final.pt"))
    torchrun_losses = {int(m[1]): m[2] for m in LOSS_LINE.finditer(done.stdout)}
    assert torchrun_losses == losses(port_reference)


@pytest.mark.parametrize("fault", [
    Fault(kind="kill", rank=1, step=1, phase="backward"),    # the first step
    Fault(kind="kill", rank=1, step=8, phase="backward"),    # mid-run, inside a micro-step's backward
    Fault(kind="kill", rank=0, step=11, phase="forward"),    # rank 0 evaluating (iteration 10 evaluates first)
], ids=["step-1", "mid-run", "rank-0-evaluating"])
def test_the_port_survives_a_kill_bit_for_bit(port_reference: Job, tmp_path: Path, fault: Fault) -> None:
    job = run_port(tmp_path, fault)
    assert job.summary["swaps"] == 1
    assert job.summary["final_state_sha256"] == port_reference.summary["final_state_sha256"]
    assert losses(job) == losses(port_reference)
    assert_same_weights(weights(job.run_dir / "out" / "final.pt"), weights(port_reference.run_dir / "out" / "final.pt"))


def test_the_port_survives_rank_0_killed_halfway_through_its_checkpoint(port_reference: Job, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    job = run_port(tmp_path, script=SCRIPTS / "kill_in_checkpoint.py", prefix=(str(marker),))
    assert marker.exists() and job.summary["swaps"] == 1
    assert job.summary["recoveries"][0]["failed_ranks"] == [0]
    assert job.summary["final_state_sha256"] == port_reference.summary["final_state_sha256"]
    assert losses(job) == losses(port_reference)
    for name in ("final.pt", "ckpt.pt"):  # the half-written checkpoint was written again, whole
        mine, reference = (torch.load(d / "out" / name, weights_only=True)
                           for d in (job.run_dir, port_reference.run_dir))
        assert_same_weights(mine["model"] if name == "ckpt.pt" else mine,
                            reference["model"] if name == "ckpt.pt" else reference)


# ---- the habits of real scripts --------------------------------------------------------------------------

def run_habits(run_dir: Path, *faults: Fault) -> Job:
    job = run_job(run_dir, steps=None, workers=3, spares=1, faults=faults, script=SCRIPTS / "script_habits.py",
                  script_args=())  # no --steps: session.run(steps=None) runs until session.stop()
    assert job.code == 0, job.summary
    return job


def stop_steps(job: Job) -> set[int]:
    return {e["step"] for e in job.named("finished")}


@pytest.fixture(scope="module")
def habits_reference(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_habits(tmp_path_factory.mktemp("habits-reference"))


def test_every_rank_stops_at_the_data_dependent_step_rank_0_chose(habits_reference: Job) -> None:
    (stopped,) = stop_steps(habits_reference)
    assert 6 <= stopped < 100
    assert [e["step"] for e in habits_reference.named("stopped")] == [stopped]
    metric = {e["step"]: e["value"] for e in habits_reference.named("metric") if e["rank"] == 0}
    assert int(metric[stopped]) % 3 == 0 and all(int(metric[s]) % 3 for s in range(6, stopped))
    logs = "".join(p.read_text() for p in (habits_reference.run_dir / "logs").glob("*.log"))
    for rank in range(3):
        assert f"rank {rank} destroyed the default group after step {stopped}" in logs


def test_a_script_that_never_seeds_python_or_numpy_reproduces_its_state_hash(habits_reference: Job,
                                                                              tmp_path: Path) -> None:
    again = run_habits(tmp_path)
    assert again.summary["final_state_sha256"] == habits_reference.summary["final_state_sha256"]
    assert stop_steps(again) == stop_steps(habits_reference)
    # what init() seeded them with: --seed (0) plus the rank, so the ranks draw apart
    first = {e["rank"]: (e["python"], e["numpy"]) for e in habits_reference.named("drawn") if e["step"] == 1}
    assert first == {rank: (random.Random(rank).random(), float(np.random.RandomState(rank).rand()))
                     for rank in range(3)}


def test_default_group_calls_survive_a_kill_between_them(habits_reference: Job, tmp_path: Path) -> None:
    """Rank 2 dies right after its optimizer step, while the others are in the script's own all_reduce and
    barrier on the default group: they unwind from it, and the spare asserts its new identity."""
    job = run_habits(tmp_path, Fault(kind="kill", rank=2, step=4, phase="after_optimizer"))
    assert job.summary["swaps"] == 1
    assert job.summary["final_state_sha256"] == habits_reference.summary["final_state_sha256"]
    assert stop_steps(job) == stop_steps(habits_reference)
    logs = (job.run_dir / "logs" / "s0.log").read_text()
    assert f"rank 2 destroyed the default group after step {min(stop_steps(job))}" in logs


# ---- divergence ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("slices", [True, False], ids=["sliced", "whole"])
def test_an_unregistered_counter_is_caught_as_divergence_naming_step_and_ranks(tmp_path: Path, slices: bool) -> None:
    """Sliced, the spare's parameters (the first piece, audited first in a generation) are outvoted by the
    owner's and the other auditor's; whole, its fingerprint by the others'."""
    job = run_job(tmp_path, steps=14, workers=3, spares=1, script=SCRIPTS / "unregistered_counter.py", script_args=(),
                  faults=(Fault(kind="kill", rank=1, step=7, phase="backward"),), slices=slices)
    assert job.code == 1
    (target,) = [e["target"] for e in job.named("restore_decided")]
    (divergence,) = job.named("divergence")
    assert divergence["step"] == target + 1  # the first step the spare trained with its counter at 0
    assert divergence["groups"] == [[0, 2], [1]] and divergence["action"] == "stop"
    (failed,) = job.named("job_failed")
    assert f"replicas diverged at step {target + 1}, ranks [1] hold different" in failed["reason"]
    assert "than ranks [0, 2]" in failed["reason"] and "nonlocal" in failed["reason"]


def test_divergence_can_be_a_warning(tmp_path: Path) -> None:
    job = run_job(tmp_path, steps=10, workers=3, spares=1, script=SCRIPTS / "unregistered_counter.py", script_args=(),
                  faults=(Fault(kind="kill", rank=1, step=5, phase="backward"),), on_divergence="warn")
    assert job.code == 0
    steps = [e["step"] for e in job.named("divergence")]
    assert steps and steps == sorted(set(steps)) and all(e["action"] == "warn" for e in job.named("divergence"))


# ---- torch.compile -----------------------------------------------------------------------------------------

def test_a_spare_compiles_while_it_waits_and_a_compiled_job_swaps_bit_for_bit(tmp_path: Path) -> None:
    """The spare runs the script's warm-up (a compiled throwaway GPT) on standby; a worker SIGKILLed after
    that is replaced by it, and the compiled run ends bit for bit as the failure-free compiled run. Until the
    kill, steps are paused 0.5 s (30 s in all: the spare's time to warm up); after it, they run at full speed."""
    args, steps, acted = (*SMALL, "--compile", "--log-every", "1000"), 60, tmp_path / "acted"
    # no spare compiling
    reference = run_job(tmp_path / "reference", steps=steps, workers=2, spares=0, script_args=args)
    assert reference.code == 0, reference.summary
    job = Background(tmp_path / "swap", steps=steps, workers=2, spares=1, script_args=args,
                     script=SCRIPTS / "slow_steps.py", script_prefix=("0.5", "--until", str(acted)))
    job.wait_for(lambda e: e["event"] == "spare_warmed_up", timeout_s=180)
    os.kill(job.pid("w1"), signal.SIGKILL)
    acted.touch()
    swapped = job.join(timeout_s=240)
    assert swapped.code == 0 and swapped.summary["swaps"] == 1
    (fault,) = [e for e in swapped.events if e["event"] == "failure_detected"]
    assert [e for e in swapped.events if e["event"] == "spare_warmed_up"][0]["t"] < fault["t"]
    (activated,) = swapped.named("spare_activated")
    late = [e for e in swapped.named("compiled") if e["proc"] == "s0" and e["t"] > activated["t"]]
    assert not late, f"the spare compiled again after it was called: {late}"
    assert swapped.summary["final_state_sha256"] == reference.summary["final_state_sha256"]
