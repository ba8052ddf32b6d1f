"""The table `deadpool bench overhead` prints per cell: step times, ratios, CPU per step, the copy limit."""

from __future__ import annotations

import math
import statistics
from typing import Any


def table(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    lines = [f"\n{first['size']} ({first['params']:,} parameters, batch {first['batch_size']} per rank) x "
             f"{first['ranks']} ranks; mean step time over steps {first['warmup_steps'] + 1}..{first['steps']}, "
             f"median (min..max) of {first['rounds']} rounds",
             f"{'variant':>28} {'step':>10} {'ratio to off':>14} {'spread':>20} {'blocked':>8} "
             f"{'job CPU per step':>20} {'training thread CPU':>21} {'CPU beside training':>21} "
             f"{'MB copied/hashed/sent per step':>31} {'copy limit':>11} {'cost / limit':>12} "
             f"{'CPU cost / bytes CPU':>20} {'engine per snapshot (CPU)':>25}"]
    for row in rows:
        label = row["variant"]
        if row["chosen_every"]:  # per run, the intervals `auto` agreed on in turn
            runs = row.get("agreed_every") or [[every] for every in row["chosen_every"]]
            label += f" ({','.join('>'.join(map(str, agreed)) for agreed in runs)})"
        spread = f"{row['min_step_s'] * 1e3:.1f}..{row['max_step_s'] * 1e3:.1f} ms"
        lines.append(f"{label:>28} {row['median_step_s'] * 1e3:>7.1f} ms {row['ratio']:>14.3f} {spread:>20} "
                     f"{row['wait_fraction']:>8.2%} {_cpu(row, 'job_cpu'):>20} {_cpu(row, 'train_cpu'):>21} "
                     f"{_cpu(row, 'beside_cpu'):>21}"
                     f"{_limit_columns(row.get('copy_limit'))}")
        if row["snapshot_every"] == "auto" and not all(row["snapshots_in_window"]):
            every = max(row["chosen_every"])
            extra = next((r["median_step_s"] - r_off["median_step_s"] for r in rows for r_off in rows
                          if r["variant"] == "deadpool-every-1" and r_off["variant"] == "deadpool-off"), None)
            estimate = f"; every-1's extra time / {every} = {extra / every / row['median_step_s']:.2%} of a step" \
                if extra is not None else ""
            window = row["steps"] - row["warmup_steps"]
            lines.append(f"{'':>28} note: auto snapshots every {every} steps, and the {window} measured steps "
                         f"held {min(row['snapshots_in_window'])}: this figure leaves its cost out"
                         f"{estimate}; measure with --steps above {row['warmup_steps'] + every}")
        if len(row["paired_ratios"]) > 1 and row["variant"] != row["baseline"]:
            lines.append(f"{'':>28} per round, against {row['baseline']} in the same round: "
                         f"{_ratios(row['paired_ratios'])}")
        if "against_ddp" in row:
            ddp = row["against_ddp"]
            lines.append(f"{'':>28} against torch DDP (dcp-off): x{ddp['ratio']:.3f} (medians); per round "
                         f"{_ratios(ddp['paired_ratios'])}")
        if row["saves_after_window"]:
            lines.append(f"{'':>28} note: {row['saves_after_window']} async saves still writing after the last "
                         f"step: their background cost is partly unmeasured; use more --steps")
    return "\n".join(lines)


def paired(runs: list[dict[str, Any]], baselines: list[dict[str, Any]]) -> list[float]:
    """Each round's step time over its baseline's in the same round. The rounds run one after the other, so
    a machine that drifts (here 15-20 % over a bench) moves both runs of a round alike: their ratio cancels
    what the ratio of the medians, taken over different rounds, does not."""
    return [run["step_s"] / baseline["step_s"] for run, baseline in zip(runs, baselines)]


def _ratios(ratios: list[float]) -> str:
    """"x0.930, x1.110, .. (median x1.018, geometric mean x1.021)"."""
    mean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    return (", ".join(f"x{r:.3f}" for r in ratios)
            + f" (median x{statistics.median(ratios):.3f}, geometric mean x{mean:.3f})")


def _limit_columns(limit: dict[str, Any] | None) -> str:
    if limit is None:
        return ""
    moved = "/".join(f"{limit[k] / 1e6:.0f}" for k in ("copied_bytes", "hashed_bytes", "sent_bytes"))
    bound = f"{limit['bound_s'] * 1e3:.1f} ms" if limit["bound_s"] is not None else "-"
    busy = f"{limit['snapshot_busy_s'] * 1e3:.0f} ms" if limit["snapshot_busy_s"] is not None else "-"
    if limit.get("snapshot_cpu_s") is not None:
        busy += f" ({limit['snapshot_cpu_s'] * 1e3:.1f} ms)"
    cpu = limit.get("cpu_multiple")
    if cpu is not None:
        cpu_text = f"{limit['cpu_cost_s'] * 1e3:.0f}/{limit['bound_cpu_s'] * 1e3:.0f} ms {_multiple(cpu)}"
    else:
        cpu_text = "-"
    return f" {moved:>31} {bound:>11} {_multiple(limit['multiple']):>12} {cpu_text:>20} {busy:>25}"


def _multiple(value: float | None) -> str:
    return "-" if value is None else "noise" if value <= 0 else f"{value:.1f}x"  # <= 0: cheaper than off


def _cpu(row: dict[str, Any], key: str) -> str:
    """CPU seconds per step and their ratio to the baseline's, e.g. "812 ms x1.031" ("-" where not sampled)."""
    value, ratio = row.get(f"median_{key}_s"), row.get(f"{key}_ratio")
    if value is None:
        return "-"
    return f"{value * 1e3:.0f} ms" + ("" if ratio is None else f" x{ratio:.3f}")
