"""Scripts started without the launcher (runtime/standalone.py): `python train.py` runs as a job of one
rank, plain `torchrun` as a job of its ranks, both without spares, on the same code path as `deadpool run`.

Oracles: the exit code, the start line, the run directory's summary, and state hashes equal to the
launcher's for the same script and seed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deadpool.protocol.secret import ENV_SECRET, new_secret
from deadpool.runtime.standalone import Shape, secret_file
from tests.integration.conftest import REPO, SCRIPTS, TRAIN, run_job

PORT = REPO / "examples" / "gpt" / "train_ddp_deadpool.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
TINY = ("--steps", "3", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2",
        "--block-size", "16")
TINY_PORT = ("--max-iters", "3", "--grad-accum", "2", "--n-layer", "1", "--n-embd", "32", "--batch-size", "2",
             "--block-size", "16", "--eval-interval", "2", "--eval-iters", "1")


def plain_env(**extra: str) -> dict[str, str]:
    """This process's environment without DeadPool's or torchrun's variables, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("DEADPOOL_", "RANK", "LOCAL_", "WORLD_",
                                                                      "MASTER_", "TORCHELASTIC_"))}, **extra}


def master_port() -> str:
    """A free port P whose P + 1 is free too: torchrun's store takes P, DeadPool's control plane P + 1 (torchrun's
    own choice of P leaves P + 1 to chance). Both below the kernel's ephemeral range, so that no connection
    made meanwhile (torchrun's own, to P) takes P + 1 as its source port before rank 0 listens on it: that once
    left rank 0 unable to host the control plane and rank 1 waiting its whole connect timeout."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            port = random.randrange(max(1024, low - 10_000), low - 1)
            try:
                first.bind(("127.0.0.1", port))
            except OSError:
                continue
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return str(port)
    raise AssertionError("no two consecutive free ports in 50 tries")


def torchrun_two_ranks_of(script: Path) -> list[str | Path]:
    """`torchrun --nproc-per-node 2 SCRIPT` on a master port whose next port is free."""
    return [TORCHRUN, "--master-port", master_port(), "--nproc-per-node", "2", script]


def summary_in(cwd: Path) -> dict:
    """The summary of the one run that rank 0 started in `cwd`."""
    (run_dir,) = (cwd / "deadpool-runs").iterdir()
    return json.loads((run_dir / "summary.json").read_text())


def run_plain(cwd: Path, *argv: str | Path, code: int = 0, **env: str) -> tuple[str, dict]:
    """Runs a command with no DeadPool environment (but `env`) in `cwd`; returns its output and its run's summary."""
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=plain_env(**env), capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode == 0) == (code == 0), done.stdout + done.stderr
    return done.stdout, summary_in(cwd)


@pytest.fixture(scope="module")
def torchrun_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """The example under one plain `torchrun --nproc-per-node 2`: its output and summary."""
    return run_plain(tmp_path_factory.mktemp("torchrun"), *torchrun_two_ranks_of(TRAIN), *TINY)


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


def test_torchrun_runs_the_example_as_deadpool_run_does(tmp_path: Path, torchrun_two_ranks) -> None:
    """Same script, same seed, two ranks: the state hashes equal those of `deadpool run --workers 2`."""
    out, summary = torchrun_two_ranks
    assert "[deadpool] no launcher: running under torchrun as 2 ranks without spares" in out
    reference = run_job(tmp_path / "launcher", steps=None, workers=2, spares=0, script_args=TINY)
    assert summary["exit_code"] == reference.code == 0
    assert summary["rank_state_sha256"] == reference.summary["rank_state_sha256"]
    assert summary["final_state_sha256"] == reference.summary["final_state_sha256"]


def test_torchrun_runs_the_port_to_the_end(tmp_path: Path) -> None:
    """The port under plain torchrun (its weights equal `deadpool run`'s as the example's hashes do above, and
    torchrun DDP's as test_real_scripts shows): every iteration printed once, the final weights saved; the
    secret's file in the private temporary directory is gone once rank 0 has exited."""
    private = tmp_path / "tmp"
    private.mkdir()
    out, summary = run_plain(tmp_path, *torchrun_two_ranks_of(PORT), *TINY_PORT,
                             "--out-dir", tmp_path / "out", TMPDIR=str(private))
    assert list((private / f"deadpool-{os.getuid()}").iterdir()) == []  # it held torchrun-RUNID.secret
    assert [f"iter {i}: loss" in out for i in range(3)] == [True] * 3
    assert (summary["exit_code"], summary["final_step"], len(summary["rank_state_sha256"])) == (0, 3, 2)
    assert (tmp_path / "out" / "final.pt").is_file()


