"""Tests for deadpool/launcher/cli.py and options.py: argument parsing and building the JobConfig of `deadpool run`."""

import argparse
import re
from pathlib import Path

import pytest

from deadpool.config import Fault, JobConfig
from deadpool.errors import ConfigError
from deadpool.launcher.cli import build_parser, ranks_list
from deadpool.launcher.options import job_config, parse_faults, snapshot_every

# ---- parse_faults ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, faults", [
    ("kill:2:15:backward", [Fault(kind="kill", rank=2, step=15, phase="backward")]),
    ("kill:0:1:snapshot_copy", [Fault(kind="kill", rank=0, step=1, phase="snapshot_copy")]),
    ("kill:3:7", [Fault(kind="kill", rank=3, step=7, phase="backward")]),
    ("corrupt_replica:1:10", [Fault(kind="corrupt_replica", rank=1, step=10)]),
    ("hang:1:9:forward", [Fault(kind="hang", rank=1, step=9, phase="forward")]),
    ("error:1:20", [Fault(kind="error", rank=1, step=20)]),
    ("kill:0+2:5", [Fault(kind="kill", rank=0, step=5), Fault(kind="kill", rank=2, step=5)]),
    ("kill:2+2:5", [Fault(kind="kill", rank=2, step=5)]),
    ("kill:1:0:init", [Fault(kind="kill", rank=1, step=0, phase="init")]),
])
def test_parse_faults(text, faults):
    assert parse_faults(text) == faults


FORMAT = ("expected KIND:RANK[+RANK...]:STEP[:PHASE], e.g. kill:2:15:backward or kill:0+2:15 "
          "(phases: step_start, forward, backward, after_optimizer, snapshot_copy, replicate, recovery, init, setup, "
          "handover, handover_data)")


@pytest.mark.parametrize("text, message", [
    ("kill:2", f"--fault 'kill:2': {FORMAT}"),
    ("kill", f"--fault 'kill': {FORMAT}"),
    ("kill:1:2:backward:x", f"--fault 'kill:1:2:backward:x': {FORMAT}"),
    ("kill:a:3", f"--fault 'kill:a:3': {FORMAT}"),
    ("kill:1:three", f"--fault 'kill:1:three': {FORMAT}"),
    ("kill:-1:3", f"--fault 'kill:-1:3': {FORMAT}"),
    ("kill:0+:3", f"--fault 'kill:0+:3': {FORMAT}"),
    ("explode:1:2", "fault kind 'explode' is not one of ('kill', 'kill_node', 'hang', 'error', 'corrupt_replica')"),
    ("kill:1:0", "fault needs rank >= 0 and step >= 1, got rank=1 step=0"),
    ("kill:1:2:sideways", "fault phase 'sideways' is not one of ('step_start', 'forward', 'backward', "
                          "'after_optimizer', 'snapshot_copy', 'replicate', 'recovery', 'init', 'setup', "
                          "'handover', 'handover_data')"),
])
def test_parse_faults_rejects(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(message)}$"):
        parse_faults(text)


def test_ranks_list():
    assert ranks_list("0,2") == [0, 2] and ranks_list("3") == [3] and ranks_list("1,1") == [1]
    with pytest.raises(argparse.ArgumentTypeError, match="expected a rank or ranks separated by commas"):
        ranks_list("0;2")


# ---- snapshot_every -------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("auto", "auto"), ("0", 0), ("1", 1), ("25", 25)])
def test_snapshot_every(text, value):
    assert snapshot_every(text) == value


@pytest.mark.parametrize("text", ["-1", "1.5", "", "Auto", "never"])
def test_snapshot_every_rejects(text):
    message = f"--snapshot-every must be a number of steps (0 = off) or 'auto', got {text!r}"
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{re.escape(message)}$"):
        snapshot_every(text)


# ---- `deadpool run` -> JobConfig ------------------------------------------------------------

def test_run_defaults():
    args = build_parser().parse_args(["run", "train.py"])
    config = job_config(args, args.script, args.script_args, Path("/tmp/out"))
    assert config == JobConfig(script="train.py", script_args=(), workers=2, spares=0, run_dir="/tmp/out",
                               store_host="127.0.0.1", store_port=0, backend="auto", snapshot_every=1,
                               snapshot_budget=0.01, backlog_policy="wait", settle_s=0.05, hang_timeout_s=None,
                               recovery_timeout_s=30.0, collective_timeout_s=60.0, faults=())
    assert args.command == "run" and args.out is None
    # the defaults the README states, as literals (the comparison above takes the rest from JobConfig itself)
    assert (config.seed, config.slices, config.on_divergence, config.deterministic, config.silence_timeout_s,
            config.persist_every, config.keep, config.stop_grace_s, config.node_timeout_s,
            config.replicas) == (0, True, "stop", True, 1.5, 10, 2, 20.0, 5.0, 1)


