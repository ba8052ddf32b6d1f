"""`deadpool bench recovery`: the same job, the same worker SIGKILLed (kill) or SIGSTOPped (hang) at the
same step, recovered by DeadPool's hot swap, by torchrun + DCP restart and (if installed) by torchft, which
trains on without the lost replica until it heals back in; then DeadPool's recovery against world and
state size. The `node` fault SIGKILLs a whole node (its agent and its 2 ranks) of a DeadPool job run as
nodes of 2 ranks with one spare node (in network namespaces with --netns); the baselines have no node
agents, so that row is DeadPool's alone.

Every run is bounded: a system that completes no step within --hang-wait seconds of the fault is stopped,
all its processes killed, and recorded as not recovered (its times are None).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from deadpool.bench.baselines.bounded import STALLED_EXIT, FaultWatch, steps_after, wait_bounded
from deadpool.bench.baselines.run_torchft import run_torchft, torchft_available
from deadpool.bench.baselines.run_torchrun import run_torchrun_dcp
from deadpool.bench.plots import plot_recovery, timeline
from deadpool.config import Fault, JobConfig
from deadpool.errors import ConfigError
from deadpool.events import read_events
from deadpool.launcher.launch import launch
from deadpool.launcher.options import EXAMPLE, default_out
from deadpool.report import final_losses

FAULT_KINDS = ("kill", "hang", "node")  # SIGKILL a worker, SIGSTOP it (alive, silent), or SIGKILL its whole node
NODE_RANKS = 2  # ranks per node in the node fault's runs
RUN_TIMEOUT_S = 600.0  # the longest any one run may take, fault or not


def fault_kinds(text: str) -> tuple[str, ...]:
    """--faults: a comma-separated choice of kill, hang and node, in the order given."""
    kinds = tuple(dict.fromkeys(kind.strip() for kind in text.split(",") if kind.strip()))
    if not kinds or not set(kinds) <= set(FAULT_KINDS):
        raise ConfigError(f"--faults takes a comma-separated list of {', '.join(FAULT_KINDS)}, got {text!r}")
    return kinds


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

    A step is a completed (for torchft: committed) optimizer step; one that a survivor finished just
    after the fault but had begun before it is not a step after the fault (`steps_after`). steps_lost
    counts finished steps whose work was thrown away and redone (the step in flight at the fault is lost
    by every system and not counted). samples_lost counts the samples the failure-free run trained on and this run never
    did (by sample id: torchft trains on without the dead replica's share until it heals back in, and
    retries a discarded step on the next batch); samples_unexpected those it trained on that the
    failure-free run did not, or more often. bitwise_equal compares every rank's final state and every
    step's loss with the same system's failure-free run.

    Times run from the fault_injected event, whichever its kind ("kill" or "hang"). A run that completed no
    step after the fault (stopped at the benchmark's hang wait) did not recover: its times, resumed_from
    and steps_lost are None, and the samples it never reached count as lost.
    """
    fault = next((e for e in events if e["event"] == "fault_injected"), None)
    if fault is None:
        raise ValueError("the run has no fault_injected event: its fault never fired")
    completed_before = max((e["step"] for e in events if e["event"] == "step" and e["t"] < fault["t"]), default=0)
    after = steps_after(events, fault)
    next_step = min(after, key=lambda e: e["t"], default=None)
    frontier = min((e for e in after if e["step"] >= fault["step"]), key=lambda e: e["t"], default=None)
    resumed_from = min(e["step"] for e in after) - 1 if after else None
    to_next = None if next_step is None else next_step["t"] - fault["t"]
    trained, expected = trained_samples(events), trained_samples(reference)
    warmed = [e["t"] for e in events if e["event"] == "spare_warmed_up"]
    return {"system": system, "fault": fault["kind"], "rep": rep, "kill_step": fault["step"],
            "spare_warm_before_fault": min(warmed) < fault["t"] if warmed else None,
            "resumed_from": resumed_from, "fault_to_next_step_s": to_next,
            "fault_to_frontier_s": None if frontier is None else frontier["t"] - fault["t"],
            "steps_lost": None if resumed_from is None else max(0, completed_before - resumed_from),
            "samples_lost": sum((expected - trained).values()),
            "samples_unexpected": sum((trained - expected).values()),
            "bitwise_equal": final_hashes(events) == final_hashes(reference)
            and final_losses(events) == final_losses(reference)}


def _finished_or_stalled(code: int, events: list[dict[str, Any]], what: str, log: Path) -> list[dict[str, Any]]:
    """A run stopped for making no step after its fault is a result (not recovered); any other failure
    is an error of the benchmark."""
    if code not in (0, STALLED_EXIT):
        raise RuntimeError(f"{what} failed with exit code {code}; see {log} and the run's other logs")
    return events


def _at(fault: Fault | None, kind: str) -> tuple[int, int] | None:
    """(rank, step) of the fault if it is of this kind: the baselines take kill= and hang= apart."""
    return (fault.rank, fault.step) if fault is not None and fault.kind == kind else None


