"""Tests for deadpool/report.py: a run's summary computed from a synthetic events.jsonl.

Times are multiples of 1/8 so that every difference below is exact in floating point.
"""

import hashlib
import json

from deadpool.config import Fault
from deadpool.report import final_losses, summarize
from deadpool.runtime.cadence import longest_gap


def ev(event: str, t: float, gen: int, rank: int | None = None, **fields) -> dict:
    return {"event": event, "t": t, "wall": 1e9 + t, "role": "worker", "proc": "w?", "rank": rank, "gen": gen,
            "pid": 100, **fields}


def steps(gen: int, first: int, last: int, t0: float, losses: dict[int, float]) -> list[dict]:
    """Both ranks complete steps first..last, one every 1/8 s from t0."""
    out = []
    for i, step in enumerate(range(first, last + 1)):
        for rank in (0, 1):
            out.append(ev("step", t0 + i / 8, gen, rank, step=step, loss=losses[step] + rank, dur_s=0.1, wait_s=0.0,
                          replay=False))
    return out


def write(path, events, torn: bool = False):
    with open(path, "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        if torn:
            f.write('{"event": "step", "t": 99.0, "gen"')


GEN0_LOSS = {1: 4.0, 2: 3.5, 3: 3.25, 4: 3.0, 5: 2.75, 6: 2.5}
GEN1_LOSS = {6: 2.375, 7: 2.25, 8: 2.125}  # step 6 is replayed with a different loss: the replay wins


def one_swap_events() -> list[dict]:
    """w1 (rank 1) is killed in the backward of step 7 at t=10; s0 takes over from committed step 5."""
    events = steps(0, 1, 6, 9.0, GEN0_LOSS)  # t = 9.0 .. 9.625
    events += [
        ev("fault_injected", 10.0, 0, 1, kind="kill", target_rank=1, step=7, phase="backward"),
        ev("failure_detected", 10.5, 0, None, proc="w1", failed_rank=1, exit="killed by SIGKILL", returncode=-9),
        ev("plan_published", 10.625, 1, None, ranks=["w0", "s0"], holders=[[], []], spares=[], reason="r"),
        ev("restore_decided", 11.0, 1, None, target=5, reason="restore committed step 5",
           holdings={"0": [5], "1": [5]}),
        ev("recovered", 11.25, 1, 0, restored_step=5, frontier=6, negotiate_s=0.125, restore_s=0.25, rebuild_s=0.5,
           total_s=0.875),
        ev("recovered", 11.375, 1, 1, restored_step=5, frontier=6, negotiate_s=0.125, restore_s=0.375,
           rebuild_s=0.125, total_s=0.625),
        ev("swap_complete", 11.5, 1, None, restored_step=5, replaced={"1": "s0"},
           cause="rank 1 (w1, pid 100) killed by SIGKILL", detect_to_resume_s=1.0, detected_t=10.5,
           failed=[{"proc": "w1", "rank": 1, "exit": "killed by SIGKILL"}], hang=None),
    ]
    events += steps(1, 6, 8, 12.0, GEN1_LOSS)  # step 6 at 12.0, step 7 (the frontier) at 12.125
    events += [ev("finished", 12.5, 1, 0, step=8, state_sha256="aa", entry_sha256={}),
               ev("finished", 12.5, 1, 1, step=8, state_sha256="bb", entry_sha256={})]
    return events


def test_one_swap_summary(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, one_swap_events(), torn=True)
    summary = summarize(path, exit_code=0)
    assert summary["recoveries"] == [{
        "generation": 1,
        "cause": "rank 1 (w1, pid 100) killed by SIGKILL",
        "fault": "kill",
        "failed_rank": 1,
        "failed_ranks": [1],
        "replaced": {"1": "s0"},
        "kill_step": 7,
        "restored_step": 5,
        "steps_replayed": 1,            # step 6 completed before the kill and runs again
        "detect_s": 0.5,                # kill -> failure_detected
        "decide_s": 0.125,              # failure_detected -> plan_published
        "report_s": 0.375,              # plan_published -> restore_decided
        "restore_s": 0.375,             # slowest rank
        "rebuild_s": 0.5,               # slowest rank
        "resume_s": 1.5,                # kill -> swap_complete
        "replay_s": 0.625,              # swap_complete -> first step >= kill step
        "fault_to_next_step_s": 2.0,    # kill -> first step of the new generation
        "fault_to_frontier_s": 2.125,   # kill -> first step >= kill step
    }]
    assert summary["exit_code"] == 0 and summary["error"] is None and summary["swaps"] == 1
    assert summary["steps_replayed"] == 1
    assert summary["final_step"] == 8
    assert summary["final_loss"] == 2.125
    assert summary["rank_state_sha256"] == ["aa", "bb"]
    assert summary["final_state_sha256"] == hashlib.sha256(b"aabb").hexdigest()
    assert summary["losses"] == {
        "0": [4.0, 3.5, 3.25, 3.0, 2.75, 2.375, 2.25, 2.125],
        "1": [5.0, 4.5, 4.25, 4.0, 3.75, 3.375, 3.25, 3.125],
    }


def test_final_losses_last_execution_wins():
    events = one_swap_events()
    assert final_losses(events)[0][6] == 2.375
    assert final_losses(events[:12])[0] == GEN0_LOSS  # before the failure: the first execution


def test_final_loss_of_a_replayed_last_step(tmp_path):
    # The failure strikes after the last step ran once; its replay is the final loss.
    events = one_swap_events()
    events = [e for e in events if not (e["event"] == "step" and e["gen"] == 1 and e["step"] > 6)]
    path = tmp_path / "events.jsonl"
    write(path, events)
    summary = summarize(path, exit_code=0)
    assert summary["final_step"] == 6 and summary["final_loss"] == 2.375
    rec = summary["recoveries"][0]
    assert rec["replay_s"] is None and rec["fault_to_frontier_s"] is None  # never got past the kill step
    assert rec["fault_to_next_step_s"] == 2.0


def test_clean_run(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, steps(0, 1, 3, 1.0, GEN0_LOSS) + [ev("finished", 2.0, 0, 1, state_sha256="b1"),
                                                   ev("finished", 2.0, 0, 0, state_sha256="a0")])
    summary = summarize(path, exit_code=0)
    assert summary == {
        "exit_code": 0, "error": None, "swaps": 0, "recoveries": [], "steps_replayed": 0, "final_step": 3,
        "final_loss": 3.25, "final_state_sha256": hashlib.sha256(b"a0b1").hexdigest(),
        "rank_state_sha256": ["a0", "b1"],
        "losses": {"0": [4.0, 3.5, 3.25], "1": [5.0, 4.5, 4.25]}, "replica_memory_bytes": {},
        "replica_mapped_bytes": {}, "memory": {}, "snapshot_intervals": [], "pool_refills": [],
        "faults_not_fired": [], "checkpoints": [], "persist_failures": [], "resumed_from": None, "stopped_by": None,
    }


def test_faults_that_never_fired_are_named_with_why(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, steps(0, 1, 3, 1.0, GEN0_LOSS) + [
        ev("fault_injected", 1.5, 0, 1, kind="kill", target_rank=1, step=2, phase="backward"),
        ev("fault_injected", 1.6, 0, None, kind="corrupt_replica", target_rank=0, step=2)])
    faults = (Fault(kind="kill", rank=1, step=2), Fault(kind="corrupt_replica", rank=0, step=2),  # fired
              Fault(kind="kill", rank=1, step=99), Fault(kind="hang", rank=0, step=3, phase="recovery"),
              Fault(kind="corrupt_replica", rank=1, step=1))
    assert summarize(path, exit_code=0, faults=faults)["faults_not_fired"] == [
        "fault kill:1:99:backward never fired: the run ended at step 3",
        "fault hang:0:3:recovery never fired: rank 0 never reached recovery in step 3",
        "fault corrupt_replica:1:1 never fired: no holder kept rank 1's snapshot of step 1"]


def test_pool_refills_name_the_nodes_that_joined(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, [ev("pool_refilled", 3.0, 2, nodes=[3], procs=["s2", "s3"], spares=["s2", "s3"], holders=[],
                    restored_step=5, took_s=0.75)])
    assert summarize(path, exit_code=0)["pool_refills"] == [
        {"nodes": [3], "spares": ["s2", "s3"], "restored_step": 5, "took_s": 0.75}]


def test_replica_memory_counts_what_each_holder_holds_under_the_last_plan(tmp_path):
    """s0 held both ranks, then took rank 0 over; w1 and s0 now hold each other's (two slots each)."""
    path = tmp_path / "events.jsonl"
    write(path, [
        ev("plan_published", 1.0, 0, holders=[["s0"], ["s0"]]),
        ev("replica_memory", 1.5, 0, proc="s0", of_rank=0, bytes=100),
        ev("replica_memory", 1.5, 0, proc="s0", of_rank=1, bytes=100),
        ev("replica_memory", 1.625, 0, proc="s0", of_rank=1, bytes=300),  # the slots grew
        ev("plan_published", 2.0, 1, holders=[["w1"], ["s0"]]),
        ev("replica_memory", 2.5, 1, proc="w1", of_rank=0, bytes=300),
    ])
    assert summarize(path, exit_code=0)["replica_memory_bytes"] == {"s0": 300, "w1": 300}


def test_memory_is_each_processes_peak_of_its_own_slots_and_the_replicas_it_holds(tmp_path):
    """w0's slots grow once (snapshot 0 precedes the optimizer's state); s0 holds ranks 0 and 1, then takes
    rank 0 over and drops its replica (0 bytes): its peak is both replicas at once, not the sum of events.
    Of rank 1's replica it was sent a piece (18 of 60 bytes): its two slots have 36 bytes written."""
    path = tmp_path / "events.jsonl"
    write(path, [
        ev("slot_memory", 1.0, 0, 0, proc="w0", bytes=20, slots=2, pinned=False),
        ev("replica_memory", 1.25, 0, proc="s0", of_rank=0, bytes=20, pinned=False),
        ev("slot_memory", 1.5, 0, 0, proc="w0", bytes=60, slots=2, pinned=False),
        ev("replica_memory", 1.5, 0, proc="s0", of_rank=1, bytes=60, held=18, pinned=False),  # a piece of it
        ev("replica_memory", 1.625, 0, proc="s0", of_rank=0, bytes=60, pinned=False),
        ev("replica_memory", 2.0, 1, proc="s0", of_rank=0, bytes=0, pinned=False),  # dropped: it took rank 0
        ev("slot_memory", 2.5, 1, 0, proc="s0", bytes=60, slots=2, pinned=True),
        # w1, on s0's machine, holds rank 0 now: it maps s0's two slots and allocates nothing of its own
        ev("replica_memory", 2.75, 1, proc="w1", of_rank=0, bytes=0, mapped=60, held=0, pinned=False),
    ])
    assert summarize(path, exit_code=0)["memory"] == {
        "s0": {"slots_bytes": 60, "replica_bytes": 120, "total_bytes": 120, "replica_held_bytes": 96,
               "replica_mapped_bytes": 0, "pinned": True},
        "w0": {"slots_bytes": 60, "replica_bytes": 0, "total_bytes": 60, "replica_held_bytes": 0,
               "replica_mapped_bytes": 0, "pinned": False},
        "w1": {"slots_bytes": 0, "replica_bytes": 0, "total_bytes": 0, "replica_held_bytes": 0,
               "replica_mapped_bytes": 60, "pinned": False}}


def test_auto_reports_each_agreed_interval_and_the_replay_it_implies(tmp_path):
    """The replay is the ranks' (cadence.longest_gap): at an interval of BLOCK or less the probes before each
    agreement leave a longer gap than the interval; beyond BLOCK it is the interval."""
    path = tmp_path / "events.jsonl"

    def agreed(t: float, gen: int, rank: int, step: int, every: int, step_s: float) -> dict:
        return ev("snapshot_interval", t, gen, rank, at_step=step, every=every, step_s=step_s, cost_s=0.25,
                  budget=0.01, replay_steps=longest_gap(every))

    write(path, [agreed(1.0, 0, 0, 24, 4, 0.5), agreed(1.0, 0, 1, 24, 4, 0.75), agreed(3.0, 2, 0, 24, 2, 0.25),
                 agreed(4.0, 2, 0, 74, 7, 0.25)])
    assert summarize(path, exit_code=0)["snapshot_intervals"] == [
        {"generation": 0, "step": 24, "every": 4, "step_s": 0.625, "replay_steps": 9, "replay_s": 5.625},
        {"generation": 2, "step": 24, "every": 2, "step_s": 0.25, "replay_steps": 7, "replay_s": 1.75},
        {"generation": 2, "step": 74, "every": 7, "step_s": 0.25, "replay_steps": 7, "replay_s": 1.75}]


def test_failed_job(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, steps(0, 1, 2, 1.0, GEN0_LOSS) + [
        ev("failure_detected", 2.0, 0, None, proc="w1", failed_rank=1, exit="exited with code 3", returncode=3),
        ev("job_failed", 2.125, 0, None, reason="rank 1 exited with code 3; no spare left in the pool",
           root_cause="rank 1 exited with code 3"),
    ])
    summary = summarize(path, exit_code=1)
    assert summary["exit_code"] == 1
    assert summary["error"] == "rank 1 exited with code 3; no spare left in the pool"
    assert summary["swaps"] == 0 and summary["recoveries"] == [] and summary["steps_replayed"] == 0
    assert summary["final_step"] == 2 and summary["final_loss"] == 3.5
    assert summary["final_state_sha256"] is None and summary["rank_state_sha256"] == []


def test_empty_run(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, [])
    summary = summarize(path, exit_code=2)
    assert summary["final_step"] == 0 and summary["final_loss"] is None and summary["losses"] == {}


def crash_events() -> list[dict]:
    """Rank 0 crashes on its own (no injected fault) after step 4 completed everywhere."""
    events = steps(0, 1, 4, 1.0, GEN0_LOSS)  # last step at 1.375
    events += [
        ev("failure_detected", 2.0, 0, None, proc="w0", failed_rank=0, exit="exited with code 1", returncode=1),
        ev("plan_published", 2.25, 1, None),
        ev("restore_decided", 2.5, 1, None, target=4),
        ev("recovered", 2.75, 1, 0, restore_s=0.125, rebuild_s=0.25),
        ev("recovered", 2.75, 1, 1, restore_s=0.125, rebuild_s=0.25),
        ev("swap_complete", 3.0, 1, None, restored_step=4, replaced={"0": "s0"}, cause="rank 0 crashed",
           detected_t=2.0, failed=[{"proc": "w0", "rank": 0, "exit": "exited with code 1"}], hang=None),
    ]
    events += steps(1, 5, 5, 3.5, GEN0_LOSS)
    return events


def test_recovery_without_injected_kill_starts_at_detection(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, crash_events())
    (rec,) = summarize(path, exit_code=0)["recoveries"]
    assert rec["kill_step"] == 5                  # the step after the last one completed before detection
    assert rec["steps_replayed"] == 0
    assert rec["detect_s"] == 0.0
    assert rec["decide_s"] == 0.25 and rec["report_s"] == 0.25
    assert rec["resume_s"] == 1.0 and rec["fault_to_next_step_s"] == 1.5 and rec["replay_s"] == 0.5
    assert rec["restore_s"] == 0.125 and rec["rebuild_s"] == 0.25


def two_swaps_events() -> list[dict]:
    """Swap 1: injected kill of rank 1 at step 7 (t=10). Swap 2: rank 0 crashes by itself at t=20."""
    events = one_swap_events()[:-2]  # without the finished events; gen 1 ran steps 6..8 by t=12.25
    events += [
        ev("failure_detected", 20.0, 1, None, proc="w0", failed_rank=0, exit="exited with code 1", returncode=1),
        ev("plan_published", 20.25, 2, None),
        ev("restore_decided", 20.5, 2, None, target=8),
        ev("recovered", 20.75, 2, 0, restore_s=0.125, rebuild_s=0.125),
        ev("recovered", 20.75, 2, 1, restore_s=0.125, rebuild_s=0.125),
        ev("swap_complete", 21.0, 2, None, restored_step=8, replaced={"0": "s1"}, cause="rank 0 crashed",
           detected_t=20.0, failed=[{"proc": "w0", "rank": 0, "exit": "exited with code 1"}], hang=None),
    ]
    events += steps(2, 9, 9, 21.5, {9: 2.0})
    return events


def test_two_swaps_first_is_attributed_to_its_kill(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, two_swaps_events())
    summary = summarize(path, exit_code=0)
    assert summary["swaps"] == 2
    first = summary["recoveries"][0]
    times = (first["generation"], first["kill_step"], first["detect_s"], first["fault_to_next_step_s"])
    assert times == (1, 7, 0.5, 2.0)


def test_two_swaps_second_is_not_attributed_to_the_first_kill(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, two_swaps_events())
    second = summarize(path, exit_code=0)["recoveries"][1]
    assert second["generation"] == 2
    assert second["detect_s"] == 0.0
    assert second["kill_step"] == 9
    assert second["steps_replayed"] == 0


def test_a_hang_is_timed_from_the_fault_and_detected_from_the_last_progress(tmp_path):
    """Rank 1 stops itself (SIGSTOP) at t=10; its last progress was seen at 10.125, the verdict fell at 13.25."""
    events = steps(0, 1, 6, 9.0, GEN0_LOSS)
    events += [
        ev("fault_injected", 10.0, 0, 1, kind="hang", target_rank=1, step=7, phase="backward"),
        ev("hang_detected", 13.25, 0, None, proc="w1", hung_rank=1, last_progress_t=10.125),
        ev("failure_detected", 13.375, 0, None, proc="w1", failed_rank=1, exit="hung, and fenced (SIGKILL)"),
        ev("plan_published", 13.5, 1, None),
        ev("restore_decided", 13.75, 1, None, target=6),
        ev("recovered", 14.0, 1, 0, restore_s=0.125, rebuild_s=0.125),
        ev("swap_complete", 14.0, 1, None, restored_step=6, replaced={"1": "s0"}, cause="rank 1 (w1) hung",
           detected_t=13.25, failed=[{"proc": "w1", "rank": 1, "exit": "hung, and fenced (SIGKILL)"}],
           hang={"rank": 1, "proc": "w1", "last_progress_t": 10.125, "verdict_t": 13.25}),
    ]
    events += steps(1, 7, 7, 14.5, {7: 2.0})
    path = tmp_path / "events.jsonl"
    write(path, events)
    (rec,) = summarize(path, exit_code=0)["recoveries"]
    assert rec["fault"] == "hang" and rec["kill_step"] == 7 and rec["steps_replayed"] == 0
    assert rec["detect_s"] == 3.125                 # last progress -> verdict
    assert rec["decide_s"] == 0.25                  # verdict -> plan
    assert rec["fault_to_next_step_s"] == 4.5       # SIGSTOP -> the next completed step


def test_disk_tier_lists_checkpoints_resume_and_stop(tmp_path):
    path = tmp_path / "events.jsonl"
    write(path, [ev("resumed_from_disk", 0.5, 0, 0, step=4, path="/ckpt/step-4"),
                 ev("checkpoint_persisted", 1.0, 0, None, step=6, path="/ckpt/step-6", nbytes=10, write_s=0.5,
                    total_s=0.75, gbps=2e-8),
                 ev("persist_failed", 1.5, 0, None, step=8, reason="w1: disk full"),
                 ev("job_stopped", 2.0, 0, None, by="SIGTERM", persisted=6, committed=8)])
    summary = summarize(path, exit_code=143)
    assert summary["checkpoints"] == [{"step": 6, "path": "/ckpt/step-6", "nbytes": 10, "write_s": 0.5,
                                       "total_s": 0.75, "gbps": 2e-8}]
    assert summary["persist_failures"] == [{"step": 8, "reason": "w1: disk full"}]
    assert summary["resumed_from"] == {"step": 4, "path": "/ckpt/step-4"} and summary["stopped_by"] == "SIGTERM"


def test_a_checkpoint_the_ranks_wrote_as_they_finished_counts_their_parts(tmp_path):
    """No writer reported to the coordinator (nbytes None): the bytes are the sum of the parts' (a part written
    twice counts once), the seconds the slowest part's."""
    path = tmp_path / "events.jsonl"
    write(path, [ev("persist_part", 1.0, 0, 0, proc="w0", step=9, ranks=[0], nbytes=100, seconds=0.1),
                 ev("persist_part", 1.1, 0, 0, proc="w0", step=9, ranks=[0], nbytes=100, seconds=0.2),
                 ev("persist_part", 1.2, 0, 1, proc="w1", step=9, ranks=[1], nbytes=300, seconds=0.3),
                 ev("persist_part", 1.3, 0, 1, proc="w1", step=8, ranks=[1], nbytes=999, seconds=9.0),
                 ev("checkpoint_persisted", 2.0, 0, None, step=9, path="/ckpt/step-9", nbytes=None, write_s=None,
                    total_s=None, gbps=None)])
    [checkpoint] = summarize(path, exit_code=0)["checkpoints"]
    assert checkpoint == {"step": 9, "path": "/ckpt/step-9", "nbytes": 400, "write_s": 0.3, "total_s": None,
                          "gbps": 400 / 0.3 / 1e9}
