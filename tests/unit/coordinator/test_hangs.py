"""Tests for deadpool/coordinator/hangs.py: how long a rank may go without progress, who is hung, who is silent."""

from deadpool.coordinator.hangs import (
    HANG_FLOOR_S,
    HANG_STEP_MULTIPLE,
    HANG_UNTIMED_S,
    PROGRESS,
    SILENCE,
    Alive,
    Hung,
    Pulse,
    hang_timeout,
    hang_verdict,
    silent_processes,
)
from deadpool.coordinator.policy import Decision

# ---- hang_timeout / hang_verdict ------------------------------------------------------------

def test_hang_timeout_prefers_the_users_setting():
    assert hang_timeout(7.5, [0.1]) == Decision(7.5, "--hang-timeout 7.5 s")


def test_hang_timeout_before_any_step_is_timed():
    assert hang_timeout(None, []).value == HANG_UNTIMED_S


def test_hang_timeout_scales_with_the_slowest_step_above_a_floor():
    assert hang_timeout(None, [0.1, 0.2]).value == HANG_FLOOR_S
    decision = hang_timeout(None, [0.5, 2.0])
    assert decision.value == HANG_STEP_MULTIPLE * 2.0 and "slowest median step (2.000 s)" in decision.reason


def pulse(beat_t, progress_t, waiting=False, phase="forward", step=8):
    return Pulse(beat_t=beat_t, progress_t=progress_t, step=step, phase=phase, waiting=waiting)


def test_everyone_progressing_is_fine():
    assert not hang_verdict(10.0, {0: pulse(9.9, 9.9), 1: pulse(9.9, 9.0, waiting=True)}, 3.0, 2.0).ok


def test_a_silent_rank_is_hung_and_its_waiting_peers_are_not():
    pulses = {0: pulse(9.9, 2.0, waiting=True, phase="all_reduce"), 1: pulse(6.0, 6.0), 2: pulse(9.9, 2.0, True)}
    assert hang_verdict(10.0, pulses, 3.0, 2.0) == Decision(
        {1: Hung(SILENCE, 2.0)}, "rank 1 silent (no heartbeat) for 4.0 s in forward of step 8 (silence timeout 2 s) "
                      "while rank(s) [0, 2] wait for it")


def test_silence_is_judged_by_its_own_timeout_whatever_the_step_time():
    """5 s steps make the hang timeout 40 s; a rank whose heartbeat stopped is fenced after the silence timeout."""
    pulses = {0: pulse(99.9, 95.0, waiting=True, phase="all_reduce"), 1: pulse(98.0, 97.0)}
    assert not hang_verdict(99.9, pulses, 40.0, 2.0).ok
    assert hang_verdict(100.0, pulses, 40.0, 2.0) == Decision(
        {1: Hung(SILENCE, 2.0)}, "rank 1 silent (no heartbeat) for 2.0 s in forward of step 8 (silence timeout 2 s) "
                      "while rank(s) [0] wait for it")


def test_a_busy_rank_without_progress_is_hung_while_a_peer_waits():
    pulses = {0: pulse(9.9, 2.0, waiting=True), 1: pulse(9.9, 5.0)}  # rank 1 beats but is stuck (spinning)
    assert hang_verdict(10.0, pulses, 3.0, 2.0) == Decision(
        {1: Hung(PROGRESS, 3.0)}, "rank 1 made no progress for 5.0 s in forward of step 8 (last heartbeat 0.1 s ago; "
                       "hang timeout 3.0 s) while rank(s) [0] wait for it")


def test_a_rank_that_beats_waits_for_the_hang_timeout_not_the_silence_timeout():
    """No progress for 2.5 s is longer than the silence timeout, but rank 1 beats: it may be a slow step."""
    pulses = {0: pulse(9.9, 7.0, waiting=True), 1: pulse(9.9, 7.5)}
    assert not hang_verdict(10.0, pulses, 3.0, 2.0).ok


def test_a_silent_rank_without_progress_is_named_once_by_its_silence():
    pulses = {0: pulse(9.9, 2.0, waiting=True), 1: pulse(5.0, 1.0)}
    assert hang_verdict(10.0, pulses, 3.0, 2.0) == Decision(
        {1: Hung(SILENCE, 2.0)}, "rank 1 silent (no heartbeat) for 5.0 s in forward of step 8 (silence timeout 2 s) "
                      "while rank(s) [0] wait for it")


