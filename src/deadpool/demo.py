"""`deadpool demo`: train the example GPT, kill or hang workers mid-step, then rerun without the failure and compare."""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace

from deadpool.config import Fault
from deadpool.errors import ConfigError
from deadpool.launcher.launch import launch
from deadpool.launcher.options import EXAMPLE, default_out, job_config

PHASES = ("detect", "decide", "report", "restore", "rebuild")


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def _print_recoveries(summary: dict) -> None:
    for r in summary["recoveries"]:
        phases = ", ".join(f"{name} {r[name + '_s']:.2f} s" for name in PHASES if r.get(name + "_s") is not None)
        takers = ", ".join(f"{s} took rank {k}" for k, s in r["replaced"].items())
        print(f"recovery in generation {r['generation']}: {r['cause']}; {takers}\n"
              f"  restored step {r['restored_step']}, replayed {r['steps_replayed']} finished step(s); "
              f"{r['fault']} -> next step {r['fault_to_next_step_s']:.2f} s, back at step {r['kill_step']} after "
              f"{r['fault_to_frontier_s']:.2f} s\n  phases: {phases}", flush=True)


def _faults(args: argparse.Namespace, workers: int, spares: int, nproc: int) -> tuple[list[Fault], str]:
    """The demo's fault(s), and how to say what they do."""
    if args.fail == "node":
        if not nproc:
            raise ConfigError("--fail node needs nodes: add --nnodes M --nproc-per-node R --spare-nodes 1")
        nodes = workers // nproc
        node = args.fail_node if args.fail_node is not None else random.randrange(nodes)
        if not 0 <= node < nodes:
            raise ConfigError(f"--fail-node must be a worker node, 0..{nodes - 1}, got {node}")
        if spares < nproc:
            raise ConfigError("failing a whole node needs a spare node: add --spare-nodes 1")
        ranks = list(range(node * nproc, (node + 1) * nproc))
        return ([Fault(kind="kill_node", rank=ranks[0], step=args.fail_at, phase="backward")],
                f"node {node} (its agent and ranks {', '.join(map(str, ranks))}) SIGKILLed at once")
    ranks = args.fail_rank if args.fail_rank is not None else [random.randrange(workers)]
    if len(ranks) > spares:
        raise ConfigError(f"failing {len(ranks)} worker(s) at once needs as many spares, got {spares}")
    how = "SIGKILLed" if args.fail == "kill" else "stopped with SIGSTOP (a hang)"
    return ([Fault(kind=args.fail, rank=rank, step=args.fail_at, phase="backward") for rank in ranks],
            f"rank(s) {', '.join(map(str, ranks))} {how}")


def compared(faulty: dict, reference: dict) -> dict:
    """The run with a failure's summary, judged against the reference: bitwise_equal only if the final
    states' hashes and every logged loss are the same."""
    same_state = faulty["final_state_sha256"] == reference["final_state_sha256"]
    same_losses = faulty["losses"] == reference["losses"]
    return {**faulty, "reference_final_loss": reference["final_loss"],
            "reference_state_sha256": reference["final_state_sha256"],
            "loss_sequence_equal": same_losses, "bitwise_equal": same_state and same_losses}


def demo(args: argparse.Namespace) -> int:
    if not 1 <= args.fail_at <= args.steps:
        raise ConfigError(f"--fail-at must be a step between 1 and --steps ({args.steps}), got {args.fail_at}")
    out = args.out or default_out("demo")
    script_args = ["--steps", str(args.steps), "--log-every", "5", "--parallel", args.parallel]
    shape = job_config(args, str(EXAMPLE), script_args, out)  # workers, spares and nodes, as the job will run
    faults, what = _faults(args, shape.workers, shape.spares, shape.nproc_per_node)
    where = (f"{shape.workers // shape.nproc_per_node} nodes x {shape.nproc_per_node} workers + "
             f"{shape.spares // shape.nproc_per_node} spare node(s)" if shape.nproc_per_node
             else f"{shape.workers} workers + {shape.spares} spare(s)")
    _banner(f"training on {where} ({args.parallel}); {what} in the backward pass of step {args.fail_at}")
    code, faulty = launch(replace(shape, faults=tuple(faults)))
    if code != 0:
        print(f"the run with a failure did not finish: {faulty['error']}", file=sys.stderr)
        return code
    _banner("what the recovery cost")
    _print_recoveries(faulty)

    _banner("the same job without the failure, for comparison")
    code, reference = launch(replace(shape, run_dir=str(out / "reference"), faults=()))
    if code != 0:
        print(f"the reference run failed: {reference['error']}", file=sys.stderr)
        return code

    summary = compared(faulty, reference)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _banner("result")
    print(f"final loss {faulty['final_loss']!r} (reference {reference['final_loss']!r})\n"
          f"final state sha256 {faulty['final_state_sha256'][:16]}... (reference "
          f"{reference['final_state_sha256'][:16]}...)\nbitwise_equal: {str(summary['bitwise_equal']).lower()}\n"
          f"summary: {out / 'summary.json'}   events: {out / 'events.jsonl'}", flush=True)
    return 0 if summary["bitwise_equal"] else 1
