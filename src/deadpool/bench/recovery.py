"""`deadpool bench recovery`: the same job, the same worker SIGKILLed at the same step, recovered by
DeadPool's hot swap and by torchrun + DCP restart; then DeadPool's recovery against world and state size."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from deadpool.bench.baselines.run_torchrun import run_torchrun_dcp
from deadpool.bench.plots import plot_recovery, timeline
from deadpool.config import Fault, JobConfig
from deadpool.demo import EXAMPLE
from deadpool.launcher.cli import default_out
from deadpool.launcher.launch import launch


def last_losses(events: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """rank -> step -> loss of the step's last execution."""
    losses: dict[int, dict[int, float]] = {}
    for e in events:
        if e["event"] == "step":
            losses.setdefault(e["rank"], {})[e["step"]] = e["loss"]
    return losses


def final_hashes(events: list[dict[str, Any]]) -> dict[int, str]:
    return {e["rank"]: e["state_sha256"] for e in events if e["event"] == "finished"}


def recovery_row(system: str, rep: int, events: list[dict[str, Any]], reference: list[dict[str, Any]],
                 samples_per_step: int) -> dict[str, Any]:
    """One run's recovery, from its events alone, so every system is measured the same way.

    steps_lost counts finished steps whose work was thrown away and redone (the step in flight at
    the kill is lost by every system and not counted); bitwise_equal compares every rank's final
    state and every step's loss with the same system's failure-free run.
    """
    kill = next(e for e in events if e["event"] == "fault_injected" and e["kind"] == "kill")
    completed_before = max((e["step"] for e in events if e["event"] == "step" and e["t"] < kill["t"]), default=0)
    after = [e for e in events if e["event"] == "step" and e["t"] > kill["t"]]
    next_step = min(after, key=lambda e: e["t"])
    frontier = min((e for e in after if e["step"] >= kill["step"]), key=lambda e: e["t"])
    resumed_from = min(e["step"] for e in after) - 1
    steps_lost = max(0, completed_before - resumed_from)
    return {"system": system, "rep": rep, "kill_step": kill["step"], "resumed_from": resumed_from,
            "kill_to_next_step_s": next_step["t"] - kill["t"], "kill_to_frontier_s": frontier["t"] - kill["t"],
            "steps_lost": steps_lost, "samples_lost": steps_lost * samples_per_step,
            "bitwise_equal": final_hashes(events) == final_hashes(reference)
            and last_losses(events) == last_losses(reference)}


def _deadpool(run_dir: Path, workers: int, steps: int, kill: tuple[int, int] | None,
              script_args: tuple[str, ...]) -> list[dict[str, Any]]:
    faults = (Fault(kind="kill", rank=kill[0], step=kill[1], phase="backward"),) if kill else ()
    config = JobConfig(script=str(EXAMPLE), script_args=("--steps", str(steps), "--log-every", "1000", *script_args),
                       workers=workers, spares=1, run_dir=str(run_dir), faults=faults)
    code, summary = launch(config, echo=None)
    if code != 0:
        raise RuntimeError(f"DeadPool run {run_dir} failed: {summary['error']}")
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def _torchrun(run_dir: Path, workers: int, steps: int, kill: tuple[int, int] | None, ckpt_every: int,
              script_args: tuple[str, ...]) -> list[dict[str, Any]]:
    code, events = run_torchrun_dcp(run_dir, workers=workers, steps=steps, ckpt_every=ckpt_every, kill=kill,
                                    script_args=script_args)
    if code != 0:
        raise RuntimeError(f"torchrun run {run_dir} failed with exit code {code}; see {run_dir}/torchrun.log")
    return events


def compare(out: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """DeadPool vs torchrun + DCP, `args.reps` times each, interleaved; rows and the first rep's timelines."""
    kill = (args.kill_rank, args.kill_step)
    samples = args.workers * 8  # the example's default batch per rank
    ref_dp = _deadpool(out / "deadpool-reference", args.workers, args.steps, None, ())
    ref_tr = _torchrun(out / "torchrun-reference", args.workers, args.steps, None, args.ckpt_every, ())
    rows, timelines = [], {}
    torchrun = f"torchrun+dcp(every {args.ckpt_every})"
    for rep in range(args.reps):
        for system, events, reference in (
                ("deadpool", _deadpool(out / f"deadpool-{rep}", args.workers, args.steps, kill, ()), ref_dp),
                (torchrun, _torchrun(out / f"torchrun-{rep}", args.workers, args.steps, kill, args.ckpt_every, ()),
                 ref_tr)):
            rows.append(recovery_row(system, rep, events, reference, samples))
            timelines.setdefault(system, timeline(events))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{r['system']} {r['kill_to_next_step_s']:.2f} s"
                                                        for r in rows[-2:]), flush=True)
    return rows, timelines


def scaling(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """DeadPool alone: recovery against world size (small model) and against state size (4 ranks)."""
    rows = []
    small = ("--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--batch-size", "4")
    cases = [("world", w, w, small) for w in (2, 4, 8)] + \
            [("state", e, 4, ("--n-embd", str(e))) for e in (128, 256, 512)]
    for axis, value, workers, script_args in cases:
        steps, kill = 16, (1, 12)
        reference = _deadpool(out / f"scale-{axis}-{value}-reference", workers, steps, None, script_args)
        events = _deadpool(out / f"scale-{axis}-{value}", workers, steps, kill, script_args)
        row = recovery_row("deadpool", 0, events, reference, 0)
        snapshot = max(e["bytes"] for e in events if e["event"] == "snapshot")  # step 0 has no optimizer state
        rows.append({**row, "axis": axis, "value": value, "workers": workers, "snapshot_bytes": snapshot})
        print(f"{axis} {value}: {workers} ranks, snapshot {snapshot / 1e6:.1f} MB/rank, kill -> next step "
              f"{row['kill_to_next_step_s']:.2f} s, bitwise_equal {row['bitwise_equal']}", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'system':>24} {'kill->next step':>26} {'kill->back at kill step':>26} {'steps lost':>10} {'bitwise':>8}"]
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]

        def stat(key: str) -> str:
            values = [r[key] for r in mine]
            return f"{statistics.median(values):.2f} s ({min(values):.2f}..{max(values):.2f})"

        lost = sorted({r["steps_lost"] for r in mine})
        lines.append(f"{system:>24} {stat('kill_to_next_step_s'):>26} {stat('kill_to_frontier_s'):>26} "
                     f"{'/'.join(map(str, lost)):>10} {str(all(r['bitwise_equal'] for r in mine)):>8}")
    return "\n".join(lines)


def bench_recovery(args: argparse.Namespace) -> int:
    out = args.out or default_out("bench-recovery")
    out.mkdir(parents=True, exist_ok=True)
    rows, timelines = compare(out, args)
    scale = [] if args.no_scaling else scaling(out, args)
    (out / "recovery.json").write_text(json.dumps(rows + scale, indent=2))
    print(f"\n{args.workers} workers, {args.steps} steps, rank {args.kill_rank} SIGKILLed in step {args.kill_step}, "
          f"{args.reps} repetitions (median, min..max)\n{table(rows)}")
    for path in plot_recovery(out, rows, scale, timelines):
        print(f"plot: {path}")
    print(f"written: {out / 'recovery.json'}")
    return 0
