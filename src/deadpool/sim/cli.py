"""`deadpool simulate`: sweeps cluster sizes through the goodput model and prints what each strategy keeps."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from deadpool.sim import scale
from deadpool.sim.fit import read_fit
from deadpool.sim.model import (
    DAY,
    HOUR,
    STRATEGIES,
    ClusterParams,
    analytic_goodput,
    erlang_b,
    hot_swap_goodput,
    require,
    simulate,
    spare_load,
    spares_needed,
    spares_worth,
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
# The hot-swap phases, as a run's summary.json names them; with transfer (which a run counts in its report) and
# resend (in its rebuild), those of the cost model (sim/scale.py). Each gets a --{phase}-s flag.
PHASES = ("detect", "decide", "report", "rebuild", "restore")
SWAP_PHASES = ("detect", "decide", "report", "rebuild", "transfer", "resend", "restore")
# The coefficients each phase of the cost model is priced with (its marks are theirs)
PHASE_COEFFICIENTS = {"detect": ("exit_notice_s",), "decide": ("decide_s",),
                      "report": ("report_s", "report_per_rank_s"),
                      "rebuild": ("rebuild_s", "rebuild_per_doubling_s", "rebuild_per_rank_s"),
                      "transfer": ("transfer_s", "link_bytes_per_s"),
                      "resend": ("transfer_s", "link_bytes_per_s", "pod_gpus", "pod_oversubscription"),
                      "restore": ("restore_bytes_per_s",)}
_UNITS = {"report_per_rank_s": "s/rank", "rebuild_per_doubling_s": "s/doubling", "rebuild_per_rank_s": "s/rank",
          "link_bytes_per_s": "B/s", "restore_bytes_per_s": "B/s", "pod_gpus": "GPUs", "pod_oversubscription": "x"}
DEFAULT_COSTS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0)


def measured_phases(run_dirs: list[Path]) -> dict[str, float]:
    """Median of each hot-swap phase over the recoveries in each run_dir/summary.json (`deadpool run|demo --out`);
    transfer 0, since a run's report phase already holds any replica it streamed."""
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
    return {phase: statistics.median(r[f"{phase}_s"] for r in recoveries) for phase in PHASES} | {"transfer": 0.0,
                                                                                                 "resend": 0.0}


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
    p.add_argument("--swap-model", choices=sorted(scale.SWAP_MODELS), default="nccl-shrink",
                   help="coefficients that price the hot-swap phases at each size (default: nccl-shrink)")
    p.add_argument("--fit", type=Path, default=None, metavar="FILE",
                   help="price the phases with the coefficients of this fit (scripts/bench_sim_fit.py's sim_fit.json; "
                        "default: the fit of 2026-12-02 in sim/scale.py)")
    p.add_argument("--node-state-gb", type=float, default=scale.DEFAULT_NODE_STATE_BYTES / 1e9,
                   help="state of one node that its spare takes over, GB (default: 14.2, a 65B model on 64 nodes)")
    p.add_argument("--hang-fraction", type=float, default=0.0,
                   help="fraction of failures that are hangs, detected at the hang timeout (default: 0)")
    for phase in SWAP_PHASES:
        p.add_argument(f"--{phase}-s", type=float, default=None,
                       help=f"hot swap: {phase} phase (default: --phases-from, else --swap-model at each size)")
    p.add_argument("--phases-from", type=Path, nargs="+", default=None, metavar="RUN_DIR",
                   help="take the hot-swap phases measured in these run directories (median over their recoveries)")
    p.add_argument("--costs", type=float, nargs="+", default=list(DEFAULT_COSTS), metavar="S",
                   help="per-failure swap costs for the sensitivity table, seconds (default: 1 5 10 30 60 120)")
    p.add_argument("--spares", type=int, default=None, help="hot-swap spares (default: the fewest for --stall-target)")
    p.add_argument("--stall-target", type=float, default=1e-3, help="stalls per day to stay under (default: 0.001)")
    p.add_argument("--days", type=float, default=30.0, help="Monte Carlo horizon per run (default: 30)")
    p.add_argument("--runs", type=int, default=8, help="independent Monte Carlo runs per size (default: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory to write simulate.json into")


