"""`deadpool simulate`: sweeps cluster sizes through the goodput model and prints what each strategy keeps."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from deadpool.sim.model import (
    DAY,
    HOUR,
    STRATEGIES,
    ClusterParams,
    analytic_goodput,
    erlang_b,
    simulate,
    spare_load,
    spares_needed,
    stalls_per_day,
)

DEFAULT_GPUS = (1024, 4096, 16384, 65536, 100000)
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ClusterParams)}
# flag -> ClusterParams field; the defaults live in ClusterParams alone
_FLAGS = {"--gpus-per-node": ("gpus_per_node", int, "GPUs per node (a failure takes out a node)"),
          "--mttf-hours-at-1024": ("mttf_hours_at_1024", float, "job MTTF of 1,024 GPUs; it scales as 1024/gpus"),
          "--step-s": ("step_s", float, "training step time"),
          "--ckpt-interval-s": ("ckpt_interval_s", float, "work between checkpoints (default: Young/Daly)"),
          "--ckpt-cost-s": ("ckpt_cost_s", float, "training stall per checkpoint (checkpoint-restart)"),
          "--restart-s": ("restart_s", float, "reschedule + process start + checkpoint load"),
          "--spare-replenish-s": ("spare_replenish_s", float, "until a used spare, or a dropped node, is back"),
          "--reconfig-s": ("reconfig_s", float, "replica dropping: quorum + communicator rebuild per failure"),
          "--replica-group-nodes": ("replica_group_nodes", int, "replica dropping: nodes per replica group")}
# The hot-swap phases, as a run's summary.json names them; each gets a --{phase}-s flag.
PHASES = ("detect", "decide", "report", "rebuild", "restore")


def measured_phases(run_dirs: list[Path]) -> dict[str, float]:
    """Median of each hot-swap phase over the recoveries in each run_dir/summary.json (`deadpool run|demo --out`)."""
    recoveries = []
    for run_dir in run_dirs:
        path = run_dir / "summary.json"
        try:
            found = json.loads(path.read_text())["recoveries"]
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"--phases-from: cannot read the recoveries of {path} ({error}); give the --out "
                             f"directory of a finished `deadpool demo` or `deadpool run` that had a swap") from None
        if not found:
            raise ValueError(f"--phases-from: {path} records no recovery; inject a failure (deadpool demo) first")
        recoveries += found
    return {phase: statistics.median(r[f"{phase}_s"] for r in recoveries) for phase in PHASES}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds `simulate` to the `deadpool` subcommands."""
    p = sub.add_parser("simulate", help="goodput of checkpoint-restart, replica dropping and hot swap at scale",
                       description="Closed-form and Monte Carlo goodput of three recovery strategies, and the "
                                   "spares that keep hot swap from stalling.")
    p.add_argument("--gpus", type=int, nargs="+", action="extend", metavar="N",
                   help=f"cluster sizes, repeatable (default: {' '.join(map(str, DEFAULT_GPUS))})")
    for flag, (field, kind, text) in _FLAGS.items():
        shown = "" if _DEFAULTS[field] is None else f" (default: {_DEFAULTS[field]})"
        p.add_argument(flag, type=kind, default=_DEFAULTS[field], help=text + shown)
    for phase in PHASES:
        p.add_argument(f"--{phase}-s", type=float, default=None,
                       help=f"hot swap: {phase} phase (default: --phases-from, else {_DEFAULTS[phase + '_s']})")
    p.add_argument("--phases-from", type=Path, nargs="+", default=None, metavar="RUN_DIR",
                   help="take the hot-swap phases measured in these run directories (median over their recoveries)")
    p.add_argument("--spares", type=int, default=None, help="hot-swap spares (default: the fewest for --stall-target)")
    p.add_argument("--stall-target", type=float, default=1e-3, help="stalls per day to stay under (default: 0.001)")
    p.add_argument("--days", type=float, default=30.0, help="Monte Carlo horizon per run (default: 30)")
    p.add_argument("--runs", type=int, default=8, help="independent Monte Carlo runs per size (default: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory to write simulate.json into")


def swap_phases(args: argparse.Namespace) -> dict[str, float]:
    """The hot-swap phase costs: a flag given beats a measured run (--phases-from) beats the model's default."""
    measured = measured_phases(args.phases_from) if args.phases_from else {}
    return {f"{phase}_s": float(next(v for v in (getattr(args, f"{phase}_s"), measured.get(phase),
                                                 _DEFAULTS[f"{phase}_s"]) if v is not None)) for phase in PHASES}


