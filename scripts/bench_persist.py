"""The disk tier's figures (issue 17's targets), each measured on the example GPT, 4 ranks + spares:

  overhead   snapshots every step, persisting off vs every 10 commits (written by the spare), interleaved
             rounds: median step, end-to-end time, the training thread's snapshot wait, the write's GB/s
  sigterm    SIGTERM to the launcher -> exit 143 with the newest commit on disk, in seconds
  fallback   a rank and its only holder SIGKILLed together -> the next step, restored from disk, with phases
  sigstop    a worker SIGSTOPped -> its verdict, training going on, and the next step's end, at the example's
             step time and with steps slowed to 2 s

Usage: python scripts/bench_persist.py --out DIR [--rounds 3] [--steps 60] [--only overhead,sigterm,...]
A benchmark, not a test: it prints medians and ratios and writes DIR/persist.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from deadpool.config import Fault, JobConfig
from deadpool.events import read_events
from deadpool.launcher.launch import launch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "gpt" / "train.py"
SLOW = REPO / "tests" / "integration" / "scripts" / "slow_steps.py"


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


def job(run_dir: Path, steps: int, script: Path = TRAIN, prefix: tuple[str, ...] = (), **config: Any) -> dict:
    args = (*prefix, "--steps", str(steps))
    code, summary = launch(JobConfig(script=str(script), script_args=args, workers=4, run_dir=str(run_dir),
                                     **{"spares": 1, **config}), echo=None)
    return {"code": code, "summary": summary, "events": events(run_dir)}


def fresh(persist: Path) -> str:
    """A persist dir of this run's own: one left by an earlier run of the benchmark is removed (a job that does not
    resume refuses a persist dir that holds checkpoints)."""
    shutil.rmtree(persist, ignore_errors=True)
    return str(persist)


def overhead(out: Path, rounds: int, steps: int) -> dict:
    """Persisting every 10 commits against persisting off, same job, rounds interleaved."""
    rows: dict[str, list[dict]] = {"off": [], "every-10": []}
    for r in range(rounds):
        for variant in rows:
            extra = {} if variant == "off" else {"persist_dir": fresh(out / f"ckpt-{r}"), "persist_every": 10}
            done = job(out / f"overhead-{variant}-{r}", steps, **extra)
            ranked = [e for e in done["events"] if e["event"] == "step" and e["rank"] == 0 and e["step"] > 10]
            written = [e for e in done["events"] if e["event"] == "checkpoint_persisted"]
            rows[variant].append({
                "median_step_s": statistics.median(e["dur_s"] for e in ranked),
                "end_to_end_s": ranked[-1]["t"] - ranked[0]["t"],
                "wait_s": sum(e["wait_s"] for e in ranked),
                "checkpoints": len(written),
                "gbps": statistics.median([e["gbps"] for e in written if e["gbps"]] or [0.0]),
                "nbytes": max((e["nbytes"] for e in written), default=0)})  # the last: written as ranks end
    med = {v: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for v, rs in rows.items()}
    med["ratio_step"] = med["every-10"]["median_step_s"] / med["off"]["median_step_s"]
    med["ratio_end_to_end"] = med["every-10"]["end_to_end_s"] / med["off"]["end_to_end_s"]
    return med


def sigterm(out: Path, reps: int) -> dict:
    """Seconds from SIGTERM to the launcher's exit, and whether the newest commit was on disk by then."""
    took = []
    for r in range(reps):
        run_dir, persist = out / f"sigterm-{r}", out / f"sigterm-ckpt-{r}"
        launcher = subprocess.Popen([sys.executable, "-m", "deadpool.launcher.cli", "run", "--workers", "4",
                                     "--spares", "1", "--persist-dir", fresh(persist), "--out", str(run_dir),
                                     str(TRAIN), "--steps", "100000"], cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        while not any(e["event"] == "commit" and e["step"] >= 10 for e in events(run_dir)):
            time.sleep(0.05)
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(120)
        stopped = [e for e in events(run_dir) if e["event"] == "job_stopped"]
        took.append({"s": time.monotonic() - start, "code": code,
                     "newest_on_disk": bool(stopped) and stopped[-1]["persisted"] == stopped[-1]["committed"]})
    return {"median_s": statistics.median(t["s"] for t in took), "runs": took}


def fallback(out: Path, reps: int) -> dict:
    """A rank and the only holder of its replica SIGKILLed together, after a checkpoint: fault -> next step."""
    runs = []
    for r in range(reps):
        run_dir = out / f"fallback-{r}"
        result: dict = {}
        config = dict(spares=2, persist_dir=fresh(out / f"fallback-ckpt-{r}"), persist_every=5)
        thread = threading.Thread(target=lambda d, c, into: into.update(job(d, 40, **c)),
                                  args=(run_dir, config, result))
        thread.start()
        while not any(e["event"] == "checkpoint_persisted" and e["step"] >= 10 for e in events(run_dir)):
            time.sleep(0.02)
        seen = events(run_dir)
        holder = [e for e in seen if e["event"] == "plan_published"][-1]["holders"][1][0]
        pids = {e["proc"]: e["pid"] for e in seen if e["event"] == "process_spawned"}
        for proc in ("w1", holder):
            os.kill(pids[proc], signal.SIGKILL)
        thread.join(300)
        [recovery] = result["summary"]["recoveries"]
        decided = [e for e in result["events"] if e["event"] == "restore_decided"][-1]
        runs.append({k: recovery[k] for k in ("fault_to_next_step_s", "detect_s", "decide_s", "report_s",
                                              "restore_s", "rebuild_s", "steps_replayed")}
                    | {"from_disk": decided["from_disk"]})
    return {"median_fault_to_next_step_s": statistics.median(r["fault_to_next_step_s"] for r in runs), "runs": runs}


def sigstop(out: Path, reps: int) -> dict:
    """A worker SIGSTOPped in backward: fault -> next step, at the example's steps and with 2 s steps."""
    found = {}
    for name, script, prefix in (("example", TRAIN, ()), ("2s-steps", SLOW, ("1.6",))):
        times = []
        for r in range(reps):
            done = job(out / f"sigstop-{name}-{r}", 14, script=script, prefix=prefix,
                       faults=(Fault(kind="hang", rank=1, step=10),))
            [recovery] = done["summary"]["recoveries"]
            step = statistics.median(e["dur_s"] for e in done["events"] if e["event"] == "step" and e["step"] < 10)
            times.append({k: recovery[k] for k in ("detect_s", "resume_s", "fault_to_next_step_s")} | {"step_s": step})
        # resume_s: fault -> training goes on; fault_to_next_step_s also holds the next step's own duration
        found[name] = {f"median_{k}": statistics.median(t[k] for t in times)
                       for k in ("detect_s", "resume_s", "fault_to_next_step_s", "step_s")} | {"runs": times}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--only", default="overhead,sigterm,fallback,sigstop")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    which = args.only.split(",")
    results: dict[str, Any] = {}
    if "overhead" in which:
        results["overhead"] = overhead(args.out, args.rounds, args.steps)
    if "sigterm" in which:
        results["sigterm"] = sigterm(args.out, args.rounds)
    if "fallback" in which:
        results["fallback"] = fallback(args.out, args.rounds)
    if "sigstop" in which:
        results["sigstop"] = sigstop(args.out, args.rounds)
    (args.out / "persist.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
