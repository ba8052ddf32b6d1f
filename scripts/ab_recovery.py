"""A/B of two checkouts of DeadPool on the same faults, interleaved in one run: fault -> next step, per fault.

    python scripts/ab_recovery.py --old PATH --new PATH [--faults none,kill,hang] [--reps 3] [--out DIR]

Each checkout runs `deadpool run` from its own src/ (PYTHONPATH), on the example GPT (4 workers, 1 spare,
30 steps, the fault on rank 1 in the backward pass of step 20; `none`: no fault, and the figure is the
median failure-free step time of rank 0 over steps 6..30); runs alternate old/new so both see the same
machine. Prints each run's figure (and a recovery's phases), then the medians and new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = ("detect_s", "decide_s", "report_s", "restore_s", "rebuild_s")


def run_once(tree: Path, fault: str, out: Path) -> dict:
    """One run's recovery record, or for `none` {"figure_s": the median step time}."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    faults = [] if fault == "none" else ["--fault", f"{fault}:1:20:backward"]
    argv = [sys.executable, "-m", "deadpool.launcher.cli", "run", "--workers", "4", "--spares", "1", *faults,
            "--out", str(out), str(tree / "examples" / "gpt" / "train.py"), "--steps", "30"]
    subprocess.run(argv, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    if fault == "none":
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        durations = [e["dur_s"] for e in events if e["event"] == "step" and e["rank"] == 0 and e["step"] > 5]
        return {"figure_s": statistics.median(durations)}
    [recovery] = json.loads((out / "summary.json").read_text())["recoveries"]
    return {**recovery, "figure_s": recovery["fault_to_next_step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, required=True)
    parser.add_argument("--faults", default="kill,hang")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/ab-recovery"))
    args = parser.parse_args()
    rows: dict[tuple[str, str], list[dict]] = {}
    for fault in args.faults.split(","):
        for rep in range(args.reps):
            for side, tree in (("old", args.old), ("new", args.new)):
                recovery = run_once(tree.resolve(), fault, args.out / f"{fault}-{side}-{rep}")
                rows.setdefault((fault, side), []).append(recovery)
                phases = " ".join(f"{p[:-2]} {recovery[p]:.2f}" for p in PHASES if recovery.get(p) is not None)
                what = "median step" if fault == "none" else "fault -> next step"
                print(f"{fault:5} {side} rep {rep}: {what} {recovery['figure_s']:.3f} s ({phases})", flush=True)
    print(f"\n{'fault':6}{'old median s':>14}{'new median s':>14}{'new/old':>9}")
    for fault in args.faults.split(","):
        old, new = (statistics.median(r["figure_s"] for r in rows[(fault, side)]) for side in ("old", "new"))
        print(f"{fault:6}{old:>14.2f}{new:>14.2f}{new / old:>9.2f}")


if __name__ == "__main__":
    main()