def test_each_hung_rank_names_the_rule_that_fired():
    pulses = {0: pulse(9.9, 2.0, waiting=True), 1: pulse(7.5, 7.5), 2: pulse(9.9, 6.0, phase="backward")}
    assert hang_verdict(10.0, pulses, 3.0, 2.0) == Decision(
        {1: Hung(SILENCE, 2.0), 2: Hung(PROGRESS, 3.0)},
        "rank 1 silent (no heartbeat) for 2.5 s in forward of step 8 (silence timeout 2 s); rank 2 made no "
        "progress for 4.0 s in backward of step 8 (last heartbeat 0.1 s ago; hang timeout 3.0 s) while rank(s) [0] "
        "wait for it")


def test_a_long_set_up_is_not_a_hang_but_a_long_silence_in_it_is():
    """Rank 1 still loads its data (phase "start", heartbeat alive) while rank 0 waits in the first broadcast:
    set-up may take any time. Silent in set-up (SIGSTOP), it is hung after the longer of both timeouts (set-up
    code may hold the GIL while every process sets up at once)."""
    rank0 = pulse(29.9, 2.0, waiting=True, phase="broadcast", step=0)
    assert not hang_verdict(30.0, {0: rank0, 1: pulse(29.9, 0.0, phase="start", step=0)}, 10.0, 2.0).ok
    assert not hang_verdict(30.0, {0: rank0, 1: pulse(20.1, 0.0, phase="start", step=0)}, 10.0, 2.0).ok
    assert hang_verdict(30.0, {0: rank0, 1: pulse(20.0, 0.0, phase="start", step=0)}, 10.0, 2.0) == Decision(
        {1: Hung(SILENCE, 10.0)}, "rank 1 silent (no heartbeat) for 10.0 s in start of step 0 (silence timeout "
                                  "10 s) while rank(s) [0] wait for it")


def test_a_long_step_with_nobody_waiting_is_not_a_hang():
    assert not hang_verdict(10.0, {0: pulse(9.9, 2.0), 1: pulse(9.9, 2.0)}, 3.0, 2.0).ok


def test_everyone_waiting_and_alive_blames_no_one():
    assert not hang_verdict(10.0, {0: pulse(9.9, 2.0, True), 1: pulse(9.9, 2.0, True)}, 3.0, 2.0).ok


def test_a_finished_rank_is_never_hung():
    pulses = {0: pulse(2.0, 2.0, phase="finished"), 1: pulse(9.9, 2.0, waiting=True, phase="commit")}
    assert not hang_verdict(10.0, pulses, 3.0, 2.0).ok


# ---- silent_processes ------------------------------------------------------------------------

def test_a_process_whose_beacon_stopped_for_the_limit_is_silent():
    alive = {"s0": Alive(beats=40, since=8.0), "s1": Alive(beats=41, since=9.9)}
    assert not silent_processes(9.9, alive, 2.0, "while holding replicas").ok
    assert silent_processes(10.0, alive, 2.0, "while holding replicas") == Decision(
        ("s0",), "s0 silent (no heartbeat) for 2.0 s while holding replicas (timeout 2 s)")


def test_every_silent_process_is_named_in_order():
    alive = {"w2": Alive(7, 1.0), "s0": Alive(3, 2.0), "w0": Alive(9, 9.5)}
    assert silent_processes(5.0, alive, 3.0, "while generation 1 recovers") == Decision(
        ("s0", "w2"), "s0 silent (no heartbeat) for 3.0 s while generation 1 recovers (timeout 3 s); "
                      "w2 silent (no heartbeat) for 4.0 s while generation 1 recovers (timeout 3 s)")


def test_a_process_that_never_beat_is_not_judged():
    """Not started yet (importing torch, or killed before deadpool.init()): its exit tells, not its silence."""
    assert silent_processes(100.0, {"s0": Alive(0, 0.0)}, 2.0, "while holding replicas") == Decision(
        None, "every process while holding replicas beats")
