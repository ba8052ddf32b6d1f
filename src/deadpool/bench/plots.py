"""PNG plots of the benchmarks (matplotlib, headless): step-time distributions and recovery timelines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deadpool.bench.baselines.bounded import steps_after

# Milestones that mark the end of each recovery phase, per system, in the order they happen.
MILESTONES: dict[str, list[tuple[str, str]]] = {
    "deadpool": [("failure_detected", "detect"), ("plan_published", "decide"), ("restore_decided", "report"),
                 ("swap_complete", "restore + rebuild")],
    "torchrun": [("process_start", "restart processes"), ("resumed", "rendezvous + load checkpoint")],
    "torchft": [("step_discarded", "all-reduce fails, step discarded"), ("quorum", "wait for new quorum")],
}


def timeline(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(phase, start, end) in seconds after the fault (kill or hang), from the events of one run with one
    fault; the phases reached, so none past the last milestone of a run that never recovered."""
    fault = next(e for e in events if e["event"] == "fault_injected")
    later = [e for e in events if e["t"] > fault["t"]]
    system = ("deadpool" if any(e["event"] == "swap_complete" for e in later)
              else "torchft" if any(e["event"] == "step_discarded" for e in later) else "torchrun")
    phases, start = [], 0.0
    for name, label in MILESTONES[system]:
        times = [e["t"] - fault["t"] for e in later if e["event"] == name]
        if times:
            end = max(times) if name in ("resumed", "process_start") else min(times)
            phases.append((label, start, end))
            start = end
    steps = steps_after(events, fault)
    if not steps:
        return phases
    first = min(e["t"] for e in steps) - fault["t"]
    back = min((e["t"] for e in steps if e["step"] >= fault["step"]), default=first + fault["t"]) - fault["t"]
    phases.append(("to next step", start, first))
    if back > first:
        phases.append(("replay to kill step", first, back))
    healed = [e["t"] - fault["t"] for e in later if e["event"] == "healed"]
    if healed and healed[0] > first:  # torchft trains on without the dead replica until it heals back in
        phases.append(("reduced size until rejoin", first, healed[0]))
    return phases


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_overhead(out: Path, intervals: dict[str, dict[str, list[float]]], columns: int = 2) -> Path:
    """Step-time distribution per variant (a box, the mean as a triangle), one panel per cell (size x ranks).

    Outliers are drawn: with a checkpoint every K steps they are the steps that paid for it."""
    plt = _pyplot()
    columns = max(1, min(columns, len(intervals)))
    rows = -(-len(intervals) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.6 * rows), squeeze=False)
    for ax, (cell, variants) in zip(axes.flat, intervals.items()):
        ax.boxplot([[d * 1e3 for d in v] for v in variants.values()], tick_labels=list(variants), showmeans=True,
                   flierprops={"markersize": 3})
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.set_ylabel("step time (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(cell)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes.flat[len(intervals):]:
        ax.set_visible(False)
    fig.suptitle("Failure-free step time, step end to step end (triangle: the mean)")
    path = out / "overhead.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_recovery(out: Path, rows: list[dict[str, Any]], scale: list[dict[str, Any]],
                  timelines: dict[str, list[tuple[str, float, float]]]) -> list[Path]:
    """Recovery times per system and fault (median, min..max over the runs that recovered; "no recovery"
    where none did), a timeline of one recovery per system and fault, and DeadPool's recovery against
    world and state size."""
    plt = _pyplot()
    paths = []
    systems = dict.fromkeys(r["system"] for r in rows)
    groups = [(s, f) for s in systems for f in dict.fromkeys(r["fault"] for r in rows if r["system"] == s)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4))
    for offset, key, label in ((-0.2, "fault_to_next_step_s", "fault -> next step"),
                               (0.2, "fault_to_frontier_s", "fault -> back at fault step")):
        values = [sorted(r[key] for r in rows if (r["system"], r["fault"]) == g and r[key] is not None) for g in groups]
        reached = [(i, v) for i, v in enumerate(values) if v]
        medians = [v[len(v) // 2] for _, v in reached]
        errors = [[m - v[0] for m, (_, v) in zip(medians, reached)], [v[-1] - m for m, (_, v) in zip(medians, reached)]]
        ax.bar([i + offset for i, _ in reached], medians, width=0.4, yerr=errors, capsize=4, label=label)
        for i, v in enumerate(values):
            if not v:
                ax.text(i + offset, 0, "no recovery", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{s}\n{f}" for s, f in groups], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("Recovery from one SIGKILL or SIGSTOP of a worker (median, min..max over repetitions)")
    ax.legend()
    paths.append(out / "recovery_times.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.8 * len(timelines)))
    colors = plt.get_cmap("tab10")
    palette: dict[str, Any] = {}
    for y, phases in enumerate(timelines.values()):
        if not phases:
            ax.text(0, y, "  no recovery", va="center", fontsize=8)
        for label, start, end in phases:
            first = label not in palette
            color = palette.setdefault(label, colors(len(palette) % 10))
            ax.barh(y, end - start, left=start, color=color, label=label if first else None)
    ax.set_yticks(range(len(timelines)), list(timelines))
    ax.set_xlabel("seconds after the fault")
    ax.set_title("Recovery timeline (one repetition per system and fault)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    paths.append(out / "recovery_timeline.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if scale:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        recovered = [r for r in scale if r["fault_to_next_step_s"] is not None]
        world = [r for r in recovered if r["axis"] == "world"]
        state = [r for r in recovered if r["axis"] == "state"]
        left.plot([r["workers"] for r in world], [r["fault_to_next_step_s"] for r in world], "o-")
        left.set_xlabel("ranks")
        left.set_ylabel("SIGKILL -> next step (s)")
        right.plot([r["snapshot_bytes"] / 1e6 for r in state], [r["fault_to_next_step_s"] for r in state], "o-")
        right.set_xlabel("snapshot per rank (MB)")
        for ax in (left, right):
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        fig.suptitle("DeadPool recovery time")
        paths.append(out / "recovery_scaling.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