def test_under_torchrun_a_failure_ends_the_job_saying_why(tmp_path: Path) -> None:
    """No spare: rank 1's SIGKILL ends the job (torchrun stops the others too), and the summary names it."""
    _, summary = run_plain(tmp_path, *torchrun_two_ranks_of(SCRIPTS / "kill_rank_one.py"), code=1)
    assert summary["exit_code"] == 1 and summary["swaps"] == 0
    assert summary["error"].startswith("rank 1 (w1, pid ")
    # torchrun stops rank 0 as well: seen in the same settle window, rank 1's only holder is lost with it
    assert "no spare is left in the pool" in summary["error"] or "is lost too" in summary["error"]


# ---- torchrun on two machines (two torchruns on loopback): rank 0 hosts the control plane for both -----------

def torchrun_nodes(tmp_path: Path, secrets: tuple[str | None, str | None], *script: str | Path,
                   kill_rank_0: bool = False) -> list[tuple[int, str]]:
    """Runs `torchrun --nnodes 2 --nproc-per-node 1` once per node (node k in tmp_path/node{k}), each with its
    own DEADPOOL_SECRET or none; returns each one's (exit code, output). With `kill_rank_0`, once node 1 has
    ended, rank 0 (its pid ends its run directory's name) is SIGKILLed rather than left to time out. One thread
    per process, as torchrun sets it for several processes per node but not for one: CPU kernels on more
    threads round differently."""
    port = master_port()
    procs = []
    for node, secret in enumerate(secrets):
        (tmp_path / f"node{node}").mkdir(parents=True)
        procs.append(subprocess.Popen(
            [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
             "127.0.0.1", "--master-port", port, "--rdzv-id", f"nodes-{port}", *(str(a) for a in script)],
            cwd=tmp_path / f"node{node}",
            env=plain_env(OMP_NUM_THREADS="1", **({ENV_SECRET: secret} if secret else {})), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    try:
        last = procs[1].communicate(timeout=120)[0]
        if kill_rank_0:
            (run_dir,) = (tmp_path / "node0" / "deadpool-runs").iterdir()
            os.kill(int(run_dir.name.rsplit("-", 1)[1]), signal.SIGKILL)
        first = procs[0].communicate(timeout=120)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        secret_file(Shape(run_id=f"nodes-{port}-0"), tmp_path).unlink(missing_ok=True)  # a killed rank 0's
    return [(procs[0].returncode, first), (procs[1].returncode, last)]


def test_torchrun_on_two_machines_with_a_shared_secret_trains_as_on_one(tmp_path: Path, torchrun_two_ranks) -> None:
    """Two torchruns of one rank each, DEADPOOL_SECRET shared: the same state, bit for bit, as one torchrun of
    two ranks; rank 0's run directory holds the whole job's summary."""
    secret = new_secret().hex()
    (code0, out0), (code1, out1) = torchrun_nodes(tmp_path, (secret, secret), TRAIN, *TINY)
    assert (code0, code1) == (0, 0), out0 + out1
    assert "[deadpool] no launcher: running under torchrun as 2 ranks without spares" in out0
    summary, one_machine = summary_in(tmp_path / "node0"), torchrun_two_ranks[1]
    assert (summary["exit_code"], summary["final_step"], summary["swaps"]) == (0, 3, 0)
    assert summary["rank_state_sha256"] == one_machine["rank_state_sha256"]
    assert summary["final_state_sha256"] == one_machine["final_state_sha256"]
    assert not (tmp_path / "node1" / "deadpool-runs").exists()  # node 1's rank joined rank 0's run


def test_torchrun_on_two_machines_with_different_secrets_is_refused_saying_why(tmp_path: Path) -> None:
    """Rank 1 is refused by rank 0's control plane and says so; rank 0 logs the refusal (left alone, it would wait
    --connect-timeout, 60 s, for rank 1 to join). No secret at all: tests/unit/runtime/test_standalone.py."""
    (code0, out0), (code1, out1) = torchrun_nodes(tmp_path, (new_secret().hex(), new_secret().hex()), TRAIN, *TINY,
                                                  kill_rank_0=True)
    assert code1 != 0
    assert re.search(r"ConfigError: rank 0's control plane at 127\.0\.0\.1:\d+ refused rank 1 \(the coordinator "
                     r"refused this process's secret \(a secret of another job\?\)\): every rank must have the same "
                     f"{ENV_SECRET}", out1), out1
    assert "refused a connection to the control plane from 127.0.0.1:" in out0, out0
