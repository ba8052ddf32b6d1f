"""The benchmark harness's own logic (not timings): rows, timelines, summaries and plots from given events."""

from __future__ import annotations

import pytest

from deadpool.bench.overhead import summarize
from deadpool.bench.plots import plot_overhead, plot_recovery, timeline
from deadpool.bench.recovery import recovery_row, table


def step(rank: int, step: int, t: float, loss: float = 1.0) -> dict:
    return {"event": "step", "rank": rank, "step": step, "t": t, "loss": loss}


def kill(step: int, t: float) -> dict:
    return {"event": "fault_injected", "kind": "kill", "step": step, "t": t}


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
    row = recovery_row("torchrun", 1, torchrun_like(), REFERENCE, samples_per_step=32)
    assert row == {"system": "torchrun", "rep": 1, "kill_step": 6, "resumed_from": 3,
                   "kill_to_next_step_s": 9.0 - 5.5, "kill_to_frontier_s": 11.0 - 5.5,
                   "steps_lost": 2, "samples_lost": 64, "bitwise_equal": True}


def test_row_sees_a_different_final_state_or_loss():
    changed_state = torchrun_like()[:-1] + [finished(0, "other")]
    assert recovery_row("x", 0, changed_state, REFERENCE, 1)["bitwise_equal"] is False
    changed_loss = [dict(e, loss=2.0) if e["event"] == "step" and e["step"] == 8 else e for e in torchrun_like()]
    assert recovery_row("x", 0, changed_loss, REFERENCE, 1)["bitwise_equal"] is False


def test_timeline_of_a_restart():
    assert timeline(torchrun_like()) == [("restart processes", 0.0, 1.5), ("rendezvous + load checkpoint", 1.5, 2.5),
                                         ("to next step", 2.5, 3.5), ("replay to kill step", 3.5, 5.5)]


def test_timeline_of_a_hot_swap():
    events = [step(0, s, float(s)) for s in range(1, 6)] + [kill(6, 5.5)] + [
        {"event": "failure_detected", "t": 5.625}, {"event": "plan_published", "t": 5.75},
        {"event": "restore_decided", "t": 6.0}, {"event": "swap_complete", "t": 6.25}, step(0, 6, 6.5)]
    assert timeline(events) == [("detect", 0.0, 0.125), ("decide", 0.125, 0.25), ("report", 0.25, 0.5),
                                ("restore + rebuild", 0.5, 0.75), ("to next step", 0.75, 1.0)]


def test_overhead_summary_ratios_and_spread():
    rounds = {0: [{"median_step_s": 1.0, "wait_fraction": 0.0, "chosen_every": None},
                  {"median_step_s": 2.0, "wait_fraction": 0.0, "chosen_every": None},
                  {"median_step_s": 1.5, "wait_fraction": 0.0, "chosen_every": None}],
              "auto": [{"median_step_s": 3.0, "wait_fraction": 0.25, "chosen_every": 7}]}
    off, auto = summarize(rounds)
    assert (off["median_step_s"], off["ratio"], off["min_step_s"], off["max_step_s"]) == (1.5, 1.0, 1.0, 2.0)
    assert (auto["ratio"], auto["wait_fraction"], auto["chosen_every"]) == (2.0, 0.25, [7])


def test_table_lists_each_system_once_with_median_and_range():
    rows = [recovery_row("torchrun", r, torchrun_like(), REFERENCE, 1) for r in range(3)]
    lines = table(rows).splitlines()
    assert len(lines) == 2 and "3.50 s (3.50..3.50)" in lines[1] and lines[1].split()[-1] == "True"


def test_plots_are_written_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [recovery_row("torchrun", 0, torchrun_like(), REFERENCE, 1)]
    scale = [{"axis": "world", "workers": 2, "kill_to_next_step_s": 1.0, "snapshot_bytes": 1},
             {"axis": "state", "workers": 4, "kill_to_next_step_s": 1.0, "snapshot_bytes": 2e6}]
    paths = plot_recovery(tmp_path, rows, scale, {"torchrun": timeline(torchrun_like())})
    paths.append(plot_overhead(tmp_path, {"0": [0.3, 0.31], "1": [0.36, 0.37]}))
    assert [p.name for p in paths] == ["recovery_times.png", "recovery_timeline.png", "recovery_scaling.png",
                                       "overhead.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
