"""Fits the swap cost model's report, rebuild, transfer and restore terms to kill -> recover runs (one point
per run, as scripts/bench_sim_fit.py collects them), and reads a fit back from its JSON.

A point is one recovery of a whole-node SIGKILL, from the run's events:

    ranks          world size of the job
    detect_s, decide_s, report_s   the coordinator's phases (report.py)
    rebuild_s      the slowest `recovered` rebuild among the ranks that resent nothing (a resend is timed apart)
    restore_s, restore_bytes       the slowest rank's restore and the bytes of one rank's snapshot
    resends        [(bytes, send_s)]: each `snapshot_resent`, connecting to a new holder and streaming to it;
                   a run's resends go to the one idle spare at once, so together they are one point: all their
                   bytes through that spare's link, in the time the longest took

Each term is an ordinary least-squares line: report and rebuild against ranks, over the points of the smallest
state only (a report checks the held snapshots' checksums, and a rank that resends holds the others up in the
agreement that closes the rebuild, so both grow with the state too); a resend's seconds against its bytes
(intercept: connecting; slope: 1 / bandwidth) and a restore's against its bytes through the origin, over all.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The coefficients a fit yields, in SwapCoefficients' field names.
FITTED = ("report_s", "report_per_rank_s", "rebuild_s", "rebuild_per_rank_s", "transfer_s", "link_bytes_per_s",
          "restore_bytes_per_s")
MEASURED = ("exit_notice_s", "decide_s")
# Measured apart from the points (scripts/bench_sim_fit.py's store benchmark), required in a fit file too.
STORE = ("coordinator_per_rank_s",)


def _line(xs: Sequence[float], ys: Sequence[float], what: str) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; a fit needs two distinct x values."""
    if len(set(xs)) < 2:
        raise ValueError(f"fitting {what} needs points at two different values at least, got {sorted(set(xs))}")
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def fit_points(points: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The coefficients of sim/scale.py's phase costs, fitted to the points (see the module docstring). A
    negative slope or intercept, which noise can give where a term is flat, is clamped to 0: a phase never
    gets cheaper with more ranks (the model requires non-negative coefficients)."""
    smallest = min(p["snapshot_bytes"] for p in points)
    base = [p for p in points if p["snapshot_bytes"] == smallest]
    ranks = [float(p["ranks"]) for p in base]
    report_s, report_per_rank_s = _line(ranks, [p["report_s"] for p in base], "the report phase")
    rebuild_s, rebuild_per_rank_s = _line(ranks, [p["rebuild_s"] for p in base], "the rebuild phase")
    resent = [p["resends"] for p in points if p["resends"]]
    transfer_s, per_byte = _line([sum(b for b, _ in r) for r in resent], [max(s for _, s in r) for r in resent],
                                 "the transfer")
    if per_byte <= 0:
        raise ValueError(f"the resends' seconds do not grow with their bytes (slope {per_byte:.3g} s/B): vary the "
                         "state size more")
    restore = [(float(p["restore_bytes"]), float(p["restore_s"])) for p in points]
    restore_per_byte = statistics.linear_regression([b for b, _ in restore], [s for _, s in restore],
                                                    proportional=True).slope
    return {"exit_notice_s": statistics.median(p["detect_s"] for p in points),
            "decide_s": statistics.median(p["decide_s"] for p in points),
            "report_s": max(0.0, report_s), "report_per_rank_s": max(0.0, report_per_rank_s),
            "rebuild_s": max(0.0, rebuild_s), "rebuild_per_rank_s": max(0.0, rebuild_per_rank_s),
            "transfer_s": max(0.0, transfer_s), "link_bytes_per_s": 1.0 / per_byte,
            "restore_bytes_per_s": 1.0 / restore_per_byte}


def read_fit(path: Path) -> dict[str, float]:
    """The coefficients of a fit JSON that scripts/bench_sim_fit.py wrote (its "coefficients" object)."""
    try:
        found = json.loads(path.read_text())["coefficients"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--fit: cannot read the coefficients of {path} ({error}); give the JSON that "
                         "scripts/bench_sim_fit.py wrote") from None
    names = (*MEASURED, *FITTED, *STORE)
    missing = [name for name in names if not isinstance(found.get(name), (int, float))]
    if missing:
        raise ValueError(f"--fit: {path} lacks a number for {', '.join(missing)}")
    return {name: float(found[name]) for name in names}