def coefficients(args: argparse.Namespace) -> scale.SwapCoefficients:
    """The --swap-model's coefficients, from --fit's file if given."""
    models = scale.swap_models(read_fit(args.fit)) if args.fit else scale.SWAP_MODELS
    return models[args.swap_model]


def swap_phases(args: argparse.Namespace, model: scale.SwapCoefficients, gpus: int, measured: dict[str, float],
                hang_fraction: float, sticky: bool = True) -> dict[str, float]:
    """The hot-swap phase costs at one size: a flag given beats a measured run (--phases-from) beats the
    --swap-model."""
    priced = scale.swap_phases(model, ranks=gpus, ranks_per_node=args.gpus_per_node,
                               node_state_bytes=args.node_state_gb * 1e9, step_s=args.step_s,
                               hang_fraction=hang_fraction, sticky=sticky)
    return {f"{phase}_s": float(next(v for v in (getattr(args, f"{phase}_s"), measured.get(phase),
                                                 priced[f"{phase}_s"]) if v is not None)) for phase in SWAP_PHASES}


def _evaluate(args: argparse.Namespace, model: scale.SwapCoefficients, gpus: int, measured: dict[str, float]) -> dict:
    """Everything reported for one cluster size, JSON-ready."""
    def phases(hang_fraction: float, sticky: bool = True) -> dict[str, Any]:
        return swap_phases(args, model, gpus, measured, hang_fraction, sticky)

    fields = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in _FLAGS.items()}
    base = ClusterParams(gpus=gpus, spares=args.spares or 0, **fields, **phases(args.hang_fraction))
    needed = spares_needed(base, args.stall_target)
    p = dataclasses.replace(base, spares=needed if args.spares is None else args.spares)
    crash, hang = (dataclasses.replace(p, **phases(fraction)).swap_s for fraction in (0.0, 1.0))
    anew = dataclasses.replace(p, **phases(args.hang_fraction, sticky=False))
    mc = simulate(p, days=args.days, runs=args.runs, seed=args.seed)
    priced = [dataclasses.replace(p, swap_cost_s=cost) for cost in args.costs]
    return {"gpus": gpus, "params": dataclasses.asdict(p), "mttf_h": p.mttf_s / HOUR, "ckpt_interval_s": p.interval_s,
            "swap_s": p.swap_s, "swap_s_crash": crash, "swap_s_hang": hang, "analytic": analytic_goodput(p),
            "placed_anew": {"resend_s": anew.resend_s, "swap_s": anew.swap_s, "hot_swap": hot_swap_goodput(anew)},
            "monte_carlo": {name: dataclasses.asdict(mc.goodput[name]) for name in STRATEGIES},
            "failures_per_day": p.failure_rate * DAY, "spare_load_erlangs": spare_load(p),
            "spares_needed": needed, "stalls_per_day_needed": stalls_per_day(dataclasses.replace(p, spares=needed)),
            "stalls_per_day_one_fewer": stalls_per_day(dataclasses.replace(p, spares=needed - 1)) if needed else None,
            "blocking": erlang_b(p.spares, spare_load(p)), "stalls_per_day": stalls_per_day(p),
            "spares_worth": spares_worth(p),
            "sensitivity": [{"swap_s": q.swap_s, "goodput": hot_swap_goodput(q), "spares_worth": spares_worth(q)}
                            for q in priced],
            "mc_blocked": dataclasses.asdict(mc.blocked), "mc_stalls_per_day": dataclasses.asdict(mc.stalls_per_day),
            "mc_stall_days": dataclasses.asdict(mc.stall_days), "mc_failures": mc.failures, "mc_days": mc.days}


