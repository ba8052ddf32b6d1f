"""The benchmark harness's own logic (not timings): rows, timelines, summaries and plots from given events."""

from __future__ import annotations

import pytest

from deadpool.bench.plots import plot_overhead, plot_recovery, timeline
from deadpool.bench.recovery import fault_kinds, recovery_row, table
from deadpool.errors import ConfigError


def step(rank: int, step: int, t: float, loss: float = 1.0, position: int | None = None) -> dict:
    """A completed step that trained on the rank's batch at `position` of its shard (default: the step)."""
    sample = rank * 1000 + (step if position is None else position)
    return {"event": "step", "rank": rank, "step": step, "t": t, "loss": loss, "samples": [sample]}


def kill(step: int, t: float, kind: str = "kill") -> dict:
    return {"event": "fault_injected", "kind": kind, "step": step, "t": t}


def finished(rank: int, digest: str) -> dict:
    return {"event": "finished", "rank": rank, "state_sha256": digest, "t": 99.0}


REFERENCE = [step(0, s, float(s)) for s in range(1, 9)] + [finished(0, "h")]


def torchrun_like() -> list[dict]:
    """Killed in step 6 (5 finished), restarted from the checkpoint of step 3, then steps 4..8 again."""
    before = [step(0, s, float(s)) for s in range(1, 6)]
    after = [{"event": "process_start", "rank": 0, "t": 7.0}, {"event": "resumed", "rank": 0, "t": 8.0}]
    after += [step(0, s, 8.0 + s - 3) for s in range(4, 9)]
    return before + [kill(6, 5.5)] + after + [finished(0, "h")]


def test_row_for_a_restart_from_an_older_checkpoint():
    row = recovery_row("torchrun", 1, torchrun_like(), REFERENCE)
    assert row == {"system": "torchrun", "fault": "kill", "rep": 1, "kill_step": 6, "spare_warm_before_fault": None,
                   "resumed_from": 3,
                   "fault_to_next_step_s": 9.0 - 5.5, "fault_to_frontier_s": 11.0 - 5.5,
                   "steps_lost": 2, "samples_lost": 0, "samples_unexpected": 0, "bitwise_equal": True}


def test_row_sees_a_different_final_state_or_loss():
    changed_state = torchrun_like()[:-1] + [finished(0, "other")]
    assert recovery_row("x", 0, changed_state, REFERENCE)["bitwise_equal"] is False
    changed_loss = [dict(e, loss=2.0) if e["event"] == "step" and e["step"] == 8 else e for e in torchrun_like()]
    assert recovery_row("x", 0, changed_loss, REFERENCE)["bitwise_equal"] is False


def test_timeline_of_a_restart():
    assert timeline(torchrun_like()) == [("restart processes", 0.0, 1.5), ("rendezvous + load checkpoint", 1.5, 2.5),
                                         ("to next step", 2.5, 3.5), ("replay to kill step", 3.5, 5.5)]


def test_timeline_of_a_run_that_never_recovered_is_empty():
    assert timeline(stalled_after_hang()) == []


def test_timeline_of_a_hot_swap():
    events = [step(0, s, float(s)) for s in range(1, 6)] + [kill(6, 5.5)] + [
        {"event": "failure_detected", "t": 5.625}, {"event": "plan_published", "t": 5.75},
        {"event": "restore_decided", "t": 6.0}, {"event": "swap_complete", "t": 6.25}, step(0, 6, 6.5)]
    assert timeline(events) == [("detect", 0.0, 0.125), ("decide", 0.125, 0.25), ("report", 0.25, 0.5),
                                ("restore + rebuild", 0.5, 0.75), ("to next step", 0.75, 1.0)]


def test_table_lists_each_system_once_with_median_and_range():
    rows = [recovery_row("torchrun", r, torchrun_like(), REFERENCE) for r in range(3)]
    lines = table(rows).splitlines()
    assert len(lines) == 2 and "3.50 s (3.50..3.50)" in lines[1] and lines[1].split()[-1] == "True"


def stalled_after_hang() -> list[dict]:
    """Stopped in step 6 (5 finished); nothing completed after it before the benchmark gave up."""
    return [step(0, s, float(s)) for s in range(1, 6)] + [kill(6, 5.5, kind="hang")]


def test_row_measures_from_a_hang_like_from_a_kill():
    hung = [kill(6, 5.5, kind="hang") if e["event"] == "fault_injected" else e for e in torchrun_like()]
    row = recovery_row("torchrun", 0, hung, REFERENCE)
    assert row == {**recovery_row("torchrun", 0, torchrun_like(), REFERENCE), "fault": "hang"}