def _deadpool(run_dir: Path, workers: int, steps: int, fault: Fault | None, script_args: tuple[str, ...],
              hang_wait_s: float, netns: bool = False) -> list[dict[str, Any]]:
    """One DeadPool job, launched in a child process of its own (this module's __main__) so that a job that
    does not recover can be stopped at the hang wait with every process it started. A node fault runs the
    job as nodes of NODE_RANKS ranks and one spare node (trained exactly as on one machine: tested)."""
    nodes = fault is not None and fault.kind == "kill_node"
    config = JobConfig(script=str(EXAMPLE), script_args=("--steps", str(steps), "--log-every", "1000", "--log-samples",
                                                       *script_args),
                       workers=workers, spares=NODE_RANKS if nodes else 1, nproc_per_node=NODE_RANKS if nodes else 0,
                       netns=netns and nodes, run_dir=str(run_dir), faults=(fault,) if fault else ())
    run_dir.mkdir(parents=True, exist_ok=True)
    events_path, log_path = run_dir / "events.jsonl", run_dir / "launch.log"
    events_path.unlink(missing_ok=True)  # a stale fault_injected would start the hang wait at once
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deadpool.bench.recovery", config.to_json()],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        code = wait_bounded(proc, FaultWatch(events_path, hang_wait_s), RUN_TIMEOUT_S, log)
    events = list(read_events(events_path)) if events_path.is_file() else []
    return _finished_or_stalled(code, events, f"DeadPool run {run_dir}", log_path)


def _torchrun(run_dir: Path, workers: int, steps: int, fault: Fault | None, ckpt_every: int,
              hang_wait_s: float) -> list[dict[str, Any]]:
    code, events = run_torchrun_dcp(run_dir, workers=workers, steps=steps, ckpt_every=ckpt_every,
                                    kill=_at(fault, "kill"), hang=_at(fault, "hang"), timeout_s=RUN_TIMEOUT_S,
                                    hang_wait_s=hang_wait_s)
    return _finished_or_stalled(code, events, f"torchrun run {run_dir}", run_dir / "torchrun.log")


def _torchft(run_dir: Path, workers: int, steps: int, fault: Fault | None, timeout_s: float,
             hang_wait_s: float) -> list[dict[str, Any]]:
    """timeout_s: the lighthouse's heartbeat timeout and the gloo timeout, which together set how long
    the survivors wait before they train on without the lost replica (torchft's defaults: 5 s each)."""
    code, events = run_torchft(run_dir, workers=workers, steps=steps, kill=_at(fault, "kill"), hang=_at(fault, "hang"),
                               script_args=("--pg-timeout-s", f"{timeout_s:g}"), timeout_s=RUN_TIMEOUT_S,
                               hang_wait_s=hang_wait_s, heartbeat_timeout_ms=round(timeout_s * 1000))
    return _finished_or_stalled(code, events, f"torchft run {run_dir}", run_dir / "torchft.log")


Runner = Callable[[Path, Fault | None], list[dict[str, Any]]]  # (run directory, fault) -> events


def _seconds(value: float | None) -> str:
    return "no recovery" if value is None else f"{value:.2f} s"


def compare(out: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """DeadPool vs torchrun + DCP vs torchft (unless --no-torchft or not installed), for each fault kind of
    --faults, `args.reps` times each, interleaved, each against its own failure-free run; rows and the first
    rep's timelines, keyed "system, fault"."""
    kinds, wait = fault_kinds(args.faults), args.hang_wait
    mine = ("--parallel", args.parallel)  # DeadPool's runs; the baselines' scripts are DDP
    systems: list[tuple[str, str, Runner]] = [  # (name in rows, run directory prefix, run)
        ("deadpool", "deadpool",
         lambda run_dir, f: _deadpool(run_dir, args.workers, args.steps, f, mine, wait, args.netns)),
        (f"torchrun+dcp(every {args.ckpt_every})", "torchrun",
         lambda run_dir, f: _torchrun(run_dir, args.workers, args.steps, f, args.ckpt_every, wait))]
    if args.compile:  # the same job with torch.compile, its spare compiling while it waits; no baselines
        systems[1] = ("deadpool+compile", "deadpool-compile",
                      lambda run_dir, f: _deadpool(run_dir, args.workers, args.steps, f, (*mine, "--compile"), wait))
    elif not args.no_torchft:
        if torchft_available():
            name = "torchft" if args.torchft_timeout == 5.0 else f"torchft(timeouts {args.torchft_timeout:g} s)"
            systems.append((name, "torchft", lambda run_dir, f: _torchft(run_dir, args.workers, args.steps, f,
                                                                        args.torchft_timeout, wait)))
        else:
            print('torchft not installed: pip install -e ".[torchft]"', flush=True)
    if set(kinds) == {"node"}:  # DeadPool's row only: no baseline runs at all
        systems = systems[:1]
    references = {name: run(out / f"{prefix}-reference", None) for name, prefix, run in systems}
    rows: list[dict[str, Any]] = []
    timelines: dict[str, list] = {}
    for rep in range(args.reps):
        done = len(rows)
        for kind in kinds:
            fault = Fault(kind="kill_node" if kind == "node" else kind, rank=args.kill_rank, step=args.kill_step,
                          phase="backward")
            for name, prefix, run in systems[:1] if kind == "node" else systems:
                events = run(out / f"{prefix}-{kind}-{rep}", fault)
                rows.append(recovery_row(name, rep, events, references[name]))
                timelines.setdefault(f"{name}, {kind}", timeline(events))
        latest = [f"{r['system']} {r['fault']} {_seconds(r['fault_to_next_step_s'])}" for r in rows[done:]]
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(latest), flush=True)
    return rows, timelines