def phase_marks(args: argparse.Namespace, model: scale.SwapCoefficients, measured: dict[str, float]) -> dict[str, str]:
    """Where each phase's cost comes from: a flag, a run (--phases-from), or the marks of the model's
    coefficients that price it (m: measured, f: fitted, p: published, a: assumed; the hang timeout of detect
    is the coordinator's own policy)."""
    found = {}
    for phase in SWAP_PHASES:
        if getattr(args, f"{phase}_s") is not None:
            found[phase] = "flag"
        elif phase in measured:
            found[phase] = "run"
        else:
            found[phase] = "+".join(dict.fromkeys(model.marks[name][0] for name in PHASE_COEFFICIENTS[phase]))
    return found


def _coefficient_table(c: scale.SwapCoefficients) -> str:
    lines = ["Coefficients of the swap model (measured: read off our runs; fitted: least squares over our runs; "
             "published: from a publication; assumed: no measurement)"]
    for name in scale.COEFFICIENTS:
        lines.append(f"  {name:<24} {getattr(c, name):>12.4g} {_UNITS.get(name, 's'):<10} {c.marks[name]}")
    return "\n".join(lines)


def _phase_table(rows: list[dict], marks: dict[str, str]) -> str:
    head = (f"{'GPUs':>7} " + " ".join(f"{phase:>8}" for phase in SWAP_PHASES)
            + f" {'half step':>9} {'per failure':>11} {'crash only':>10} {'hang only':>9}")
    lines = ["Hot swap per failure, by phase (s); the sticky placement of replicas", head,
             f"{'from':>7} " + " ".join(f"{marks[phase]:>8}" for phase in SWAP_PHASES)]
    for r in rows:
        phases = " ".join(f"{r['params'][phase + '_s']:>8.3f}" for phase in SWAP_PHASES)
        lines.append(f"{r['gpus']:>7} {phases} {r['params']['step_s'] / 2:>9.3f} {r['swap_s']:>11.2f} "
                     f"{r['swap_s_crash']:>10.2f} {r['swap_s_hang']:>9.2f}")
    return "\n".join(lines)


def _sticky_table(rows: list[dict]) -> str:
    lines = ["Sticky placement against placing anew (closed form, at the spares simulated): a swap resends the "
             "lost node's orphans, or every node resends at once through the fabric",
             f"{'GPUs':>7} {'resend sticky':>13} {'resend anew':>11} {'per failure sticky':>18} "
             f"{'per failure anew':>16} {'hot swap sticky':>15} {'hot swap anew':>13} {'replica dropping':>16}"]
    for r in rows:
        anew = r["placed_anew"]
        lines.append(f"{r['gpus']:>7} {r['params']['resend_s']:>13.2f} {anew['resend_s']:>11.2f} {r['swap_s']:>18.2f} "
                     f"{anew['swap_s']:>16.2f} {r['analytic']['hot_swap']:>15.4f} {anew['hot_swap']:>13.4f} "
                     f"{r['analytic']['replica_drop']:>16.4f}")
    return "\n".join(lines)


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
             f"{'with one fewer':>14} {'worth their GPUs':>16}   Monte Carlo at the spares simulated"]
    for r in rows:
        mc = (f"{r['params']['spares']} spares: {r['mc_stalls_per_day']['mean'] * r['mc_days']:.0f} of "
              f"{r['mc_failures']} failures stalled in {r['mc_days']:.0f} days (closed form "
              f"{r['blocking'] * r['mc_failures']:.2g})")
        fewer = "-" if r["stalls_per_day_one_fewer"] is None else f"{r['stalls_per_day_one_fewer']:.2g}"
        lines.append(f"{r['gpus']:>7} {r['failures_per_day']:>12.1f} {r['spare_load_erlangs']:>10.2f} "
                     f"{r['spares_needed']:>13} {r['stalls_per_day_needed']:>10.2g} {fewer:>14} "
                     f"{r['spares_worth']:>16}   {mc}")
    return "\n".join(lines)