def test_run_with_every_option():
    args = build_parser().parse_args([
        "run", "--nproc-per-node", "4", "--spares", "2", "--snapshot-every", "auto", "--snapshot-budget", "0.05",
        "--backlog-policy", "skip", "--backend", "gloo", "--master-addr", "10.0.0.1", "--master-port", "29500",
        "--recovery-timeout", "20", "--collective-timeout", "40",
        "--settle-window", "0.2", "--hang-timeout", "6", "--silence-timeout", "1.5", "--slices", "off",
        "--on-divergence", "warn", "--seed", "7", "--persist-dir", "ckpt", "--persist-every", "5",
        "--persist-interval", "600", "--keep", "3", "--stop-grace", "12", "--resume", "auto",
        "--fault", "kill:3:15:forward", "--fault", "corrupt_replica:1:10", "--fault", "hang:0+1:4", "--out", "runs/x",
        "train.py", "--steps", "40", "--lr", "0.1"])
    assert args.out == Path("runs/x")
    config = job_config(args, args.script, args.script_args, args.out)
    assert config == JobConfig(
        script="train.py", script_args=("--steps", "40", "--lr", "0.1"), workers=4, spares=2, run_dir="runs/x",
        store_host="10.0.0.1", store_port=29500, backend="gloo", snapshot_every="auto", snapshot_budget=0.05,
        backlog_policy="skip", settle_s=0.2, hang_timeout_s=6.0, silence_timeout_s=1.5, recovery_timeout_s=20.0,
        collective_timeout_s=40.0, slices=False, on_divergence="warn", seed=7, persist_dir="ckpt", persist_every=5,
        persist_interval_s=600.0, keep=3, stop_grace_s=12.0, resume="auto",
        faults=(Fault(kind="kill", rank=3, step=15, phase="forward"), Fault(kind="corrupt_replica", rank=1, step=10),
                Fault(kind="hang", rank=0, step=4), Fault(kind="hang", rank=1, step=4)))
    assert type(config.script_args) is tuple and type(config.faults) is tuple


def test_job_config_overrides_and_explicit_faults():
    args = build_parser().parse_args(["run", "--fault", "kill:1:3", "train.py"])
    fault = Fault(kind="kill", rank=0, step=2)
    config = job_config(args, "other.py", ["a"], Path("out"), faults=[fault], token="abc", spares=1)
    assert (config.script, config.script_args, config.run_dir) == ("other.py", ("a",), "out")
    assert config.faults == (fault,) and config.token == "abc" and config.spares == 1


def test_job_config_validates_fault_rank_against_workers():
    args = build_parser().parse_args(["run", "--workers", "2", "--fault", "kill:2:5", "train.py"])
    with pytest.raises(ConfigError, match=r"^fault targets rank 2 but the job has ranks 0\.\.1$"):
        job_config(args, args.script, args.script_args, Path("out"))


def test_job_config_validates_timeout_order():
    args = build_parser().parse_args(["run", "--recovery-timeout", "60", "train.py"])
    with pytest.raises(ConfigError, match=r"^timeouts must satisfy 0 < recovery-timeout < collective-timeout"):
        job_config(args, args.script, args.script_args, Path("out"))


@pytest.mark.parametrize("argv, complaint", [
    (["run", "--fault", "kill:9", "train.py"],
     "argument --fault: --fault 'kill:9': expected KIND:RANK[+RANK...]:STEP[:PHASE]"),
    (["run", "--fault", "nap:0:1", "train.py"], "argument --fault: fault kind 'nap' is not one of"),
    (["run", "--snapshot-every", "often", "train.py"], "argument --snapshot-every: --snapshot-every must be"),
    (["run", "--backend", "mpi", "train.py"], "argument --backend: invalid choice: 'mpi'"),
    (["run"], "the following arguments are required: script"),
])
def test_parser_rejects_bad_arguments(argv, complaint, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_nodes_take_torchruns_flags():
    args = build_parser().parse_args(["run", "--nnodes", "3", "--nproc-per-node", "2", "--spare-nodes", "1",
                                      "--rdzv-endpoint", "head:29400", "--node-timeout", "7", "train.py"])
    config = job_config(args, args.script, args.script_args, Path("out"))
    assert (config.workers, config.spares, config.nproc_per_node, config.nodes) == (6, 2, 2, 4)
    assert (config.store_host, config.store_port, config.node_timeout_s) == ("head", 29400, 7.0)
    single = job_config(build_parser().parse_args(["run", "--nproc-per-node", "2", "train.py"]), "t.py", [], Path("o"))
    assert (single.workers, single.nproc_per_node, single.nodes) == (2, 0, 0)  # no --nnodes: one machine, no agents


@pytest.mark.parametrize("argv, complaint", [
    (["run", "--rdzv-endpoint", "head", "train.py"], "--rdzv-endpoint must be HOST:PORT, got 'head'"),
    (["run", "--nnodes", "0", "train.py"], "--nnodes must be at least 1"),
    (["run", "--fault", "kill_node:0:3", "train.py"], "a kill_node fault needs nodes: run with --nnodes"),
])
def test_bad_node_options_are_refused_with_a_reason(argv, complaint):
    with pytest.raises(ConfigError, match=re.escape(complaint)):
        job_config(build_parser().parse_args(argv), "train.py", [], Path("out"))


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for command in action.choices.values():
            found += _commands(command)
    return found


def test_every_option_of_every_command_shows_its_default_in_help():
    parsers = _commands(build_parser())
    assert len(parsers) >= 8  # deadpool, run, coordinator, agent, demo, bench, its two, simulate
    for parser in parsers:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and action.default is not argparse.SUPPRESS:
                assert action.help and "default" in formatter._get_help_string(action), (parser.prog,
                                                                                         action.option_strings)
