"""`deadpool run | demo | bench overhead`: arguments in, one frozen JobConfig out, exit code back."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from deadpool.config import FAULT_PHASES, Fault, JobConfig
from deadpool.errors import ConfigError
from deadpool.sim import cli as sim_cli


def parse_fault(text: str) -> Fault:
    """KIND:RANK:STEP[:PHASE], e.g. kill:2:15:backward or corrupt_replica:1:10."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[1].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"--fault {text!r}: expected KIND:RANK:STEP[:PHASE], e.g. kill:2:15:backward "
                                         f"(phases: {', '.join(FAULT_PHASES)})")
    try:
        return Fault(kind=parts[0], rank=int(parts[1]), step=int(parts[2]), **({"phase": parts[3]} if len(parts) == 4 else {}))
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def snapshot_every(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"--snapshot-every must be a number of steps (0 = off) or 'auto', got {text!r}")


def add_job_options(p: argparse.ArgumentParser, workers: int = 4, spares: int = 1) -> None:
    p.add_argument("--workers", "--nproc-per-node", type=int, default=workers, help="ranks (worker processes)")
    p.add_argument("--spares", type=int, default=spares, help="standby processes that can take over a rank")
    p.add_argument("--snapshot-every", type=snapshot_every, default=1, help="K steps, 0 = off, or auto")
    p.add_argument("--snapshot-budget", type=float, default=0.01, help="auto: snapshot cost / step time")
    p.add_argument("--backlog-policy", choices=("wait", "skip"), default="wait",
                   help="when replication falls behind: wait for it, or skip the snapshot")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--master-addr", default="127.0.0.1", help="address the coordinator's store listens on")
    p.add_argument("--master-port", type=int, default=0, help="port of the coordinator's store (0 = any free)")
    p.add_argument("--decision-timeout", type=float, default=10.0, help="s a survivor waits for a new plan")
    p.add_argument("--recovery-timeout", type=float, default=30.0, help="s the coordinator waits for a recovery step")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="s before a collective gives up")
    p.add_argument("--fault", type=parse_fault, action="append", default=[], metavar="KIND:RANK:STEP[:PHASE]",
                   help="inject a real fault (repeatable): kill or corrupt_replica")


def job_config(args: argparse.Namespace, script: str, script_args: list[str], run_dir: Path,
               faults: list[Fault] | None = None, **overrides: object) -> JobConfig:
    fields = dict(script=script, script_args=tuple(script_args), workers=args.workers, spares=args.spares,
                  run_dir=str(run_dir), store_host=args.master_addr, store_port=args.master_port,
                  backend=args.backend, snapshot_every=args.snapshot_every, snapshot_budget=args.snapshot_budget,
                  backlog_policy=args.backlog_policy, decision_timeout_s=args.decision_timeout,
                  recovery_timeout_s=args.recovery_timeout, collective_timeout_s=args.collective_timeout,
                  faults=tuple(args.fault if faults is None else faults))
    return JobConfig(**{**fields, **overrides})


def default_out(kind: str) -> Path:
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deadpool", description="Fault-tolerant distributed PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a training script on workers and spares")
    add_job_options(run, workers=2, spares=0)
    run.add_argument("--out", type=Path, default=None, help="run directory (events.jsonl, summary.json, logs)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)

    demo = sub.add_parser("demo", help="train the example GPT, kill a worker mid-step, compare with a clean run")
    add_job_options(demo)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--fail-at", type=int, default=20, help="step in whose backward pass a worker is SIGKILLed")
    demo.add_argument("--fail-rank", type=int, default=None, help="worker to kill (default: a random one)")
    demo.add_argument("--out", type=Path, default=None)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    overhead = bench_sub.add_parser("overhead", help="step time: DeadPool snapshots vs DCP checkpoints, by size, ranks")
    overhead.add_argument("--sizes", default="1M,10M,50M", help="model presets: 1M, 3M (the example), 10M, 50M")
    overhead.add_argument("--ranks", "--workers", default="2,4", help="numbers of ranks, e.g. 2,4")
    overhead.add_argument("--variants",
                          default="deadpool-off,deadpool-every-1,deadpool-auto,dcp-off,dcp-sync,dcp-async",
                          help="a subset of these (each variant's baseline runs too)")
    overhead.add_argument("--spares", type=int, default=1, help="DeadPool's spares (they hold the replicas)")
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
    recovery.add_argument("--kill-step", type=int, default=25, help="step in whose backward pass the rank dies")
    recovery.add_argument("--ckpt-every", type=int, default=20, help="torchrun baseline: DCP checkpoint interval")
    recovery.add_argument("--reps", type=int, default=3)
    recovery.add_argument("--no-scaling", action="store_true", help="skip recovery vs world size and state size")
    recovery.add_argument("--no-torchft", action="store_true", help="skip torchft (skipped anyway if not installed)")
    recovery.add_argument("--torchft-timeout", type=float, default=5.0,
                          help="torchft's heartbeat and gloo timeouts in s (its defaults: 5); lower recovers sooner")
    recovery.add_argument("--out", type=Path, default=None)
    sim_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            from deadpool.launcher.launch import launch

            out = args.out or default_out("run")
            code, _ = launch(job_config(args, args.script, args.script_args, out))
            print(f"[deadpool] run directory: {out}", flush=True)
            return code
        if args.command == "simulate":
            return sim_cli.main(args)
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
