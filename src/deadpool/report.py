"""Computes a run's summary (swaps, per-phase recovery timings, final loss and state hash, host memory,
the snapshot interval) from its events."""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path
from typing import Any

from deadpool.config import Fault
from deadpool.events import read_events


def final_losses(events: list[dict[str, Any]]) -> dict[int, dict[int, float]]:
    """rank -> step -> loss of the step's last execution (a replayed step replaces the failed attempt)."""
    losses: dict[int, dict[int, float]] = {}
    for e in events:
        if e["event"] == "step":
            losses.setdefault(e["rank"], {})[e["step"]] = e["loss"]
    return losses


def _recovery(events: list[dict[str, Any]], done: dict[str, Any]) -> dict[str, Any]:
    """One recovery's timeline, from the fault (or its detection) to being back where the failure struck.

    A recovery may span generations (a failure during a recovery is planned together with the first):
    it starts at the first detection the coordinator recorded in `done` and ends at `done`.
    """
    gen, t_detect, hang = done["gen"], done["detected_t"], done["hang"]
    # an injected fault explains this failure only if it came after the previous recovery completed
    began = max((e["t"] for e in events if e["event"] == "swap_complete" and e["t"] < t_detect), default=float("-inf"))
    faults = [e for e in events if e["event"] == "fault_injected" and e["kind"] in ("kill", "kill_node", "hang")
              and began <= e["t"] <= t_detect]
    first = min(faults, key=lambda e: e["t"], default=None)
    t_fail = first["t"] if first else (hang["last_progress_t"] if hang else t_detect)
    completed = [e["step"] for e in events if e["event"] == "step" and e["t"] < t_fail]
    fault_step = first["step"] if first else max(completed, default=0) + 1
    published = [e for e in events if e["event"] == "plan_published" and t_detect <= e["t"] <= done["t"]]
    decided = next(e for e in events if e["event"] == "restore_decided" and e["gen"] == gen)
    recovered = [e for e in events if e["event"] == "recovered" and e["gen"] == gen]
    steps = [e for e in events if e["event"] == "step" and e["gen"] == gen]
    t_next = min((e["t"] for e in steps), default=None)
    t_frontier = min((e["t"] for e in steps if e["step"] >= fault_step), default=None)
    target = done["restored_step"]
    to_next = None if t_next is None else t_next - t_fail
    to_frontier = None if t_frontier is None else t_frontier - t_fail
    return {
        "generation": gen,
        "cause": done["cause"],
        "fault": first["kind"] if first else ("hang" if hang else "exit"),
        "failed_rank": done["failed"][0]["rank"] if done["failed"] else None,
        "failed_ranks": [f["rank"] for f in done["failed"] if f["rank"] is not None],
        "replaced": done["replaced"],
        "kill_step": fault_step,
        "restored_step": target,
        "steps_replayed": max(0, fault_step - 1 - (0 if target is None else target)),  # None: began afresh
        # a hang is detected when the verdict falls, counted from the rank's last progress
        "detect_s": (hang["verdict_t"] - hang["last_progress_t"]) if hang else t_detect - t_fail,
        "decide_s": published[0]["t"] - t_detect if published else None,
        "report_s": decided["t"] - published[-1]["t"] if published else None,
        "restore_s": max((e["restore_s"] for e in recovered), default=None),
        "rebuild_s": max((e["rebuild_s"] for e in recovered), default=None),
        "resume_s": done["t"] - t_fail,
        "replay_s": None if t_frontier is None else t_frontier - done["t"],
        "fault_to_next_step_s": to_next,
        "fault_to_frontier_s": to_frontier,
    }


def replica_memory(events: list[dict[str, Any]], field: str = "bytes") -> dict[str, int]:
    """Holder -> host bytes of the replicas it holds under the last plan (two slots per held rank): of its
    own (`bytes`), or mapped from its senders on the same machine (`mapped`: runtime/arena.py)."""
    plans = [e for e in events if e["event"] == "plan_published"] or [{}]
    holds = {(holder, rank) for rank, holders in enumerate(plans[-1].get("holders", [])) for holder in holders}
    latest = {(e["proc"], e["of_rank"]): e.get(field, 0) for e in events if e["event"] == "replica_memory"}
    memory: dict[str, int] = {}
    for (holder, rank), nbytes in latest.items():
        if (holder, rank) in holds:
            memory[holder] = memory.get(holder, 0) + nbytes
    return dict(sorted(memory.items()))