def test_row_of_a_run_that_never_recovered_has_no_times():
    row = recovery_row("torchrun", 0, stalled_after_hang(), REFERENCE)
    assert row == {"system": "torchrun", "fault": "hang", "rep": 0, "kill_step": 6, "spare_warm_before_fault": None,
                   "resumed_from": None,
                   "fault_to_next_step_s": None, "fault_to_frontier_s": None,
                   "steps_lost": None, "samples_lost": 3,  # steps 6..8 never trained
                   "samples_unexpected": 0, "bitwise_equal": False}  # no finished event


def test_row_refuses_a_run_whose_fault_never_fired():
    with pytest.raises(ValueError, match="never fired"):
        recovery_row("x", 0, REFERENCE, REFERENCE)


def test_table_puts_a_systems_faults_side_by_side_and_says_which_never_recovered():
    rows = [recovery_row("deadpool", 0, torchrun_like(), REFERENCE),
            recovery_row("torchrun", 0, torchrun_like(), REFERENCE),
            recovery_row("deadpool", 0, stalled_after_hang(), REFERENCE),
            recovery_row("torchrun", 0, stalled_after_hang(), REFERENCE),
            recovery_row("torchrun", 1, [kill(6, 5.5, kind="hang") if e["event"] == "fault_injected" else e
                                         for e in torchrun_like()], REFERENCE)]
    lines = table(rows, hang_wait_s=120).splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [["deadpool", "kill"], ["deadpool", "hang"],
                                                         ["torchrun", "kill"], ["torchrun", "hang"]]
    assert lines[2].count("no recovery within 120 s") == 2 and lines[2].split()[-3:] == ["-", "3", "False"]
    assert "3.50 s (3.50..3.50), 1 none" in lines[4] and lines[4].split()[-3:] == ["2/-", "0/3", "False"]


def test_fault_kinds_are_parsed_in_order_and_checked():
    assert fault_kinds("kill,hang") == ("kill", "hang")
    assert fault_kinds(" hang , kill,hang") == ("hang", "kill")
    assert fault_kinds("node,kill") == ("node", "kill")
    for bad in ("", "kill,stop", ","):
        with pytest.raises(ConfigError, match="--faults"):
            fault_kinds(bad)


