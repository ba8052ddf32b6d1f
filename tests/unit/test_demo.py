"""Tests for deadpool/demo.py's verdict: the demo exits 1 unless the run with a failure ends bit for bit as the
reference (the whole demo runs from an installed wheel in tests/integration/test_install.py); the faults each
--fail asks for, and the refusals of those a job could not recover from."""

import re
from pathlib import Path

import pytest

from deadpool.config import Fault
from deadpool.demo import _faults, compared
from deadpool.errors import ConfigError
from deadpool.launcher.cli import build_parser
from deadpool.launcher.options import job_config

FAULTY = {"final_state_sha256": "ab", "losses": {"0": [2.5, 2.25]}, "final_loss": 2.25, "swaps": 1}


def test_equal_states_and_losses_are_bitwise_equal_and_keep_the_runs_summary():
    summary = compared(FAULTY, {**FAULTY, "swaps": 0})
    assert summary == {**FAULTY, "reference_final_loss": 2.25, "reference_state_sha256": "ab",
                       "loss_sequence_equal": True, "bitwise_equal": True}


def test_another_final_state_is_not_bitwise_equal_even_with_the_same_losses():
    summary = compared(FAULTY, {**FAULTY, "final_state_sha256": "cd"})
    assert (summary["loss_sequence_equal"], summary["bitwise_equal"]) == (True, False)


def test_one_loss_apart_in_its_last_bit_is_not_bitwise_equal():
    reference = {**FAULTY, "losses": {"0": [2.5, 2.2500000000000004]}}
    summary = compared(FAULTY, reference)
    assert (summary["loss_sequence_equal"], summary["bitwise_equal"]) == (False, False)


def _faults_of(argv: list[str]) -> tuple[list[Fault], str]:
    args = build_parser().parse_args(["demo", *argv])
    shape = job_config(args, "train.py", [], Path("out"))
    return _faults(args, shape.workers, shape.spares, shape.nproc_per_node)


def test_the_demos_failures_are_the_faults_the_readme_names():
    """--fail kill (the default) SIGKILLs, hang SIGSTOPs, and --fail-rank 0,2 fails two workers at once, each in
    the backward pass of --fail-at; --fail node SIGKILLs a whole node, its ranks named."""
    assert _faults_of(["--workers", "4", "--spares", "1", "--fail-rank", "2", "--fail-at", "7"]) == (
        [Fault(kind="kill", rank=2, step=7, phase="backward")], "rank(s) 2 SIGKILLed")
    assert _faults_of(["--workers", "4", "--spares", "2", "--fail", "hang", "--fail-rank", "0,2"]) == (
        [Fault(kind="hang", rank=0, step=20, phase="backward"), Fault(kind="hang", rank=2, step=20, phase="backward")],
        "rank(s) 0, 2 stopped with SIGSTOP (a hang)")
    assert _faults_of(["--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "--fail", "node",
                       "--fail-node", "1"]) == (
        [Fault(kind="kill_node", rank=2, step=20, phase="backward")],
        "node 1 (its agent and ranks 2, 3) SIGKILLed at once")


@pytest.mark.parametrize("argv, message", [
    (["--spares", "1", "--fail-rank", "0,1"], "failing 2 worker(s) at once needs as many spares, got 1"),
    (["--fail", "node"], "--fail node needs nodes: add --nnodes M --nproc-per-node R --spare-nodes 1"),
    (["--nnodes", "2", "--nproc-per-node", "2", "--fail", "node"],
     "failing a whole node needs a spare node: add --spare-nodes 1"),
    (["--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "--fail", "node", "--fail-node", "2"],
     "--fail-node must be a worker node, 0..1, got 2"),
])
def test_a_demo_failure_the_job_cannot_recover_is_refused_saying_what_to_add(argv, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        _faults_of(argv)