def host_memory(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Process -> the peak host bytes of its own snapshot slots (`slot_memory`: 2 x its snapshot), of the
    replicas it holds (`replica_memory`, per held rank: 2 x that rank's snapshot; 0 once dropped), and of
    both at once, and whether any of it was pinned. Each slot is one arena of exactly its snapshot's bytes.

    `replica_held_bytes`: of the replicas' arenas, the bytes written (2 x what the holder was sent: under
    slices a piece and the private state). Only those are ever touched, so only those become resident:
    the rest of an unpinned arena stays address space (docs/benchmarks.md, "Host memory per process").
    `replica_mapped_bytes`: the senders' arenas a holder on their machine maps instead (runtime/arena.py):
    memory its senders' `slots_bytes` already count."""
    slots: dict[str, int] = {}
    held: dict[str, dict[int, tuple[int, int, int]]] = {}  # holder -> rank -> (arena bytes, written, mapped)
    peak: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "slot_memory":
            slots[e["proc"]] = e["bytes"]
        elif e["event"] == "replica_memory":
            held.setdefault(e["proc"], {})[e["of_rank"]] = (e["bytes"], 2 * e["held"] if "held" in e else e["bytes"],
                                                            e.get("mapped", 0))
        else:
            continue
        proc = e["proc"]
        replicas = held.get(proc, {}).values()
        now = {"slots_bytes": slots.get(proc, 0), "replica_bytes": sum(a for a, _, _ in replicas)}
        mine = peak.setdefault(proc, {"slots_bytes": 0, "replica_bytes": 0, "total_bytes": 0,
                                      "replica_held_bytes": 0, "replica_mapped_bytes": 0, "pinned": False})
        for key, nbytes in (*now.items(), ("total_bytes", sum(now.values())),
                            ("replica_held_bytes", sum(w for _, w, _ in replicas)),
                            ("replica_mapped_bytes", sum(m for _, _, m in replicas))):
            mine[key] = max(mine[key], nbytes)
        mine["pinned"] = mine["pinned"] or e.get("pinned", False)
    return dict(sorted(peak.items()))


def snapshot_intervals(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`--snapshot-every auto`: each agreement on the interval (the calibration's end, then every
    REPRICE_STEPS steps), with its generation and step, and the replay it implies: as the ranks reported it
    (cadence.longest_gap: `every` steps, more around a probe at an interval of BLOCK or less; `every` in
    events that do not say), in seconds at the ranks' median step time."""
    agreed: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e["event"] == "snapshot_interval":
            agreed.setdefault((e["gen"], e.get("at_step", 0)), []).append(e)  # 0: written before re-pricing
    out = []
    for (gen, step), chosen in sorted(agreed.items()):
        every, step_s = chosen[0]["every"], statistics.median(e["step_s"] for e in chosen)
        replay = chosen[0].get("replay_steps", every)
        out.append({"generation": gen, "step": step, "every": every, "step_s": step_s, "replay_steps": replay,
                    "replay_s": replay * step_s})
    return out


def unfired_faults(faults: tuple[Fault, ...], events: list[dict[str, Any]]) -> list[str]:
    """The planned faults that never fired, each with why, as far as the events tell: a fault that silently
    did nothing would make a test or a benchmark claim what it never showed."""
    fired = {(e["kind"], e["target_rank"], e["step"], e.get("phase")) for e in events if e["event"] == "fault_injected"}
    last = max((e["step"] for e in events if e["event"] == "step"), default=0)
    unfired = []
    for fault in faults:
        phase = None if fault.kind == "corrupt_replica" else fault.phase  # a replica's fault has no phase
        if (fault.kind, fault.rank, fault.step, phase) in fired:
            continue
        spec = f"{fault.kind}:{fault.rank}:{fault.step}" + (f":{phase}" if phase else "")
        why = (f"the run ended at step {last}" if fault.step > last else
               f"rank {fault.rank} never reached {phase} in step {fault.step}" if phase else
               f"no holder kept rank {fault.rank}'s snapshot of step {fault.step}")
        unfired.append(f"fault {spec} never fired: {why}")
    return unfired


def summarize(path: Path, exit_code: int, faults: tuple[Fault, ...] = ()) -> dict[str, Any]:
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
        "replica_memory_bytes": replica_memory(events),
        "replica_mapped_bytes": replica_memory(events, "mapped"),
        "memory": host_memory(events),
        "snapshot_intervals": snapshot_intervals(events),
        "faults_not_fired": unfired_faults(faults, events),
        "pool_refills": [{"nodes": e["nodes"], "spares": e["procs"], "restored_step": e["restored_step"],
                          "took_s": e["took_s"]} for e in events if e["event"] == "pool_refilled"],
        **disk_tier(events),
    }


def _checkpoint(persisted: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """One checkpoint written. Parts written unordered (as the ranks finished or stopped) reported to no one: their
    bytes and seconds are those of the parts' own events (the last of each writer)."""
    nbytes, write_s = persisted["nbytes"], persisted["write_s"]
    if nbytes is None:
        parts = {(e["proc"], tuple(e["ranks"])): e for e in events
                 if e["event"] == "persist_part" and e["step"] == persisted["step"]}
        nbytes = sum(e["nbytes"] for e in parts.values())
        write_s = max((e["seconds"] for e in parts.values()), default=None)
    return {"step": persisted["step"], "path": persisted["path"], "nbytes": nbytes, "write_s": write_s,
            "total_s": persisted["total_s"], "gbps": nbytes / write_s / 1e9 if nbytes and write_s else None}


def disk_tier(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoints written, the one this job resumed from, and what stopped it after persisting."""
    resumed = next((e for e in events if e["event"] == "resumed_from_disk"), None)
    stopped = next((e for e in events if e["event"] == "job_stopped"), None)
    return {
        "checkpoints": [_checkpoint(e, events) for e in events if e["event"] == "checkpoint_persisted"],
        "persist_failures": [{"step": e["step"], "reason": e["reason"]} for e in events
                             if e["event"] == "persist_failed"],
        "resumed_from": {"step": resumed["step"], "path": resumed["path"]} if resumed else None,
        "stopped_by": stopped["by"] if stopped else None,  # "SIGTERM" or "no spare"
    }