def _evaluate(args: argparse.Namespace, gpus: int, phases: dict[str, float]) -> dict:
    """Everything reported for one cluster size, JSON-ready."""
    fields = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in _FLAGS.items()} | phases
    base = ClusterParams(gpus=gpus, spares=args.spares or 0, **fields)
    needed = spares_needed(base, args.stall_target)
    p = dataclasses.replace(base, spares=needed if args.spares is None else args.spares)
    mc = simulate(p, days=args.days, runs=args.runs, seed=args.seed)
    return {"gpus": gpus, "params": dataclasses.asdict(p), "mttf_h": p.mttf_s / HOUR, "ckpt_interval_s": p.interval_s,
            "swap_s": p.swap_s, "analytic": analytic_goodput(p),
            "monte_carlo": {name: dataclasses.asdict(mc.goodput[name]) for name in STRATEGIES},
            "failures_per_day": p.failure_rate * DAY, "spare_load_erlangs": spare_load(p),
            "spares_needed": needed, "stalls_per_day_needed": stalls_per_day(dataclasses.replace(p, spares=needed)),
            "stalls_per_day_one_fewer": stalls_per_day(dataclasses.replace(p, spares=needed - 1)) if needed else None,
            "blocking": erlang_b(p.spares, spare_load(p)), "stalls_per_day": stalls_per_day(p),
            "mc_blocked": dataclasses.asdict(mc.blocked), "mc_stalls_per_day": dataclasses.asdict(mc.stalls_per_day),
            "mc_stall_days": dataclasses.asdict(mc.stall_days), "mc_failures": mc.failures, "mc_days": mc.days}


def _goodput_table(rows: list[dict]) -> str:
    head = (f"{'GPUs':>7} {'MTTF':>7} {'ckpt every':>10}  {'checkpoint-restart':>22}  {'replica dropping':>22}  "
            f"{'hot swap':>22} {'spares':>6}")
    lines = ["Goodput = useful training time / wall time: closed form / Monte Carlo mean ± standard error", head]
    for r in rows:
        cells = [f"{r['analytic'][s]:.4f} / {r['monte_carlo'][s]['mean']:.4f}±{r['monte_carlo'][s]['stderr']:.4f}"
                 for s in STRATEGIES]
        lines.append(f"{r['gpus']:>7} {r['mttf_h']:>5.2f} h {r['ckpt_interval_s']:>8.0f} s  "
                     f"{cells[0]:>22}  {cells[1]:>22}  {cells[2]:>22} {r['params']['spares']:>6}")
    return "\n".join(lines)


def _spares_table(rows: list[dict], target: float) -> str:
    gone = rows[0]["params"]["spare_replenish_s"]
    lines = [f"Spares for hot swap (Erlang loss: a used spare is gone for {gone:.0f} s;"
             f" a stall is a failure that finds no idle spare; target < {target:g} stalls/day)",
             f"{'GPUs':>7} {'failures/day':>12} {'load (Erl)':>10} {'spares needed':>13} {'stalls/day':>10} "
             f"{'with one fewer':>14}   Monte Carlo at the spares simulated"]
    for r in rows:
        mc = (f"{r['params']['spares']} spares: {r['mc_stalls_per_day']['mean'] * r['mc_days']:.0f} of "
              f"{r['mc_failures']} failures stalled in {r['mc_days']:.0f} days (closed form "
              f"{r['blocking'] * r['mc_failures']:.2g})")
        fewer = "-" if r["stalls_per_day_one_fewer"] is None else f"{r['stalls_per_day_one_fewer']:.2g}"
        lines.append(f"{r['gpus']:>7} {r['failures_per_day']:>12.1f} {r['spare_load_erlangs']:>10.2f} "
                     f"{r['spares_needed']:>13} {r['stalls_per_day_needed']:>10.2g} {fewer:>14}   {mc}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Prints the goodput and spares tables for each size; writes simulate.json into --out if given."""
    try:
        phases = swap_phases(args)
        rows = [_evaluate(args, gpus, phases) for gpus in (args.gpus or DEFAULT_GPUS)]
    except ValueError as error:
        print(f"deadpool simulate: error: {error}", file=sys.stderr)
        return 2
    swap = rows[0]["params"]
    source = f"measured in {' '.join(map(str, args.phases_from))}" if args.phases_from else "model defaults"
    print(f"{args.runs} Monte Carlo runs of {args.days:g} days per size, seed {args.seed}. Hot swap costs "
          f"{rows[0]['swap_s']:.2f} s a failure (phases, {source}: "
          + " + ".join(f"{phase} {swap[phase + '_s']:.3g}" for phase in PHASES)
          + f" + half a step {swap['step_s'] / 2:g}); checkpoint-restart {swap['ckpt_cost_s']:g} s per checkpoint, "
          f"restart {swap['restart_s']:g} s; replica dropping {swap['reconfig_s']:g} s + half a step per failure.\n")
    print(_goodput_table(rows) + "\n\n" + _spares_table(rows, args.stall_target))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if not callable(v)}
        (args.out / "simulate.json").write_text(json.dumps({"args": settings, "sizes": rows}, indent=2, default=str))
        print(f"\nwrote {args.out / 'simulate.json'}")
    return 0
