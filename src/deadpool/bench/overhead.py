"""`deadpool bench overhead`: the example's step time with snapshots off, every step, and auto, interleaved."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from deadpool.bench.plots import plot_overhead
from deadpool.config import JobConfig
from deadpool.demo import EXAMPLE
from deadpool.events import read_events
from deadpool.launcher.cli import default_out
from deadpool.launcher.launch import launch
from deadpool.runtime.session import CALIBRATION_STEPS

VARIANTS: tuple[int | str, ...] = (0, 1, "auto")


def measure(run_dir: Path) -> dict[str, Any]:
    """Steady-state figures of one run: steps after `auto`'s calibration, every rank pooled."""
    events = list(read_events(run_dir / "events.jsonl"))
    steps = [e for e in events if e["event"] == "step" and e["step"] > CALIBRATION_STEPS]
    chosen = [e["every"] for e in events if e["event"] == "snapshot_interval"]
    return {"durations": [e["dur_s"] for e in steps],
            "median_step_s": statistics.median(e["dur_s"] for e in steps),
            "wait_fraction": sum(e["wait_s"] for e in steps) / sum(e["dur_s"] for e in steps),
            "chosen_every": chosen[0] if chosen else None}


def summarize(rounds: dict[int | str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per variant: the median over rounds, its spread, and the ratio to snapshots off."""
    base = statistics.median(r["median_step_s"] for r in rounds[0])
    rows = []
    for variant, runs in rounds.items():
        medians = [r["median_step_s"] for r in runs]
        median = statistics.median(medians)
        rows.append({"snapshot_every": variant, "median_step_s": median, "ratio": median / base,
                     "min_step_s": min(medians), "max_step_s": max(medians),
                     "wait_fraction": statistics.median(r["wait_fraction"] for r in runs),
                     "chosen_every": [r["chosen_every"] for r in runs] if variant == "auto" else None,
                     "rounds": len(runs)})
    return rows


def bench_overhead(args: argparse.Namespace) -> int:
    out = args.out or default_out("bench-overhead")
    rounds: dict[int | str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for round_index in range(args.rounds):
        for variant in VARIANTS:  # interleaved, so drifts of the machine hit every variant alike
            run_dir = out / f"round{round_index}-every-{variant}"
            config = JobConfig(script=str(EXAMPLE), script_args=("--steps", str(args.steps), "--log-every", "1000"),
                               workers=args.workers, spares=args.spares, run_dir=str(run_dir), snapshot_every=variant)
            code, summary = launch(config, echo=None)
            if code != 0:
                print(f"run {run_dir} failed: {summary['error']}")
                return code
            rounds[variant].append(measure(run_dir))
            print(f"round {round_index + 1}/{args.rounds} snapshot-every {variant}: "
                  f"median step {rounds[variant][-1]['median_step_s'] * 1e3:.1f} ms", flush=True)
    rows = summarize(rounds)
    (out / "overhead.json").write_text(json.dumps(rows, indent=2))
    plot = plot_overhead(out, {str(v): [d for r in runs for d in r["durations"]] for v, runs in rounds.items()})
    print(f"\n{args.workers} workers + {args.spares} spare, {args.steps} steps, {args.rounds} interleaved rounds "
          f"(steps after {CALIBRATION_STEPS}, all ranks)")
    print(f"{'snapshot-every':>15} {'median step':>12} {'ratio':>7} {'spread (min..max of rounds)':>30} {'wait':>8}")
    for row in rows:
        spread = f"{row['min_step_s'] * 1e3:.1f}..{row['max_step_s'] * 1e3:.1f} ms"
        label = f"auto={row['chosen_every']}" if row["snapshot_every"] == "auto" else str(row["snapshot_every"])
        print(f"{label:>15} {row['median_step_s'] * 1e3:>9.1f} ms {row['ratio']:>7.3f} {spread:>30} "
              f"{row['wait_fraction']:>8.2%}")
    print(f"written: {out / 'overhead.json'}, {plot}")
    return 0