def _sensitivity_table(rows: list[dict]) -> str:
    gone = rows[0]["params"]["spare_replenish_s"]
    lines = ["Sensitivity to the per-failure cost of a swap (closed form): hot-swap goodput at the spares simulated"
             " / the spares worth their GPUs",
             f"(the spares for the stall target stay as above at every cost: a used spare is gone for {gone:.0f} s"
             " whatever the swap cost)",
             f"{'cost':>8} " + " ".join(f"{r['gpus']:>14}" for r in rows)]
    for i, entry in enumerate(rows[0]["sensitivity"]):
        cells = [f"{r['sensitivity'][i]['goodput']:.4f} / {r['sensitivity'][i]['spares_worth']:>3}" for r in rows]
        lines.append(f"{entry['swap_s']:>6g} s " + " ".join(f"{cell:>14}" for cell in cells))
    return "\n".join(lines)


def _pricing(args: argparse.Namespace, model: scale.SwapCoefficients) -> str:
    """Where the hot-swap phases came from, in a sentence."""
    fit = f"the fit in {args.fit}" if args.fit else "the fit of 2026-12-02"
    parts = [f"the {args.swap_model} model ({model.source}; {fit}) at each size, "
             f"{args.node_state_gb:.3g} GB of state per node, {args.hang_fraction:.0%} of failures hangs"]
    if args.phases_from:
        parts.append(f"phases measured in {' '.join(map(str, args.phases_from))} (as measured, at every size)")
    flagged = [phase for phase in SWAP_PHASES if getattr(args, f"{phase}_s") is not None]
    if flagged:
        parts.append("flags for " + ", ".join(flagged))
    return "; overridden by ".join(parts)


def main(args: argparse.Namespace) -> int:
    """Prints the phase, goodput, spares and sensitivity tables for each size; writes simulate.json into --out."""
    try:
        require("--node-state-gb", args.node_state_gb, zero_ok=True)  # name the flag, not the model's field
        for cost in args.costs:
            require("--costs", cost, zero_ok=True)
        measured = measured_phases(args.phases_from) if args.phases_from else {}
        model = coefficients(args)
        rows = [_evaluate(args, model, gpus, measured) for gpus in (args.gpus or DEFAULT_GPUS)]
        marks = phase_marks(args, model, measured)
    except ValueError as error:
        print(f"deadpool simulate: error: {error}", file=sys.stderr)
        return 2
    first = rows[0]["params"]
    mttf_h = first["mttf_hours_at_1024"]
    print(f"{args.runs} Monte Carlo runs of {args.days:g} days per size, seed {args.seed}. Each GPU fails at "
          f"{1 / (1024 * mttf_h):.3g} per hour (a node of {first['gpus_per_node']} every "
          f"{1024 / first['gpus_per_node'] * mttf_h / 24:.0f} days; job MTTF {mttf_h:g} h at 1,024 GPUs). "
          f"Hot swap priced by {_pricing(args, model)}; checkpoint-restart {first['ckpt_cost_s']:g} s per "
          f"checkpoint, restart {first['restart_s']:g} s; replica dropping {first['reconfig_s']:g} s + half a step "
          "per failure.\n")
    print("\n\n".join([_coefficient_table(model), _phase_table(rows, marks), _sticky_table(rows),
                       _goodput_table(rows), _spares_table(rows, args.stall_target), _sensitivity_table(rows)]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if not callable(v)}
        priced = {"source": model.source, "coefficients": {name: getattr(model, name) for name in scale.COEFFICIENTS},
                  "marks": dict(model.marks), "phase_marks": marks}
        (args.out / "simulate.json").write_text(json.dumps({"args": settings, "swap_model": priced, "sizes": rows},
                                                           indent=2, default=str))
        print(f"\nwrote {args.out / 'simulate.json'}")
    return 0
