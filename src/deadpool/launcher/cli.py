"""`deadpool run | coordinator | agent | demo | chaos | bench | simulate`: the parser, and which command runs."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from deadpool.chaos.scenarios import NAMES as chaos_names
from deadpool.errors import ConfigError
from deadpool.launcher.options import add_job_options, default_out, job_config
from deadpool.launcher.resume import resume_command
from deadpool.sim import cli as sim_cli


def ranks_list(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a rank or ranks separated by commas (e.g. 0,2), got {text!r}")
    return list(dict.fromkeys(int(p) for p in parts))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deadpool", description="Fault-tolerant distributed PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a training script on workers and spares")
    add_job_options(run, workers=2, spares=0)
    run.add_argument("--out", type=Path, default=None, help="run directory (events.jsonl, summary.json, logs)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)

    coordinator = sub.add_parser("coordinator", help="run a job's coordinator alone; node agents join it")
    add_job_options(coordinator, workers=1, spares=0)
    coordinator.add_argument("--out", type=Path, default=None, help="run directory (events.jsonl, summary.json)")
    coordinator.add_argument("script")
    coordinator.add_argument("script_args", nargs=argparse.REMAINDER)

    agent = sub.add_parser("agent", help="the agent of one node: runs its processes for a coordinator")
    agent.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                       help="the coordinator's store (its --master-addr and --master-port)")
    which = agent.add_mutually_exclusive_group(required=True)
    which.add_argument("--node-rank", type=int, help="this node's number: 0, 1, ... (torchrun's)")
    which.add_argument("--spare", action="store_true",
                       help="join the running job as a new spare node (the coordinator numbers it); its spares "
                            "refill the pool")
    agent.add_argument("--out", type=Path, default=None, help="run directory on this node (default: the job's)")
    agent.add_argument("--connect-timeout", type=float, default=60.0, help="s to wait for the coordinator")
    agent.add_argument("--secret-file", type=Path, default=None,
                       help="the job's secret (RUN_DIR/secret on the coordinator's machine, copied with mode 600); "
                            "default: the DEADPOOL_SECRET variable")

    demo = sub.add_parser("demo", help="train the example GPT, kill a worker mid-step, compare with a clean run")
    add_job_options(demo)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--fail", choices=("kill", "hang", "node"), default="kill",
                      help="kill: SIGKILL; hang: SIGSTOP (the hang detector must find and fence it); node: SIGKILL "
                           "a whole node, its agent and every rank on it (needs --nnodes and --spare-nodes)")
    demo.add_argument("--fail-node", type=int, default=None, help="--fail node: which worker node (default: random)")
    demo.add_argument("--fail-at", type=int, default=20, help="step in whose backward pass the fault strikes")
    demo.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                      help="the example's parallelism: ddp (replicated) or fsdp (FSDP2: each rank holds a shard)")
    demo.add_argument("--fail-rank", type=ranks_list, default=None,
                      help="worker(s) to fail at the same point, e.g. 2 or 0,2 (default: a random one)")
    demo.add_argument("--out", type=Path, default=None)

    chaos = sub.add_parser("chaos", help="run a matrix of fault scenarios on the example, each against a "
                                         "failure-free run; exit 1 if any ends neither bit for bit nor documented")
    chaos.add_argument("--out", type=Path, default=None,
                       help="where chaos.md, chaos.json and every run go (default: runs/chaos-DATE-TIME)")
    chaos.add_argument("--seed", type=int, default=None,
                       help="draws each scenario's step, phase and ranks (default: a random one, printed)")
    chaos.add_argument("--scenarios", default="all",
                       help="all, or names separated by commas, each NAME or NAME@SEED (one scenario's own seed, "
                            f"as chaos.md shows it): {', '.join(chaos_names)}")
    chaos.add_argument("--steps", type=int, default=12, help="steps of every job")
    chaos.add_argument("--deadline", type=float, default=150.0,
                       help="s each job may take; past it the job and all it started are killed, the scenario FAILED")

    status = sub.add_parser("status", help="where a job stands: generation, ranks, spares, commits, recoveries")
    status.add_argument("run_dir", type=Path, help="the job's run directory (--out)")
    status.add_argument("--json", action="store_true", help="the status record as JSON")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    overhead = bench_sub.add_parser("overhead", help="step time: DeadPool snapshots vs DCP checkpoints, by size, ranks")
    overhead.add_argument("--sizes", default="1M,10M,50M", help="model presets: 1M, 3M (the example), 10M, 50M")
    overhead.add_argument("--ranks", "--workers", default="2,4", help="numbers of ranks, e.g. 2,4")
    overhead.add_argument("--variants",
                          default="deadpool-off,deadpool-every-1,deadpool-auto,dcp-off,dcp-sync,dcp-async",
                          help="a subset of these (each variant's baseline runs too)")
    overhead.add_argument("--spares", type=int, default=1, help="DeadPool's spares (they hold the replicas)")
    overhead.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                          help="DeadPool's variants: the example data-parallel or sharded (the DCP variants stay DDP)")
    overhead.add_argument("--ckpt-every", type=int, default=5, help="DCP variants: a checkpoint every K steps")
    overhead.add_argument("--steps", type=int, default=None,
                          help="steps per run: a warm-up of 2K (at least 10) plus a multiple of K (default: one K)")
    overhead.add_argument("--rounds", type=int, default=1,
                          help="interleaved repetitions of each variant; 1 gives no spread, 3 takes 3x as long")
    overhead.add_argument("--out", type=Path, default=None)
    recovery = bench_sub.add_parser("recovery",
                                    help="hot swap vs torchrun + DCP restart vs torchft, and recovery vs scale")
    recovery.add_argument("--workers", type=int, default=4)
    recovery.add_argument("--steps", type=int, default=30)
    recovery.add_argument("--kill-rank", type=int, default=1)
    recovery.add_argument("--kill-step", type=int, default=25,
                          help="step in whose backward pass the rank is SIGKILLed or SIGSTOPped")
    recovery.add_argument("--ckpt-every", type=int, default=20, help="torchrun baseline: DCP checkpoint interval")
    recovery.add_argument("--reps", type=int, default=3)
    recovery.add_argument("--no-scaling", action="store_true", help="skip recovery vs world size and state size")
    recovery.add_argument("--no-torchft", action="store_true", help="skip torchft (skipped anyway if not installed)")
    recovery.add_argument("--compile", action="store_true",
                          help="DeadPool with and without torch.compile (the spare compiles while it waits), "
                               "instead of the baselines; use a kill step late enough for the spare to be warm")
    recovery.add_argument("--torchft-timeout", type=float, default=5.0,
                          help="torchft's heartbeat and gloo timeouts in s (its defaults: 5); lower recovers sooner")
    recovery.add_argument("--faults", default="kill,hang",
                          help="comma-separated faults to inject: kill (SIGKILL), hang (SIGSTOP), node (a whole node "
                               "of 2 ranks SIGKILLed; DeadPool only); default kill,hang")
    recovery.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                          help="DeadPool's runs: the example data-parallel or sharded (the baselines stay DDP)")
    recovery.add_argument("--netns", action="store_true", help="node fault: each node in a network namespace (root)")
    recovery.add_argument("--hang-wait", type=float, default=120.0,
                          help="s a system gets from the fault to its next step; past it the run counts as not "
                               "recovered and all its processes are killed")
    recovery.add_argument("--out", type=Path, default=None)
    sim_cli.add_parser(sub)
    _show_defaults(parser)
    return parser


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, unless the help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's --help shows every option's default, subcommands included."""
    parser.formatter_class = _WithDefaults
    for action in parser._actions:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action.help = "default: %(default)s"  # argparse prints no line at all for an option without help
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for command in getattr(action, "choices", {}).values():
            _show_defaults(command)


