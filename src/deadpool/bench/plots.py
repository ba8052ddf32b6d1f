"""PNG plots of the benchmarks (matplotlib, headless): step-time distributions and recovery timelines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Milestones that mark the end of each recovery phase, per system, in the order they happen.
MILESTONES: dict[str, list[tuple[str, str]]] = {
    "deadpool": [("failure_detected", "detect"), ("plan_published", "decide"), ("restore_decided", "report"),
                 ("swap_complete", "restore + rebuild")],
    "torchrun": [("process_start", "restart processes"), ("resumed", "rendezvous + load checkpoint")],
    "torchft": [("step_discarded", "all-reduce fails, step discarded"), ("quorum", "wait for new quorum")],
}


def timeline(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(phase, start, end) in seconds after the kill, from the events of one run with one kill."""
    kill = next(e for e in events if e["event"] == "fault_injected" and e["kind"] == "kill")
    later = [e for e in events if e["t"] > kill["t"]]
    system = ("deadpool" if any(e["event"] == "swap_complete" for e in later)
              else "torchft" if any(e["event"] == "step_discarded" for e in later) else "torchrun")
    phases, start = [], 0.0
    for name, label in MILESTONES[system]:
        times = [e["t"] - kill["t"] for e in later if e["event"] == name]
        if times:
            end = max(times) if name in ("resumed", "process_start") else min(times)
            phases.append((label, start, end))
            start = end
    steps = [e for e in later if e["event"] == "step"]
    first = min(e["t"] for e in steps) - kill["t"]
    back = min(e["t"] for e in steps if e["step"] >= kill["step"]) - kill["t"]
    phases.append(("to next step", start, first))
    if back > first:
        phases.append(("replay to kill step", first, back))
    healed = [e["t"] - kill["t"] for e in later if e["event"] == "healed"]
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
    """Recovery times per system (median, min..max), a timeline of one recovery per system, and
    DeadPool's recovery against world and state size."""
    plt = _pyplot()
    paths = []
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    for offset, key in ((-0.2, "kill_to_next_step_s"), (0.2, "kill_to_frontier_s")):
        values = [sorted(r[key] for r in rows if r["system"] == s) for s in systems]
        medians = [v[len(v) // 2] for v in values]
        errors = [[m - v[0] for m, v in zip(medians, values)], [v[-1] - m for m, v in zip(medians, values)]]
        ax.bar([i + offset for i in range(len(systems))], medians, width=0.4, yerr=errors, capsize=4,
               label={"kill_to_next_step_s": "SIGKILL -> next step", "kill_to_frontier_s": "SIGKILL -> back at kill step"}[key])
    ax.set_xticks(range(len(systems)), systems)
    ax.set_ylabel("seconds")
    ax.set_title("Recovery from one SIGKILL (median, min..max over repetitions)")
    ax.legend()
    paths.append(out / "recovery_times.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.8 * len(timelines)))
    colors, palette = plt.get_cmap("tab10"), {}
    for y, (system, phases) in enumerate(timelines.items()):
        for label, start, end in phases:
            first = label not in palette
            color = palette.setdefault(label, colors(len(palette) % 10))
            ax.barh(y, end - start, left=start, color=color, label=label if first else None)
    ax.set_yticks(range(len(timelines)), list(timelines))
    ax.set_xlabel("seconds after SIGKILL")
    ax.set_title("Recovery timeline (one repetition per system)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    paths.append(out / "recovery_timeline.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    if scale:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        world = [r for r in scale if r["axis"] == "world"]
        state = [r for r in scale if r["axis"] == "state"]
        left.plot([r["workers"] for r in world], [r["kill_to_next_step_s"] for r in world], "o-")
        left.set_xlabel("ranks")
        left.set_ylabel("SIGKILL -> next step (s)")
        right.plot([r["snapshot_bytes"] / 1e6 for r in state], [r["kill_to_next_step_s"] for r in state], "o-")
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
