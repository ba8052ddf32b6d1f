"""Computes a run's summary (swaps, per-phase recovery timings, final loss and state hash) from its events."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from deadpool.events import read_events


def final_losses(events: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """rank -> step -> loss of the step's last execution (a replayed step replaces the failed attempt)."""
    losses: dict[int, dict[int, float]] = {}
    for e in events:
        if e["event"] == "step":
            losses.setdefault(e["rank"], {})[e["step"]] = e["loss"]
    return losses


def _recovery(events: list[dict[str, Any]], done: dict[str, Any]) -> dict[str, Any]:
    """One swap's timeline, from the kill (or its detection) to being back where the failure struck."""
    gen = done["gen"]
    detected = next(e for e in events if e["event"] == "failure_detected" and e["gen"] == gen - 1)
    # an injected kill explains this failure only if it came after the previous generation began
    began = max((e["t"] for e in events if e["event"] == "plan_published" and e["gen"] == gen - 1), default=float("-inf"))
    kill = next((e for e in reversed(events) if e["event"] == "fault_injected" and e["kind"] == "kill"
                 and began <= e["t"] <= detected["t"]), None)
    t_fail = kill["t"] if kill else detected["t"]
    completed = [e["step"] for e in events if e["event"] == "step" and e["t"] < t_fail]
    kill_step = kill["step"] if kill else max(completed, default=0) + 1
    published = next(e for e in events if e["event"] == "plan_published" and e["gen"] == gen)
    decided = next(e for e in events if e["event"] == "restore_decided" and e["gen"] == gen)
    recovered = [e for e in events if e["event"] == "recovered" and e["gen"] == gen]
    steps = [e for e in events if e["event"] == "step" and e["gen"] == gen]
    t_next = min((e["t"] for e in steps), default=None)
    t_frontier = min((e["t"] for e in steps if e["step"] >= kill_step), default=None)
    target = done["restored_step"]
    return {
        "generation": gen,
        "cause": done["cause"],
        "failed_rank": detected["failed_rank"],
        "replaced": done["replaced"],
        "kill_step": kill_step,
        "restored_step": target,
        "steps_replayed": max(0, kill_step - 1 - target),
        "detect_s": detected["t"] - t_fail,
        "decide_s": published["t"] - detected["t"],
        "report_s": decided["t"] - published["t"],
        "restore_s": max((e["restore_s"] for e in recovered), default=None),
        "rebuild_s": max((e["rebuild_s"] for e in recovered), default=None),
        "resume_s": done["t"] - t_fail,
        "replay_s": None if t_frontier is None else t_frontier - done["t"],
        "total_s": None if t_next is None else t_next - t_fail,
        "kill_to_next_step_s": None if t_next is None else t_next - t_fail,
        "kill_to_frontier_s": None if t_frontier is None else t_frontier - t_fail,
    }


def summarize(path: Path, exit_code: int) -> dict[str, Any]:
    events = list(read_events(path))
    losses = final_losses(events)
    recoveries = [_recovery(events, e) for e in events if e["event"] == "swap_complete"]
    finished = {e["rank"]: e for e in events if e["event"] == "finished"}
    hashes = [finished[r]["state_sha256"] for r in sorted(finished)]
    rank0 = losses.get(0, {})
    failed = next((e for e in events if e["event"] == "job_failed"), None)
    return {
        "exit_code": exit_code,
        "error": failed["reason"] if failed else None,
        "swaps": len(recoveries),
        "recoveries": recoveries,
        "steps_replayed": sum(r["steps_replayed"] for r in recoveries),
        "final_step": max(rank0, default=0),
        "final_loss": rank0[max(rank0)] if rank0 else None,
        "final_state_sha256": hashlib.sha256("".join(hashes).encode()).hexdigest() if hashes else None,
        "rank_state_sha256": hashes,
        "losses": {str(r): [steps[s] for s in sorted(steps)] for r, steps in sorted(losses.items())},
    }