def scaling(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """DeadPool alone: recovery against world size (small model) and against state size (4 ranks)."""
    rows, wait = [], args.hang_wait
    small = ("--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--batch-size", "4")
    cases = [("world", w, w, small) for w in (2, 4, 8)] + \
            [("state", e, 4, ("--n-embd", str(e))) for e in (128, 256, 512)]
    for axis, value, workers, script_args in cases:
        steps, kill = 16, Fault(kind="kill", rank=1, step=12, phase="backward")
        reference = _deadpool(out / f"scale-{axis}-{value}-reference", workers, steps, None, script_args, wait)
        events = _deadpool(out / f"scale-{axis}-{value}", workers, steps, kill, script_args, wait)
        row = recovery_row("deadpool", 0, events, reference)
        snapshot = max(e["bytes"] for e in events if e["event"] == "snapshot")  # step 0 has no optimizer state
        rows.append({**row, "axis": axis, "value": value, "workers": workers, "snapshot_bytes": snapshot})
        print(f"{axis} {value}: {workers} ranks, snapshot {snapshot / 1e6:.1f} MB/rank, kill -> next step "
              f"{_seconds(row['fault_to_next_step_s'])}, bitwise_equal {row['bitwise_equal']}", flush=True)
    return rows


def table(rows: list[dict[str, Any]], hang_wait_s: float | None = None) -> str:
    """One line per system and fault, a system's faults side by side: median (min..max) of the runs that
    recovered, and how many did not ("no recovery within N s" when none did)."""
    lines = [f"{'system':>24} {'fault':>9} {'fault->next step':>26} {'fault->back at fault step':>26} "
             f"{'steps lost':>10} {'samples lost':>12} {'bitwise':>8}"]
    systems = dict.fromkeys(r["system"] for r in rows)
    groups = [(s, f) for s in systems for f in dict.fromkeys(r["fault"] for r in rows if r["system"] == s)]
    def stat(mine: list[dict[str, Any]], key: str) -> str:
        values = [r[key] for r in mine if r[key] is not None]
        if not values:
            return "no recovery" + (f" within {hang_wait_s:g} s" if hang_wait_s is not None else "")
        missed = len(mine) - len(values)
        return (f"{statistics.median(values):.2f} s ({min(values):.2f}..{max(values):.2f})"
                + (f", {missed} none" if missed else ""))

    def distinct(mine: list[dict[str, Any]], key: str) -> str:
        values = {r[key] for r in mine}
        return "/".join([str(v) for v in sorted(values - {None})] + ["-"] * (None in values))

    for system, fault in groups:
        mine = [r for r in rows if r["system"] == system and r["fault"] == fault]
        lines.append(f"{system:>24} {fault:>9} {stat(mine, 'fault_to_next_step_s'):>26} "
                     f"{stat(mine, 'fault_to_frontier_s'):>26} {distinct(mine, 'steps_lost'):>10} "
                     f"{distinct(mine, 'samples_lost'):>12} {str(all(r['bitwise_equal'] for r in mine)):>8}")
    return "\n".join(lines)


def bench_recovery(args: argparse.Namespace) -> int:
    out = args.out or default_out("bench-recovery")
    out.mkdir(parents=True, exist_ok=True)
    rows, timelines = compare(out, args)
    scale = [] if args.no_scaling else scaling(out, args)
    (out / "recovery.json").write_text(json.dumps(rows + scale, indent=2))
    print(f"\n{args.workers} workers ({args.parallel}), {args.steps} steps, rank {args.kill_rank} SIGKILLed (kill), "
          f"SIGSTOPped (hang) or killed with its node of {NODE_RANKS} "
          f"(kill_node{', namespaces' if args.netns else ''}) "
          f"in step {args.kill_step}, {args.reps} repetitions (median, min..max); a run with no step within "
          f"{args.hang_wait:g} s of the fault was stopped\n{table(rows, args.hang_wait)}")
    for path in plot_recovery(out, rows, scale, timelines):
        print(f"plot: {path}")
    print(f"written: {out / 'recovery.json'}")
    return 0


if __name__ == "__main__":  # the child process of _deadpool: python -m deadpool.bench.recovery CONFIG_JSON
    sys.exit(launch(JobConfig.from_json(sys.argv[1]), echo=None)[0])