def _terminated(signum: int, _frame: object) -> None:
    """SIGTERM (a scheduler cancelling the job, `kill`): unwinds like Ctrl-C, so the launcher fences its
    processes and removes its network namespaces on the way out."""
    raise SystemExit(128 + signum)


def _how_to_go_on(persist_dir: str, summary: dict, argv: list[str] | None) -> None:
    """A job that stopped after persisting its newest commit (SIGTERM, no spare left): the command that goes on."""
    if persist_dir and summary["stopped_by"]:
        print(f"[deadpool] to go on: {resume_command(argv if argv is not None else sys.argv[1:])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        if args.command == "run":
            from deadpool.launcher.launch import launch

            out = args.out or default_out("run")
            config = job_config(args, args.script, args.script_args, out)
            code, summary = launch(config)
            print(f"[deadpool] run directory: {out}", flush=True)
            _how_to_go_on(config.persist_dir, summary, argv)
            return code
        if args.command == "coordinator":
            from deadpool.launcher.launch import launch

            config = job_config(args, args.script, args.script_args, args.out or default_out("run"))
            if not config.nproc_per_node:
                raise ConfigError("deadpool coordinator runs nodes: give --nnodes (and --nproc-per-node)")
            code, summary = launch(config, start_agents=False)
            _how_to_go_on(config.persist_dir, summary, argv)
            return code
        if args.command == "agent":
            from deadpool.launcher.node import agent_main

            return agent_main(args.coordinator, None if args.spare else args.node_rank, args.out, args.connect_timeout,
                              args.secret_file)
        if args.command == "status":
            from deadpool.launcher.status import status_main

            return status_main(args.run_dir, args.json)
        if args.command == "simulate":
            return sim_cli.main(args)
        if args.command == "chaos":
            from deadpool.chaos.runner import chaos

            return chaos(args)
        if args.command == "demo":
            from deadpool.demo import demo

            return demo(args)
        if args.bench == "recovery":
            from deadpool.bench.recovery import bench_recovery

            return bench_recovery(args)
        from deadpool.bench.overhead import bench_overhead

        return bench_overhead(args)
    except ConfigError as error:
        print(f"deadpool: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
