"""`deadpool bench overhead`: the failure-free cost of fault tolerance, DeadPool's against DCP's.

For every model size and number of ranks (a cell), the example GPT trains under eight variants:

  deadpool-off       DeadPool, snapshots off                        (the baseline of the DeadPool variants)
  deadpool-every-1   DeadPool, a snapshot every step (replicated to the spare; each rank its slice)
  deadpool-every-1-whole  the same with --slices off: every rank copies and sends its whole state
  deadpool-every-5   DeadPool, a snapshot every 5th step (the density `auto` aims for)
  deadpool-auto      DeadPool, `auto`: the densest interval within the 1 % budget
  dcp-off            torchrun + DDP, no checkpoint                  (the baseline of the DCP variants)
  dcp-sync           torchrun + DDP, dcp.save every --ckpt-every steps
  dcp-async          torchrun + DDP, dcp.async_save every --ckpt-every steps

Each variant's ratio is to the baseline of its own system: DeadPool runs its own data-parallel wrapper,
torchrun runs torch's DDP, so across systems compare the absolute step times.

Step time, the same for every variant: the wall time from one step's end to the next step's end on a
rank (the `t` of consecutive step events), so it holds whatever the training loop does between steps:
DeadPool's snapshot capture and any wait for a copy, a synchronous save, an async save's staging; and
whatever a background snapshot or save takes from training's CPU. A run's figure is the mean over the
measured steps (total time / steps) and all ranks: a median would ignore the one step in K that pays
a checkpoint.

Warm-up, not measured (`warmup_steps`): the first 2K steps (K = --ckpt-every); with deadpool-auto among
the variants, more: a whole number of intervals, until two steps after auto's calibration (35 steps,
runtime/cadence.py), 40 at K = 5, for every variant alike. One-off costs fall in them: auto's
calibration, the allocation of DeadPool's slots, DCP's first save (planning, first staging). The measured
window is then a whole number of checkpoint intervals, so the DCP variants pay their saves at their true
rate, and it opens with a save, whose background writing has the rest of the interval to finish inside it.

The copy limit (bench/limits.py): before the runs, this machine's one-core memcpy, hash and loopback
bandwidths are measured; each snapshotting row states the bytes its snapshots copied, hashed and sent per
step, the lower bound on the step's extra time that they imply, and its measured extra time (step time
minus snapshots off) as a multiple of that bound.

Runs interleave: per cell and round, every variant once, in an order rotated each round, so drifts of
the machine hit every variant alike. A row gives the median over rounds and the spread (min..max of
the per-round figures).

CPU per step (bench/cpu.py), beside the step time: the whole job's CPU seconds per measured step (this
process, which runs DeadPool's launcher, and every process it started: workers, spares, torchrun's agent),
one training thread's (mean over ranks), and the rest of the job's beside every training thread (the
snapshot's own CPU is the rise of that over snapshots off: limits.py). Another tenant's load lengthens
steps but adds no CPU to ours, so where that is the noise the CPU ratio resolves what step times' drift
hides (not where the cores' speed itself drifts, as on the development VM); a cost that is waiting rather
than computing shows in step time only.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from deadpool.bench.baselines.run_torchrun import run_torchrun_dcp
from deadpool.bench.cells import (
    Size,
    Variant,
    available_memory,
    deadpool_memory,
    parameter_counts,
    parse_ranks,
    parse_sizes,
    parse_variants,
)
from deadpool.bench.cpu import JobCpu
from deadpool.bench.limits import REPEATS, Bandwidths, copy_limit, measure_bandwidths, traffic
from deadpool.bench.overhead_table import paired, table
from deadpool.bench.plots import plot_overhead
from deadpool.config import JobConfig
from deadpool.errors import ConfigError
from deadpool.events import read_events
from deadpool.launcher.launch import launch
from deadpool.launcher.options import EXAMPLE, default_out
from deadpool.runtime.cadence import CALIBRATION_STEPS

RUN_TIMEOUT_S = 120  # a torchrun run's start-up allowance; each step adds 30 s (the 50M preset takes seconds)


# ---- measuring one run ------------------------------------------------------------------------

def measure(events: list[dict[str, Any]], warmup: int, cpu: JobCpu | None = None) -> dict[str, Any]:
    """One run's step times from its events (either system), steps after `warmup`, every rank.

    intervals: seconds from the previous step's end to this step's end, per rank and measured step.
    blocked: of that, seconds the training thread spent in the fault-tolerance mechanism: DeadPool's
    wait for a snapshot copy (step.wait_s, inside the step), DCP's save call after the previous step
    (checkpoint.save_s: sync, the whole save; async, staging and waiting for the previous save).
    CPU per step (cpu.py), over the same window: the whole job's (`cpu`, sampled while it ran), a
    training thread's (its step events' thread_cpu_s, mean over ranks), and what is left of the job's
    beside every rank's training thread (gradient and replica streams, snapshots, holders, the launcher).
    """
    ends: dict[tuple[int, int], float] = {}
    thread_cpu: dict[tuple[int, int], float] = {}
    blocked: dict[tuple[int, int], float] = {}
    written: dict[int, float] = {}  # async save of step k -> when the last rank finished writing it
    for e in events:
        if e["event"] == "step":
            ends[e["rank"], e["step"]] = e["t"]
            if "thread_cpu_s" in e:
                thread_cpu[e["rank"], e["step"]] = e["thread_cpu_s"]
            blocked[e["rank"], e["step"]] = blocked.get((e["rank"], e["step"]), 0.0) + e.get("wait_s", 0.0)
        elif e["event"] == "checkpoint":  # delays the next step's end
            key = (e["rank"], e["step"] + 1)
            blocked[key] = blocked.get(key, 0.0) + e["save_s"]
        elif e["event"] == "checkpoint_written":
            written[e["step"]] = max(written.get(e["step"], e["t"]), e["t"])
    measured = sorted(key for key in ends if key[1] > warmup and (key[0], key[1] - 1) in ends)
    if not measured:
        raise ValueError(f"no steps after the {warmup} warm-up steps to measure")
    intervals = [ends[rank, step] - ends[rank, step - 1] for rank, step in measured]
    # `auto`: the intervals agreed, in order (the calibration's, then one every REPRICE_STEPS steps)
    chosen = [every for _, every in sorted({(e.get("at_step", 0), e["every"]) for e in events
                                           if e["event"] == "snapshot_interval"})]
    last_step, last_end = max(step for _, step in ends), max(ends.values())
    first_measured = min(step for _, step in measured)
    snapshots = [e for e in events if e["event"] == "snapshot" and first_measured - 1 <= e["step"] < last_step]
    n_steps = last_step - first_measured + 1
    job_cpu = cpu.between(min(t for (_, step), t in ends.items() if step == first_measured - 1), last_end) \
        if cpu is not None else None
    ranks = sorted({rank for rank, _ in measured})
    train_cpu = [(thread_cpu[rank, last_step] - thread_cpu[rank, first_measured - 1]) / n_steps for rank in ranks
                 if (rank, last_step) in thread_cpu and (rank, first_measured - 1) in thread_cpu]
    every_rank = len(train_cpu) == len(ranks)
    return {"intervals": intervals,
            "step_s": statistics.fmean(intervals),
            "wait_fraction": sum(blocked[key] for key in measured) / sum(intervals),
            "chosen_every": chosen[-1] if chosen else None,  # the one the run ended with
            "agreed_every": chosen,
            # DeadPool: snapshots taken in the window (a step's snapshot is taken at its end, so step
            # first_measured - 1's falls in the window); auto's interval may be longer than the window
            "snapshots_in_window": len({e["step"] for e in snapshots}),
            "traffic": traffic(events, first_measured, last_step),
            # a snapshot's engine time (copy and hash, send, the holder's check and ack): less skewed by
            # other load on the machine than a difference of step times
            "snapshot_busy_s": statistics.median(e["total_s"] for e in snapshots) if snapshots else None,
            # of that, the engine thread's CPU time (most of the rest is waiting: for a slot, for acks); None
            # for events of a version that did not time it
            "snapshot_cpu_s": statistics.median(cpus) if (cpus := [e["cpu_s"] for e in snapshots if "cpu_s" in e])
            else None,
            # saves taken inside the window but written after it: their background cost is partly unmeasured
            "saves_after_window": sum(step < last_step and t > last_end for step, t in written.items()),
            "job_cpu_s": None if job_cpu is None else job_cpu / n_steps,
            "train_cpu_s": statistics.fmean(train_cpu) if every_rank else None,
            "beside_cpu_s": job_cpu / n_steps - sum(train_cpu) if job_cpu is not None and every_rank else None}


def summarize(variants: list[Variant], rounds: dict[str, list[dict[str, Any]]], ckpt_every: int,
              bandwidths: Bandwidths | None = None) -> list[dict[str, Any]]:
    """One row per variant of one cell: median and spread over rounds, ratio to its own system's baseline,
    and for DeadPool's snapshotting variants the copy limit (with this machine's bandwidths)."""
    medians = {name: statistics.median(r["step_s"] for r in runs) for name, runs in rounds.items()}
    cpu = {key: {name: _median_or_none(runs, key) for name, runs in rounds.items()}
           for key in ("job_cpu_s", "train_cpu_s", "beside_cpu_s")}
    rows = []
    for variant in variants:
        runs = rounds[variant.name]
        per_round = [r["step_s"] for r in runs]
        rows.append({"system": variant.system, "variant": variant.name,
                     "snapshot_every": variant.snapshot_every, "save": variant.save,
                     "ckpt_every": ckpt_every if variant.save else None,
                     "median_step_s": medians[variant.name],
                     "ratio": medians[variant.name] / medians[variant.baseline], "baseline": variant.baseline,
                     "paired_ratios": paired(runs, rounds[variant.baseline]),
                     "min_step_s": min(per_round), "max_step_s": max(per_round),
                     "wait_fraction": statistics.median(r["wait_fraction"] for r in runs),
                     "chosen_every": [r["chosen_every"] for r in runs] if variant.snapshot_every == "auto" else None,
                     "agreed_every": [r.get("agreed_every") or [r["chosen_every"]] for r in runs]
                     if variant.snapshot_every == "auto" else None,
                     "saves_after_window": sum(r["saves_after_window"] for r in runs),
                     "snapshots_in_window": [r["snapshots_in_window"] for r in runs]
                     if variant.system == "deadpool" else None,
                     "copy_limit": copy_limit(runs, medians[variant.name] - medians[variant.baseline],
                                              _difference(cpu["beside_cpu_s"], variant), bandwidths)
                     if variant.system == "deadpool" else None,
                     **{f"median_{key}": cpu[key][variant.name] for key in cpu},
                     **{f"{key[:-2]}_ratio": _ratio(cpu[key][variant.name], cpu[key][variant.baseline])
                        for key in cpu},
                     "rounds": len(runs)})
    if "deadpool-off" in rounds and "dcp-off" in rounds:  # DeadPool's data parallelism against torch DDP's
        row = next(r for r in rows if r["variant"] == "deadpool-off")
        row["against_ddp"] = {"ratio": medians["deadpool-off"] / medians["dcp-off"],
                              "paired_ratios": paired(rounds["deadpool-off"], rounds["dcp-off"])}
    return rows


def _cpu_note(run: dict[str, Any]) -> str:
    return "" if run["job_cpu_s"] is None else f", job CPU {run['job_cpu_s'] * 1e3:.0f} ms/step"


def _median_or_none(runs: list[dict[str, Any]], key: str) -> float | None:
    """The median over rounds, or None if a round was not measured (a median of the others would be skewed)."""
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values and len(values) == len(runs) else None


def _difference(medians: dict[str, float | None], variant: Variant) -> float | None:
    value, baseline = medians[variant.name], medians[variant.baseline]
    return None if value is None or baseline is None else value - baseline


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or not baseline else value / baseline


# ---- running ----------------------------------------------------------------------------------

def warmup_steps(ckpt_every: int, calibrating: bool) -> int:
    """Steps not measured: so that one-off costs (see the module's docstring) stay out, 2K, and when `auto`
    runs, its calibration with two steps to spare, rounded up to a whole number of intervals."""
    calibration = math.ceil((CALIBRATION_STEPS + 2) / ckpt_every) if calibrating else 0
    return ckpt_every * max(2, calibration)


def run_steps(ckpt_every: int, steps: int | None, calibrating: bool) -> tuple[int, int]:
    """(warm-up, total) steps per run: by default the warm-up and one checkpoint interval. `calibrating`:
    deadpool-auto is among the variants (every variant gets the same warm-up, so they share one window)."""
    if ckpt_every < 1:
        raise ConfigError("--ckpt-every must be at least 1")
    warmup = warmup_steps(ckpt_every, calibrating)
    steps = warmup + ckpt_every if steps is None else steps
    if steps <= warmup or (steps - warmup) % ckpt_every:
        raise ConfigError(f"--steps must be the {warmup} warm-up steps plus a multiple of --ckpt-every "
                          f"({ckpt_every}), so the DCP variants pay their saves at their true rate: "
                          f"{warmup + ckpt_every}, {warmup + 2 * ckpt_every}, ...")
    return warmup, steps


def run_variant(variant: Variant, size: Size, ranks: int, steps: int, args: argparse.Namespace,
                run_dir: Path) -> list[dict[str, Any]]:
    """Trains the example once under `variant`; returns its events (raises if the run failed)."""
    script_args = ("--steps", str(steps), *size.script_args())
    if variant.system == "deadpool":
        assert variant.snapshot_every is not None
        config = JobConfig(script=str(EXAMPLE), script_args=(*script_args, "--log-every", "1000", "--parallel",
                                                             args.parallel), workers=ranks,
                           spares=args.spares, run_dir=str(run_dir), snapshot_every=variant.snapshot_every,
                           slices=variant.slices)
        code, summary = launch(config, echo=None)
        if code != 0:
            raise RuntimeError(f"run {run_dir} failed: {summary['error']}")
        return list(read_events(run_dir / "events.jsonl"))
    code, events = run_torchrun_dcp(run_dir, workers=ranks, steps=steps,
                                    ckpt_every=args.ckpt_every if variant.save else 0, kill=None,
                                    script_args=size.script_args(), timeout_s=RUN_TIMEOUT_S + 30 * steps,
                                    async_save=variant.save == "async", max_restarts=0)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # not needed; a 50M checkpoint is 0.6 GB
    if code != 0:
        raise RuntimeError(f"run {run_dir} failed with exit code {code}; see {run_dir / 'torchrun.log'}")
    return events


def bench_overhead(args: argparse.Namespace) -> int:
    sizes, ranks, variants = parse_sizes(args.sizes), parse_ranks(args.ranks), parse_variants(args.variants)
    warmup, steps = run_steps(args.ckpt_every, args.steps, any(v.snapshot_every == "auto" for v in variants))
    if args.rounds < 1:
        raise ConfigError("--rounds must be at least 1")
    out = args.out or default_out("bench-overhead")
    out.mkdir(parents=True, exist_ok=True)
    params = parameter_counts(sizes)
    cells = [(size, n) for size in sizes for n in ranks]
    total = len(cells) * args.rounds * len(variants)
    print(f"{len(cells)} cells x {args.rounds} rounds x {len(variants)} variants = {total} runs of {steps} steps "
          f"({warmup} warm-up); DeadPool ({args.parallel}) with {args.spares} spare(s); "
          f"DCP every {args.ckpt_every} steps")
    peak, available = max(deadpool_memory(params[s.name], n, args.spares) for s, n in cells), available_memory()
    print(f"DeadPool's biggest cell holds about {peak / 1e9:.1f} GB; {available / 1e9:.1f} GB available"
          + ("  -- WARNING: it may not fit" if peak > available else ""), flush=True)
    bandwidths = measure_bandwidths()
    (out / "bandwidths.json").write_text(json.dumps(bandwidths.to_json(), indent=2))
    print(f"this machine, one core, best of {REPEATS} over 256 MB (other load lowers them): {bandwidths.line()}",
          flush=True)
    rows: list[dict[str, Any]] = []
    intervals: dict[str, dict[str, list[float]]] = {}
    started, done = time.monotonic(), 0
    for size, n in cells:
        cell = f"{size.name} x {n} ranks"
        rounds: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
        for r in range(args.rounds):
            for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
                run_dir = out / f"{size.name}-{n}ranks" / f"round{r}-{variant.name}"
                with JobCpu() as cpu:
                    events = run_variant(variant, size, n, steps, args, run_dir)
                rounds[variant.name].append(measure(events, warmup, cpu))
                done += 1
                print(f"[{done}/{total}, {time.monotonic() - started:.0f} s] {cell}, round {r + 1}, {variant.name}: "
                      f"{rounds[variant.name][-1]['step_s'] * 1e3:.1f} ms/step{_cpu_note(rounds[variant.name][-1])}",
                      flush=True)
        cell_rows = [{"size": size.name, "params": params[size.name], "batch_size": size.batch_size, "ranks": n,
                      "steps": steps, "warmup_steps": warmup, **row}
                     for row in summarize(variants, rounds, args.ckpt_every, bandwidths)]
        rows += cell_rows
        intervals[cell] = {v.name: [d for run in rounds[v.name] for d in run["intervals"]] for v in variants}
        (out / "overhead.json").write_text(json.dumps(rows, indent=2))  # after every cell: partial results survive
        print(table(cell_rows), flush=True)
    plot = plot_overhead(out, intervals, columns=len(ranks))
    print(f"written: {out / 'overhead.json'}, {plot} ({time.monotonic() - started:.0f} s)")
    return 0