def test_plots_are_written_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [recovery_row("torchrun", 0, torchrun_like(), REFERENCE),
            recovery_row("torchrun", 0, stalled_after_hang(), REFERENCE)]  # a None time is left out
    scale = [{"axis": "world", "workers": 2, "fault_to_next_step_s": 1.0, "snapshot_bytes": 1},
             {"axis": "world", "workers": 4, "fault_to_next_step_s": None, "snapshot_bytes": 1},
             {"axis": "state", "workers": 4, "fault_to_next_step_s": 1.0, "snapshot_bytes": 2e6}]
    paths = plot_recovery(tmp_path, rows, scale, {"torchrun, kill": timeline(torchrun_like()),
                                                  "torchrun, hang": timeline(stalled_after_hang())})
    paths.append(plot_overhead(tmp_path, {"3M x 4 ranks": {"deadpool-off": [0.3, 0.31],
                                                            "deadpool-every-1": [0.36, 0.37]}}))
    assert [p.name for p in paths] == ["recovery_times.png", "recovery_timeline.png", "recovery_scaling.png",
                                       "overhead.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def torchft_like() -> tuple[list[dict], list[dict]]:
    """Two replicas; replica 1 killed in step 4. Replica 0's all-reduce fails (step 4 discarded, its batch
    at position 4 consumed), it gets a quorum without replica 1 and commits steps 4 and 5 alone on the
    batches at positions 5 and 6; replica 1, restarted, heals from replica 0 after step 5 (taking its
    data position) and both commit step 6 on position 7. Returns (run, failure-free run)."""
    reference = [step(r, s, float(s)) for s in range(1, 7) for r in (0, 1)] + [finished(0, "h"), finished(1, "h")]
    events = [step(r, s, float(s)) for s in range(1, 4) for r in (0, 1)] + [
        kill(4, 3.5), {"event": "step_discarded", "rank": 0, "step": 4, "t": 3.625},
        {"event": "quorum", "rank": 0, "t": 8.0}, step(0, 4, 8.5, position=5), step(0, 5, 9.5, position=6),
        {"event": "process_start", "rank": 1, "t": 5.0}, {"event": "healed", "rank": 1, "t": 9.75},
        step(0, 6, 10.5, position=7), step(1, 6, 10.5, position=7), finished(0, "x"), finished(1, "x")]
    return events, reference


def test_row_for_torchft_counts_skipped_batches_by_sample_id():
    events, reference = torchft_like()
    row = recovery_row("torchft", 0, events, reference)
    assert row == {"system": "torchft", "fault": "kill", "rep": 0, "kill_step": 4, "spare_warm_before_fault": None,
                   "resumed_from": 3,
                   "fault_to_next_step_s": 8.5 - 3.5, "fault_to_frontier_s": 8.5 - 3.5, "steps_lost": 0,
                   "samples_lost": 4,  # replica 0's discarded batch 4; replica 1's 4 (in flight), 5 and 6
                   "samples_unexpected": 2,  # both replicas' batch 7, past the failure-free run's end
                   "bitwise_equal": False}  # one replica fewer averaged in steps 4 and 5


def test_a_replayed_step_counts_its_samples_once_and_a_swapped_in_spare_loses_none():
    """DeadPool's spare steps as the rank it took over, on the same batches, so nothing is missing."""
    reference = [step(r, s, float(s)) for s in range(1, 5) for r in (0, 1)]
    events = [step(r, s, float(s)) for s in range(1, 4) for r in (0, 1)] + [kill(4, 3.5)]
    events += [step(r, s, float(s) + 1) for s in range(3, 5) for r in (0, 1)]  # rolled back to 2: 3 again
    row = recovery_row("deadpool", 0, events, reference)
    assert (row["steps_lost"], row["samples_lost"], row["samples_unexpected"]) == (1, 0, 0)


def test_a_survivor_finishing_the_step_before_the_fault_late_is_not_a_recovery():
    """Rank 1 faults in step 5 while rank 0 is still finishing step 4 (seen with a small model on two
    cores): rank 0's step 4 ends after the fault, but the first step of the recovery is the replay of 3."""
    reference = [step(r, s, float(s)) for s in range(1, 6) for r in (0, 1)]
    events = [dict(step(r, s, float(s)), pid=10 + r) for s in range(1, 5) for r in (0, 1) if (r, s) != (0, 4)]
    events += [kill(5, 4.5, kind="hang"), dict(step(0, 4, 4.51), pid=10)]
    events += [dict(step(r, s, 6.0 + s), pid=10 if r == 0 else 20)  # pid 20: the spare, now rank 1
               for s in range(3, 6) for r in (0, 1)]
    row = recovery_row("deadpool", 0, events, reference)
    assert (row["resumed_from"], row["fault_to_next_step_s"], row["steps_lost"]) == (2, 9.0 - 4.5, 2)
    assert timeline(events)[0] == ("to next step", 0.0, 9.0 - 4.5)


def test_a_run_without_sample_ids_is_refused():
    bare = [{k: v for k, v in e.items() if k != "samples"} for e in torchrun_like()]
    with pytest.raises(ValueError, match="no sample ids"):
        recovery_row("x", 0, bare, REFERENCE)


def test_timeline_of_a_torchft_recovery():
    events, _ = torchft_like()
    assert timeline(events) == [("all-reduce fails, step discarded", 0.0, 0.125),
                                ("wait for new quorum", 0.125, 4.5), ("to next step", 4.5, 5.0),
                                ("reduced size until rejoin", 5.0, 6.25)]


def test_table_shows_samples_lost():
    events, reference = torchft_like()
    lines = table([recovery_row("torchft", 0, events, reference)]).splitlines()
    assert "samples lost" in lines[0] and lines[1].split()[-2:] == ["4", "False"]


def test_torchft_recovers_a_killed_replica(tmp_path):
    """Real processes: two torchft replicas of a small GPT, replica 1 SIGKILLed in step 4 and restarted."""
    pytest.importorskip("torchft")
    from deadpool.bench.baselines.run_torchft import run_torchft

    small = ("--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2")
    code, events = run_torchft(tmp_path, workers=2, steps=8, kill=(1, 4), script_args=small, timeout_s=90)
    assert code == 0, (tmp_path / "torchft.log").read_text()[-3000:]
    assert any(e["event"] == "step_discarded" and e["rank"] == 0 and e["step"] == 4 for e in events)
    healed = [e for e in events if e["event"] == "healed"]
    assert [(e["rank"], e["attempt"]) for e in healed] == [(1, 1)] and healed[0]["from_step"] >= 3
    assert sorted(e["step"] for e in events if e["event"] == "step" and e["rank"] == 0) == list(range(1, 9))
    hashes = {(e["rank"], e["attempt"]): e["state_sha256"] for e in events if e["event"] == "finished"}
    assert set(hashes) == {(0, 0), (1, 1)} and len(set(hashes.values())) == 1  # the healed replica agrees
