"""Scripts started without the launcher (runtime/standalone.py): `python train.py` runs as a job of one
rank, plain `torchrun` as a job of its ranks, both without spares, on the same code path as `deadpool run`.

Oracles: the exit code, the start line, the run directory's summary, and state hashes equal to the
launcher's for the same script and seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import REPO, SCRIPTS, TRAIN, run_job

PORT = REPO / "examples" / "gpt" / "train_ddp_deadpool.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
TINY = ("--steps", "3", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2",
        "--block-size", "16")
TINY_PORT = ("--max-iters", "3", "--grad-accum", "2", "--n-layer", "1", "--n-embd", "32", "--batch-size", "2",
             "--block-size", "16", "--eval-interval", "2", "--eval-iters", "1")


def run_plain(cwd: Path, *argv: str | Path, code: int = 0) -> tuple[str, dict]:
    """Runs a command with no DeadPool environment in `cwd`; returns its output and its run's summary."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEADPOOL_", "RANK", "LOCAL_", "WORLD_",
                                                                   "MASTER_", "TORCHELASTIC_"))}
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode == 0) == (code == 0), done.stdout + done.stderr
    (run_dir,) = (cwd / "deadpool-runs").iterdir()
    return done.stdout, json.loads((run_dir / "summary.json").read_text())


def test_python_runs_the_example_as_one_rank_without_spares(tmp_path: Path) -> None:
    out, summary = run_plain(tmp_path, sys.executable, TRAIN, *TINY)
    assert out.startswith("[deadpool] no launcher: running as one rank without spares (start with `deadpool run` "
                          "for fault tolerance); run directory " + str(tmp_path / "deadpool-runs"))
    assert (summary["exit_code"], summary["final_step"], summary["swaps"]) == (0, 3, 0)
    assert len(summary["rank_state_sha256"]) == 1


def test_python_runs_the_port_to_the_end(tmp_path: Path) -> None:
    """The issue's "done when": `python examples/gpt/train_ddp_deadpool.py` without the launcher."""
    out, summary = run_plain(tmp_path, sys.executable, PORT, *TINY_PORT, "--out-dir", tmp_path / "out")
    assert "iter 2: loss" in out and (tmp_path / "out" / "final.pt").is_file()
    assert (summary["exit_code"], summary["final_step"]) == (0, 3)


def test_torchrun_runs_the_example_as_deadpool_run_does(tmp_path: Path) -> None:
    """Same script, same seed, two ranks: the state hashes equal those of `deadpool run --workers 2`."""
    out, summary = run_plain(tmp_path, TORCHRUN, "--nproc-per-node", "2", TRAIN, *TINY)
    assert "[deadpool] no launcher: running under torchrun as 2 ranks without spares" in out
    reference = run_job(tmp_path / "launcher", steps=None, workers=2, spares=0, script_args=TINY)
    assert summary["exit_code"] == reference.code == 0
    assert summary["rank_state_sha256"] == reference.summary["rank_state_sha256"]
    assert summary["final_state_sha256"] == reference.summary["final_state_sha256"]


def test_torchrun_runs_the_port_to_the_end(tmp_path: Path) -> None:
    """The port under plain torchrun (its weights equal `deadpool run`'s as the example's hashes do above, and
    torchrun DDP's as test_real_scripts shows): every iteration printed once, the final weights saved."""
    out, summary = run_plain(tmp_path, TORCHRUN, "--nproc-per-node", "2", PORT, *TINY_PORT,
                             "--out-dir", tmp_path / "out")
    assert [f"iter {i}: loss" in out for i in range(3)] == [True] * 3
    assert (summary["exit_code"], summary["final_step"], len(summary["rank_state_sha256"])) == (0, 3, 2)
    assert (tmp_path / "out" / "final.pt").is_file()


def test_under_torchrun_a_failure_ends_the_job_saying_why(tmp_path: Path) -> None:
    """No spare: rank 1's SIGKILL ends the job (torchrun stops the others too), and the summary names it."""
    _, summary = run_plain(tmp_path, TORCHRUN, "--nproc-per-node", "2", SCRIPTS / "kill_rank_one.py", code=1)
    assert summary["exit_code"] == 1 and summary["swaps"] == 0
    assert summary["error"].startswith("rank 1 (w1, pid ")
    # torchrun stops rank 0 as well: seen in the same settle window, rank 1's only holder is lost with it
    assert "no spare is left in the pool" in summary["error"] or "is lost too" in summary["error"]
