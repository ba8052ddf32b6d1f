"""The job options every command shares (`run`, `demo`, `bench`), and arguments -> one frozen JobConfig.

cli.py builds the parser from these; demo.py and bench/ build their configs with `job_config`. Nothing
here imports them back, so there is no import circle between the commands.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from deadpool.config import FAULT_PHASES, SILENCE_TIMEOUT_S, Fault, JobConfig
from deadpool.errors import ConfigError
from deadpool.examples import GPT_DIR

EXAMPLE = GPT_DIR / "train.py"  # the example trainer, shipped in the package (deadpool/examples)
FAULT_FORMAT = "KIND:RANK[+RANK...]:STEP[:PHASE]"


def parse_faults(text: str) -> list[Fault]:
    """KIND:RANK[+RANK...]:STEP[:PHASE], e.g. kill:2:15:backward, or kill:0+2:15 for two ranks at one point."""
    parts = text.split(":")
    ranks = parts[1].split("+") if len(parts) > 1 else []
    if len(parts) not in (3, 4) or not ranks or not all(r.isdigit() for r in ranks) or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"--fault {text!r}: expected {FAULT_FORMAT}, e.g. kill:2:15:backward or "
                                         f"kill:0+2:15 (phases: {', '.join(FAULT_PHASES)})")
    phase = {"phase": parts[3]} if len(parts) == 4 else {}
    try:
        return [Fault(kind=parts[0], rank=int(rank), step=int(parts[2]), **phase) for rank in dict.fromkeys(ranks)]
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def snapshot_every(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"--snapshot-every must be a number of steps (0 = off) or 'auto', got {text!r}")


def add_job_options(p: argparse.ArgumentParser, workers: int = 4, spares: int = 1) -> None:
    p.add_argument("--workers", "--nproc-per-node", type=int, default=workers,
                   help="ranks (worker processes); with --nnodes, ranks per node")
    p.add_argument("--spares", type=int, default=spares,
                   help="standby processes that can take over a rank (one machine; with nodes see --spare-nodes)")
    p.add_argument("--nnodes", type=int, default=None,
                   help="worker nodes, one agent each (launcher/node.py); every node runs --nproc-per-node ranks")
    p.add_argument("--spare-nodes", type=int, default=0,
                   help="spare nodes of --nproc-per-node spares each: a lost node's ranks move to one of them")
    p.add_argument("--netns", action="store_true",
                   help="run each node in a network namespace of its own, with its own address (root)")
    p.add_argument("--node-timeout", type=float, default=5.0,
                   help="s an agent may stay silent before its node counts as lost (its ranks are replaced)")
    p.add_argument("--spare-wait", type=float, default=0.0,
                   help="s to wait, when a rank fails and no spare is left, for a spare node to join "
                        "(`deadpool agent --coordinator HOST:PORT --spare`) before the job stops (default 0)")
    p.add_argument("--snapshot-every", type=snapshot_every, default=1, help="K steps, 0 = off, or auto")
    p.add_argument("--snapshot-budget", type=float, default=0.01, help="auto: snapshot cost / step time")
    p.add_argument("--replicas", type=int, default=1,
                   help="holders of each rank's snapshots, on other nodes: spares first, then peer workers")
    p.add_argument("--backlog-policy", choices=("wait", "skip"), default="wait",
                   help="when replication falls behind: wait for it, or skip the snapshot")
    p.add_argument("--on-divergence", choices=("stop", "warn"), default="stop",
                   help="when data-parallel replicas stop being bit-identical: stop the job, or warn and go on")
    p.add_argument("--slices", choices=("on", "off"), default="on",
                   help="data parallel: each rank snapshots and replicates only its 1/N slice of the replicated "
                        "state (on, the default), or all of it (off)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds Python's, NumPy's and torch's RNGs (plus the rank) in init(), and PYTHONHASHSEED")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with one GPU per worker when there are GPUs, else gloo on the CPU")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs to use (default: all visible); workers get one each, spares the rest")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="deterministic GPU kernels, so a replayed step gives the same bits (default: on)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address the coordinator's store listens on")
    p.add_argument("--master-port", type=int, default=0, help="port of the coordinator's store (0 = any free)")
    p.add_argument("--secret-file", default="", metavar="PATH",
                   help="the job's secret, shared with agents started by hand (a file of mode 600 with 32+ random "
                        "bytes in hex, e.g. `openssl rand -hex 32`); default: a new one in RUN_DIR/secret")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="torchrun's name for --master-addr and --master-port together")
    p.add_argument("--settle-window", type=float, default=0.05,
                   help="s: failures this close to the first are recovered together, in one new generation")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="s without progress while peers wait before a rank that still beats is fenced (default: "
                        "8 x the slowest median step, at least 3 s)")
    p.add_argument("--silence-timeout", type=float, default=SILENCE_TIMEOUT_S,
                   help=f"s without a heartbeat (SIGSTOP, a frozen machine) before a rank is fenced, whatever the "
                        f"step time (default {SILENCE_TIMEOUT_S:g})")
    p.add_argument("--recovery-timeout", type=float, default=30.0, help="s the coordinator waits for a recovery step")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="s before a collective gives up")
    p.add_argument("--persist-dir", default="", metavar="DIR",
                   help="write committed snapshots to disk here (torch.distributed.checkpoint format), in the "
                        "background, so that `--resume` can go on after the job itself is lost (default: off)")
    p.add_argument("--persist-every", type=int, default=10, metavar="N",
                   help="with --persist-dir: a checkpoint every N commits (0: only by --persist-interval)")
    p.add_argument("--persist-interval", type=float, default=0.0, metavar="S",
                   help="with --persist-dir: a checkpoint every S seconds too (default 0: only every N commits)")
    p.add_argument("--keep", type=int, default=2, metavar="K", help="complete checkpoints kept in --persist-dir")
    p.add_argument("--stop-grace", type=float, default=20.0, metavar="S",
                   help="on SIGTERM (scancel, a pod's eviction): s to persist the newest commit before exiting 143 "
                        "(default 20, under Slurm's and Kubernetes' 30 s)")
    p.add_argument("--resume", default="", metavar="DIR|auto",
                   help="start from the newest complete checkpoint in DIR (a --persist-dir or one checkpoint), or "
                        "in --persist-dir with auto, which starts at step 0 if none was ever written there: one "
                        "command for a job's first run and every requeue (default: start at step 0)")
    p.add_argument("--fault", type=parse_faults, action="extend", default=[], metavar=FAULT_FORMAT,
                   help="inject a real fault (repeatable): kill, hang, error or corrupt_replica")


def job_config(args: argparse.Namespace, script: str, script_args: list[str], run_dir: Path,
               faults: list[Fault] | None = None, **overrides: object) -> JobConfig:
    host, port = args.master_addr, args.master_port
    if args.rdzv_endpoint:
        host, _, text = args.rdzv_endpoint.rpartition(":")
        if not host or not text.isdigit():
            raise ConfigError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
        port = int(text)
    workers, spares, nproc = args.workers, args.spares, 0
    if args.nnodes is not None or args.spare_nodes:  # nodes: --nproc-per-node (alias --workers) ranks on each
        if (args.nnodes is not None and args.nnodes < 1) or args.spare_nodes < 0:
            raise ConfigError(f"--nnodes must be at least 1 and --spare-nodes 0 or more, got {args.nnodes} and "
                              f"{args.spare_nodes}")
        nproc = args.workers
        workers, spares = (args.nnodes or 1) * nproc, args.spare_nodes * nproc
    fields = dict(script=script, script_args=tuple(script_args), workers=workers, spares=spares,
                  nproc_per_node=nproc, node_timeout_s=args.node_timeout, spare_wait_s=args.spare_wait,
                  netns=args.netns,
                  run_dir=str(run_dir), store_host=host, store_port=port, secret_file=args.secret_file,
                  backend=args.backend, gpus_per_node=args.gpus_per_node, deterministic=args.deterministic,
                  snapshot_every=args.snapshot_every, snapshot_budget=args.snapshot_budget,
                  replicas=args.replicas, backlog_policy=args.backlog_policy, on_divergence=args.on_divergence,
                  slices=args.slices == "on", seed=args.seed,
                  settle_s=args.settle_window, hang_timeout_s=args.hang_timeout,
                  silence_timeout_s=args.silence_timeout, persist_dir=args.persist_dir,
                  persist_every=args.persist_every, persist_interval_s=args.persist_interval, keep=args.keep,
                  stop_grace_s=args.stop_grace, resume=args.resume,
                  recovery_timeout_s=args.recovery_timeout,
                  collective_timeout_s=args.collective_timeout, faults=tuple(args.fault if faults is None else faults))
    return JobConfig(**{**fields, **overrides})


def default_out(kind: str) -> Path:
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
