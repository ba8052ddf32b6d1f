"""`deadpool bench recovery`: the same job, the same worker SIGKILLed at the same step, recovered by
DeadPool's hot swap, by torchrun + DCP restart and (if installed) by torchft, which trains on without the
dead replica until it heals back in; then DeadPool's recovery against world and state size."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from deadpool.bench.baselines.run_torchft import run_torchft, torchft_available
from deadpool.bench.baselines.run_torchrun import run_torchrun_dcp
from deadpool.bench.plots import plot_recovery, timeline
from deadpool.config import Fault, JobConfig
from deadpool.demo import EXAMPLE
from deadpool.launcher.cli import default_out
from deadpool.launcher.launch import launch
from deadpool.report import final_losses


def final_hashes(events: list[dict[str, Any]]) -> dict[int, str]:
    return {e["rank"]: e["state_sha256"] for e in events if e["event"] == "finished"}


def trained_samples(events: list[dict[str, Any]]) -> Counter[int]:
    """The sample ids a run trained on, counted with multiplicity: of each (rank, step), the last
    execution's batch (a replayed step counts once; a discarded torchft attempt is no `step` event).
    DeadPool's example logs them as `batch` events (--log-samples), the baselines in `step` events."""
    last: dict[tuple[int, int], list[int]] = {}
    for e in events:
        if e["event"] in ("step", "batch") and "samples" in e:
            last[(e["rank"], e["step"])] = e["samples"]
    if not last:
        raise ValueError("the events carry no sample ids: run DeadPool's example with --log-samples")
    return Counter(i for ids in last.values() for i in ids)


def recovery_row(system: str, rep: int, events: list[dict[str, Any]],
                 reference: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's recovery, from its events alone, so every system is measured the same way.

    A step is a completed (for torchft: committed) optimizer step. steps_lost counts finished steps
    whose work was thrown away and redone (the step in flight at the kill is lost by every system and
    not counted). samples_lost counts the samples the failure-free run trained on and this run never
    did (by sample id: torchft trains on without the dead replica's share until it heals back in, and
    retries a discarded step on the next batch); samples_unexpected those it trained on that the
    failure-free run did not, or more often. bitwise_equal compares every rank's final state and every
    step's loss with the same system's failure-free run.
    """
    kill = next(e for e in events if e["event"] == "fault_injected" and e["kind"] == "kill")
    completed_before = max((e["step"] for e in events if e["event"] == "step" and e["t"] < kill["t"]), default=0)
    after = [e for e in events if e["event"] == "step" and e["t"] > kill["t"]]
    next_step = min(after, key=lambda e: e["t"])
    frontier = min((e for e in after if e["step"] >= kill["step"]), key=lambda e: e["t"])
    resumed_from = min(e["step"] for e in after) - 1
    trained, expected = trained_samples(events), trained_samples(reference)
    return {"system": system, "rep": rep, "kill_step": kill["step"], "resumed_from": resumed_from,
            "kill_to_next_step_s": next_step["t"] - kill["t"], "kill_to_frontier_s": frontier["t"] - kill["t"],
            "steps_lost": max(0, completed_before - resumed_from),
            "samples_lost": sum((expected - trained).values()),
            "samples_unexpected": sum((trained - expected).values()),
            "bitwise_equal": final_hashes(events) == final_hashes(reference)
            and final_losses(events) == final_losses(reference)}


def _deadpool(run_dir: Path, workers: int, steps: int, kill: tuple[int, int] | None,
              script_args: tuple[str, ...]) -> list[dict[str, Any]]:
    faults = (Fault(kind="kill", rank=kill[0], step=kill[1], phase="backward"),) if kill else ()
    config = JobConfig(script=str(EXAMPLE), script_args=("--steps", str(steps), "--log-every", "1000", "--log-samples",
                                                       *script_args),
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


def _torchft(run_dir: Path, workers: int, steps: int, kill: tuple[int, int] | None,
             timeout_s: float) -> list[dict[str, Any]]:
    """timeout_s: the lighthouse's heartbeat timeout and the gloo timeout, which together set how long
    the survivors wait before they train on without the dead replica (torchft's defaults: 5 s each)."""
    code, events = run_torchft(run_dir, workers=workers, steps=steps, kill=kill,
                               script_args=("--pg-timeout-s", f"{timeout_s:g}"),
                               heartbeat_timeout_ms=round(timeout_s * 1000))
    if code != 0:
        raise RuntimeError(f"torchft run {run_dir} failed with exit code {code}; see {run_dir}/torchft.log")
    return events


Runner = Callable[[Path, tuple[int, int] | None], list[dict[str, Any]]]  # (run directory, kill) -> events


def compare(out: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """DeadPool vs torchrun + DCP vs torchft (unless --no-torchft or not installed), `args.reps` times
    each, interleaved, each against its own failure-free run; rows and the first rep's timelines."""
    kill = (args.kill_rank, args.kill_step)
    systems: list[tuple[str, str, Runner]] = [  # (name in rows, run directory prefix, run)
        ("deadpool", "deadpool", lambda run_dir, k: _deadpool(run_dir, args.workers, args.steps, k, ())),
        (f"torchrun+dcp(every {args.ckpt_every})", "torchrun",
         lambda run_dir, k: _torchrun(run_dir, args.workers, args.steps, k, args.ckpt_every, ()))]
    if not args.no_torchft:
        if torchft_available():
            name = "torchft" if args.torchft_timeout == 5.0 else f"torchft(timeouts {args.torchft_timeout:g} s)"
            systems.append((name, "torchft",
                            lambda run_dir, k: _torchft(run_dir, args.workers, args.steps, k, args.torchft_timeout)))
        else:
            print('torchft not installed: pip install -e ".[torchft]"', flush=True)
    references = {name: run(out / f"{prefix}-reference", None) for name, prefix, run in systems}
    rows, timelines = [], {}
    for rep in range(args.reps):
        for name, prefix, run in systems:
            events = run(out / f"{prefix}-{rep}", kill)
            rows.append(recovery_row(name, rep, events, references[name]))
            timelines.setdefault(name, timeline(events))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{r['system']} {r['kill_to_next_step_s']:.2f} s"
                                                        for r in rows[-len(systems):]), flush=True)
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
        row = recovery_row("deadpool", 0, events, reference)
        snapshot = max(e["bytes"] for e in events if e["event"] == "snapshot")  # step 0 has no optimizer state
        rows.append({**row, "axis": axis, "value": value, "workers": workers, "snapshot_bytes": snapshot})
        print(f"{axis} {value}: {workers} ranks, snapshot {snapshot / 1e6:.1f} MB/rank, kill -> next step "
              f"{row['kill_to_next_step_s']:.2f} s, bitwise_equal {row['bitwise_equal']}", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'system':>24} {'kill->next step':>26} {'kill->back at kill step':>26} {'steps lost':>10} "
             f"{'samples lost':>12} {'bitwise':>8}"]
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]

        def stat(key: str) -> str:
            values = [r[key] for r in mine]
            return f"{statistics.median(values):.2f} s ({min(values):.2f}..{max(values):.2f})"

        def distinct(key: str) -> str:
            return "/".join(map(str, sorted({r[key] for r in mine})))

        lines.append(f"{system:>24} {stat('kill_to_next_step_s'):>26} {stat('kill_to_frontier_s'):>26} "
                     f"{distinct('steps_lost'):>10} {distinct('samples_lost'):>12} "
                     f"{str(all(r['bitwise_equal'] for r in mine)):>8}")
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
