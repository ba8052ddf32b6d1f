"""The job options every command shares (`run`, `demo`, `bench`), and arguments -> one frozen JobConfig.

cli.py builds the parser from these; demo.py and bench/ build their configs with `job_config`. Nothing
here imports them back, so there is no import circle between the commands.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from deadpool.config import FAULT_PHASES, Fault, JobConfig
from deadpool.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt" / "train.py"
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
    p.add_argument("--workers", "--nproc-per-node", type=int, default=workers, help="ranks (worker processes)")
    p.add_argument("--spares", type=int, default=spares, help="standby processes that can take over a rank")
    p.add_argument("--snapshot-every", type=snapshot_every, default=1, help="K steps, 0 = off, or auto")
    p.add_argument("--snapshot-budget", type=float, default=0.01, help="auto: snapshot cost / step time")
    p.add_argument("--backlog-policy", choices=("wait", "skip"), default="wait",
                   help="when replication falls behind: wait for it, or skip the snapshot")
    p.add_argument("--on-divergence", choices=("stop", "warn"), default="stop",
                   help="when data-parallel replicas stop being bit-identical: stop the job, or warn and go on")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds Python's and NumPy's RNGs (plus the rank) in init(), and PYTHONHASHSEED")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with one GPU per worker when there are GPUs, else gloo on the CPU")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs to use (default: all visible); workers get one each, spares the rest")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="deterministic GPU kernels, so a replayed step gives the same bits (default: on)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address the coordinator's store listens on")
    p.add_argument("--master-port", type=int, default=0, help="port of the coordinator's store (0 = any free)")
    p.add_argument("--settle-window", type=float, default=0.05,
                   help="s: failures this close to the first are recovered together, in one new generation")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="s without progress while peers wait before a rank is fenced (default: adapts to the "
                        "step time, at least 3 s)")
    p.add_argument("--decision-timeout", type=float, default=10.0, help="s a survivor waits for a new plan")
    p.add_argument("--recovery-timeout", type=float, default=30.0, help="s the coordinator waits for a recovery step")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="s before a collective gives up")
    p.add_argument("--fault", type=parse_faults, action="extend", default=[], metavar=FAULT_FORMAT,
                   help="inject a real fault (repeatable): kill, hang, error or corrupt_replica")


def job_config(args: argparse.Namespace, script: str, script_args: list[str], run_dir: Path,
               faults: list[Fault] | None = None, **overrides: object) -> JobConfig:
    fields = dict(script=script, script_args=tuple(script_args), workers=args.workers, spares=args.spares,
                  run_dir=str(run_dir), store_host=args.master_addr, store_port=args.master_port,
                  backend=args.backend, gpus_per_node=args.gpus_per_node, deterministic=args.deterministic,
                  snapshot_every=args.snapshot_every, snapshot_budget=args.snapshot_budget,
                  backlog_policy=args.backlog_policy, on_divergence=args.on_divergence, seed=args.seed,
                  settle_s=args.settle_window, hang_timeout_s=args.hang_timeout,
                  decision_timeout_s=args.decision_timeout, recovery_timeout_s=args.recovery_timeout,
                  collective_timeout_s=args.collective_timeout, faults=tuple(args.fault if faults is None else faults))
    return JobConfig(**{**fields, **overrides})


def default_out(kind: str) -> Path:
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
