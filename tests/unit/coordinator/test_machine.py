"""Tests for deadpool/coordinator/machine.py: every transition of the coordinator, with a fake clock."""

from dataclasses import replace

import pytest

from deadpool.config import JobConfig
from deadpool.coordinator.machine import advance, next_tick, start
from deadpool.coordinator.policy import Durable
from deadpool.coordinator.state import (
    Abort,
    CoordinatorState,
    Emit,
    ExitReport,
    Fence,
    Finalize,
    Hang,
    Heartbeat,
    Inputs,
    MarkRunning,
    Persisting,
    Phase,
    PublishPlan,
    PublishStatus,
    Relabel,
    ScriptError,
    Spawn,
    Stop,
    WriteCommit,
    WriteTarget,
)

CONFIG = JobConfig(script="train.py", workers=2, spares=1, run_dir="run")
NODES = JobConfig(script="train.py", workers=2, spares=1, run_dir="run", nproc_per_node=1, store_host="10.0.0.1",
                  store_port=29500)


def started(config: JobConfig = CONFIG) -> CoordinatorState:
    return start(config)[0]


def emitted(effects, name: str) -> list[dict]:
    return [dict(e.fields) for e in effects if isinstance(e, Emit) and e.event == name]


def kinds(effects) -> list[str]:
    """The effects' kinds, events by name: the order the shell applies them in."""
    return [e.event if isinstance(e, Emit) else type(e).__name__ for e in effects]


def killed(name: str, pid: int = 100, code: int = -9, **more) -> Inputs:
    return Inputs(exits=(ExitReport(name, code, pid, started=True, **more),))


def ready(*ranks: int, steps=(0, 1)) -> Inputs:
    return Inputs(ready={r: list(steps) for r in ranks})


def durable(s: CoordinatorState, *steps: int) -> Inputs:
    return Inputs(durable={r: Durable(steps) for r in range(s.plan.world_size)})


def recovering(s: CoordinatorState, name: str, t: float) -> CoordinatorState:
    """Step 1 is committed; `name` dies at `t`; the settle window passes, and the new plan is published."""
    s, _ = advance(s, durable(s, 0, 1), t - 0.5)
    s, _ = advance(s, killed(name), t)
    s, _ = advance(s, Inputs(), t + 1.0)
    assert s.phase is Phase.AWAIT_READY
    return s


# ---- start and the steady state -----------------------------------------------------------

def test_start_commits_step_zero_publishes_generation_zero_and_spawns_every_process():
    s, effects = start(CONFIG)
    assert kinds(effects) == ["WriteCommit", "PublishPlan", "plan_published", "Spawn", "Spawn", "Spawn",
                              "PublishStatus"]
    assert effects[0] == WriteCommit(0, None, ())
    assert [e for e in effects if isinstance(e, Spawn)] == [Spawn("w0", "worker", 0), Spawn("w1", "worker", 1),
                                                            Spawn("s0", "spare", 2)]
    assert (s.phase, s.plan.generation, s.plan.ranks, s.plan.holders) == (Phase.STEADY, 0, ("w0", "w1"),
                                                                          (("s0",), ("s0",)))
    status = effects[-1].status
    assert (status.generation, status.outcome, status.phase, status.committed) == (0, "running", "steady", None)
    assert [(m.proc, m.rank, m.holds) for m in status.members] == [("w0", 0, ()), ("w1", 1, ()), ("s0", None, (0, 1))]


def test_a_step_durable_on_every_rank_is_committed_once():
    s = started()
    s, effects = advance(s, durable(s, 0, 1), 1.0)
    assert kinds(effects) == ["WriteCommit", "commit", "PublishStatus"]
    assert effects[0] == WriteCommit(0, 1, ())
    assert emitted(effects, "commit") == [{"step": 1, "reason": "step 1 is durable on all 2 ranks"}]
    assert s.committed == 1 and effects[-1].status.committed == 1
    s, effects = advance(s, durable(s, 0, 1), 1.1)
    assert effects == ()  # nothing new: nothing written, no status


def test_a_step_on_one_rank_only_is_not_committed_and_skipped_steps_are_abandoned():
    s = started()
    s, _ = advance(s, durable(s, 0), 1.0)
    s, effects = advance(s, Inputs(durable={0: Durable((0, 1)), 1: Durable((0,), skipped=(1,))}), 2.0)
    assert effects[0] == WriteCommit(0, 0, (1,)) and not emitted(effects, "commit")


def test_replicas_that_diverge_stop_the_job():
    s = started()
    reports = {0: Durable((0, 1), fingerprints={0: 5, 1: 7}), 1: Durable((0, 1), fingerprints={0: 5, 1: 8})}
    s, effects = advance(s, Inputs(durable=reports), 1.0)
    assert kinds(effects)[:2] == ["divergence", "job_failed"] and s.exit_code == 1
    # the event names the step, who agreed with whom, and the last step checked equal
    assert emitted(effects, "divergence") == [{"step": 1, "groups": [[0], [1]], "agreed": 0, "action": "stop"}]
    assert "replicas diverged at step 1" in emitted(effects, "job_failed")[0]["reason"]


def test_replicas_that_diverge_under_warn_are_said_once_per_generation():
    s = started(replace(CONFIG, on_divergence="warn"))
    for step in (1, 2):
        steps = tuple(range(step + 1))
        reports = {r: Durable(steps, fingerprints={k: r for k in steps}) for r in (0, 1)}
        s, effects = advance(s, Inputs(durable=reports), float(step))
        assert len(emitted(effects, "divergence")) == 1 and s.exit_code is None
        assert sum(type(e).__name__ == "Say" for e in effects) == (1 if step == 1 else 0)


def test_every_rank_finishing_ends_the_job():
    s = started()
    s, effects = advance(s, killed("w0", code=0), 5.0)
    assert effects == () and s.finished == {"w0"}
    s, effects = advance(s, killed("w1", code=0), 5.1)
    assert kinds(effects) == ["PublishStatus", "Stop", "job_finished"]
    assert effects[1] == Stop("done", grace_s=10.0) and s.exit_code == 0
    assert effects[0].status.outcome == "finished" and effects[0].status.exit_code == 0


@pytest.mark.parametrize("persist_dir", ["", "ckpt"])
def test_a_rank_failing_after_training_ended_is_not_replaced_and_the_job_fails_once_the_others_end(persist_dir):
    """Rank 0 said it left session.run() (its last words: step 1 is committed on every rank), and rank 1 dies
    before it says so (in its last commit wait, or in the script's own code after run()): nothing is planned (no
    rank trains any more), rank 0 goes on with its own code (saving the model, say), and when it exits the job
    fails, saying why (with a disk tier, after assembling the last checkpoint from the parts written)."""
    s = started(replace(CONFIG, persist_dir=persist_dir))
    s, _ = advance(s, replace(durable(s, 0, 1), beats={"w0": pulse(1, 4, phase="commit", waiting=True),
                                                       "w1": pulse(1, 4, phase="commit", waiting=True)}), 1.0)
    # rank 0's last words and rank 1's exit arrive in one tick
    last_words = {"w0": pulse(1, 5, phase="finished"), "w1": pulse(1, 5, phase="commit", waiting=True)}
    s, effects = advance(s, replace(killed("w1"), durable=durable(s, 0, 1).durable, beats=last_words), 2.0)
    assert emitted(effects, "failure_detected") and s.phase is Phase.SETTLING
    s, effects = advance(s, Inputs(), 2.5)
    why = ("rank 1 (w1, pid 100) killed by SIGKILL after ranks [0] had finished training: a failure in the "
           "script's code after session.run() is not recovered. Training is complete on every rank: its last step, "
           "1, is committed.")
    assert not [e for e in effects if isinstance(e, (PublishPlan, Spawn, Stop))] and s.exit_code is None
    assert s.phase is Phase.STEADY and s.swap is None
    assert [e.text for e in effects if type(e).__name__ == "Say"] == [
        f"{why} Ranks [0] are still running their own code after session.run(): the job ends when they do."]
    s, effects = advance(s, Inputs(beats=last_words), 60.0)  # rank 1 silent for a minute: not hung, but gone
    assert not emitted(effects, "hang_detected") and s.exit_code is None
    s, effects = advance(s, killed("w0", code=0), 61.0)
    assert emitted(effects, "job_failed") == [{"reason": why, "root_cause": "rank 1 (w1, pid 100) killed by SIGKILL"}]
    assert s.exit_code == 1
    assert [e for e in effects if isinstance(e, Finalize)] == ([Finalize(1, None, None, None)] if persist_dir else [])


# ---- a swap -------------------------------------------------------------------------------

def test_a_killed_rank_is_settled_planned_restored_and_resumed():
    s = started()
    s, _ = advance(s, durable(s, 0, 1), 1.0)
    s, effects = advance(s, killed("w1", pid=42), 10.0)
    assert kinds(effects) == ["failure_detected", "Say", "PublishStatus"]
    assert emitted(effects, "failure_detected") == [{"proc": "w1", "failed_rank": 1, "exit": "killed by SIGKILL",
                                                     "returncode": -9, "during": "steady"}]
    assert (s.phase, s.deadline, s.root_cause) == (Phase.SETTLING, 10.05, "rank 1 (w1, pid 42) killed by SIGKILL")
    s, effects = advance(s, Inputs(), 10.04)
    assert effects == ()  # the settle window is still open
    s, effects = advance(s, Inputs(), 10.05)
    assert kinds(effects) == ["PublishPlan", "Abort", "Say", "Relabel", "plan_published", "PublishStatus"]
    plan = effects[0].plan
    assert (plan.generation, plan.ranks, plan.spares) == (1, ("w0", "s0"), ())
    assert effects[1] == Abort(0, plan.reason) and effects[3] == Relabel("s0", "s0=r1")
    assert (s.phase, s.deadline) == (Phase.AWAIT_READY, 10.05 + CONFIG.recovery_timeout_s)
    s, effects = advance(s, ready(0), 10.5)
    assert effects == ()  # rank 1 has not reported yet
    s, effects = advance(s, ready(0, 1), 10.6)
    assert kinds(effects) == ["restore_decided", "WriteCommit", "WriteTarget", "PublishStatus"]
    assert effects[1:3] == (WriteCommit(1, 1, ()), WriteTarget(1, 1))
    assert s.phase is Phase.AWAIT_RESUMED
    s, effects = advance(s, Inputs(resumed=frozenset({0, 1})), 11.0)
    assert kinds(effects) == ["swap_complete", "Say", "MarkRunning", "PublishStatus"]
    [done] = emitted(effects, "swap_complete")
    assert done == {"restored_step": 1, "replaced": {1: "s0"}, "cause": "rank 1 (w1, pid 42) killed by SIGKILL",
                    "failed": [{"proc": "w1", "rank": 1, "exit": "killed by SIGKILL", "who": "rank 1 (w1, pid 42)"}],
                    "hang": None, "detected_t": 10.0, "detect_to_resume_s": 1.0}
    assert effects[2] == MarkRunning(1)
    assert (s.phase, s.steady, s.swap, s.root_cause, s.lost) == (Phase.STEADY, s.plan, None, None, frozenset())
    [recovery] = effects[-1].status.recoveries
    assert (recovery.generation, recovery.restored_step, recovery.detect_to_resume_s, recovery.replaced) == (
        1, 1, 1.0, {"1": "s0"})


def test_a_recovery_that_misses_its_deadline_fails_the_job_naming_the_root_cause():
    s = recovering(started(), "w1", 10.0)
    s, effects = advance(s, ready(0), 11.1 + CONFIG.recovery_timeout_s)
    [failed] = emitted(effects, "job_failed")
    assert failed["reason"] == ("ranks [1] did not report their snapshots within 30.0 s of generation 1; a rank "
                                "that did not report logged where it was stuck (its abort_unheeded event)")
    assert failed["root_cause"] == "rank 1 (w1, pid 100) killed by SIGKILL"
    assert kinds(effects)[1:3] == ["PublishStatus", "Stop"] and effects[2] == Stop("failed", grace_s=5.0)


def test_no_intact_snapshot_to_restore_fails_the_job():
    s = recovering(started(), "w1", 10.0)
    s, effects = advance(s, ready(0, 1, steps=()), 11.0)
    assert emitted(effects, "restore_decided")[0]["target"] is None
    assert emitted(effects, "job_failed")[0]["reason"].startswith("cannot recover from memory: no snapshot")


def test_a_death_before_the_first_commit_makes_every_rank_begin_afresh():
    s = started()  # nothing committed yet: the ranks are still setting up
    s, _ = advance(s, killed("w1", pid=42), 1.0)
    s, effects = advance(s, Inputs(), 1.1)
    assert effects[0].plan.ranks == ("w0", "s0") and s.phase is Phase.AWAIT_READY
    s, effects = advance(s, ready(0, 1, steps=()), 2.0)  # nobody holds a snapshot
    assert kinds(effects) == ["restore_decided", "WriteCommit", "WriteTarget", "PublishStatus"]
    assert effects[1:3] == (WriteCommit(1, None, ()), WriteTarget(1, None))
    assert emitted(effects, "restore_decided")[0]["target"] is None
    assert "every rank begins afresh" in emitted(effects, "restore_decided")[0]["reason"]
    assert (s.phase, s.committed) == (Phase.AWAIT_RESUMED, None)
    s, effects = advance(s, Inputs(resumed=frozenset({0, 1})), 3.0)
    assert emitted(effects, "swap_complete")[0]["restored_step"] is None and effects[-2] == MarkRunning(1)
    assert "generation 1 running: began afresh; s0 is now rank 1" in effects[1].text
    s, effects = advance(s, durable(s, 0), 4.0)  # the new generation commits its snapshot 0
    assert effects[0] == WriteCommit(1, 0, ()) and s.committed == 0


def test_a_failure_during_a_recovery_is_planned_with_the_first_as_one_set():
    s = started(replace(CONFIG, spares=2))
    s = recovering(s, "w1", 10.0)
    s, effects = advance(s, killed("w0", pid=41), 10.5)
    assert emitted(effects, "failure_detected")[0]["during"] == "await_ready"
    assert (s.phase, s.lost) == (Phase.SETTLING, {"w0", "w1"})
    s, effects = advance(s, Inputs(), 11.0)
    plan = effects[0].plan
    assert (plan.generation, plan.ranks) == (2, ("s0", "s1"))  # planned from generation 0: both ranks replaced
    assert effects[1] == Abort(1, plan.reason)
    s, _ = advance(s, ready(0, 1), 11.5)
    s, effects = advance(s, Inputs(resumed=frozenset({0, 1})), 12.0)
    [done] = emitted(effects, "swap_complete")
    assert done["cause"] == "rank 1 (w1, pid 100) killed by SIGKILL; rank 0 (w0, pid 41) killed by SIGKILL"
    assert done["replaced"] == {0: "s0", 1: "s1"} and done["detect_to_resume_s"] == 2.0


def test_a_spare_dying_during_a_recovery_is_replanned_without_it():
    s = started(replace(CONFIG, spares=2))
    s = recovering(s, "w1", 10.0)
    assert (s.plan.ranks, s.plan.spares) == (("w0", "s1"), ("s0",))
    s, effects = advance(s, killed("s0", pid=7), 10.5)
    assert emitted(effects, "failure_detected")[0]["failed_rank"] is None
    s, effects = advance(s, Inputs(), 11.0)
    plan = effects[0].plan
    assert (plan.generation, plan.ranks, plan.spares, plan.holders) == (2, ("w0", "s1"), (), (("s1",), ("w0",)))
    assert plan.reason == ("w1 (rank 1) failed; s1 takes rank 1; holders kept for 0 of 2 ranks; rank 0 gets s1, "
                           "rank 1 gets w0")  # s0 held rank 0, s1 rank 1: neither is a valid holder now


def test_an_idle_spare_that_holds_nothing_shrinks_the_pool_in_place():
    s = started(replace(CONFIG, snapshot_every=0, spares=2))
    s, effects = advance(s, killed("s1"), 1.0)
    assert emitted(effects, "failure_detected")[0]["failed_rank"] is None
    s, effects = advance(s, Inputs(), 2.0)
    assert kinds(effects) == ["pool_shrunk", "PublishStatus"]
    assert (s.phase, s.plan.generation, s.plan.spares, s.swap) == (Phase.STEADY, 0, ("s0",), None)


def test_a_second_failure_with_the_pool_empty_fails_the_job_and_advises_spares():
    s = recovering(started(), "w1", 10.0)
    s, _ = advance(s, ready(0, 1), 10.5)
    s, _ = advance(s, Inputs(resumed=frozenset({0, 1})), 11.0)
    s, _ = advance(s, killed("w0", pid=41), 20.0)
    s, effects = advance(s, Inputs(), 21.0)
    [failed] = emitted(effects, "job_failed")
    assert failed["reason"].startswith("rank 0 (w0, pid 41) killed by SIGKILL: w0 (rank 0) failed and")
    assert failed["reason"].endswith("Add spares (--spares) to survive more failures.")


def test_the_exit_of_a_replaced_process_changes_nothing():
    s = recovering(started(), "w1", 10.0)
    s, effects = advance(s, killed("w1"), 10.5)
    assert effects == () and s.phase is Phase.AWAIT_READY


# ---- hangs --------------------------------------------------------------------------------

def pulse(step: int, beat: int, waiting: bool = False, phase: str = "backward", step_s: float = 0.1) -> Heartbeat:
    return Heartbeat(gen=0, beat=beat, step=step, phase=phase, marks=0, waiting=waiting, step_s=step_s)


def test_a_silent_rank_is_fenced_after_the_silence_timeout_and_its_exit_starts_the_swap():
    """5 s steps make the hang timeout 40 s; the rank whose heartbeat stopped is fenced 2 s after its last beat."""
    s = started(replace(CONFIG, silence_timeout_s=2.0))
    steady = durable(s, 0)
    s, effects = advance(s, replace(steady, beats={"w0": pulse(3, 1, step_s=5.0), "w1": pulse(3, 1, step_s=5.0)}), 1.0)
    assert emitted(effects, "hang_timeout") == [{
        "timeout_s": 40.0, "reason": "8 x the slowest median step (5.000 s), at least 3 s: 40.0 s",
        "silence_timeout_s": 2.0}]
    w0 = pulse(4, 2, waiting=True, step_s=5.0)
    s, effects = advance(s, replace(steady, beats={"w0": w0, "w1": pulse(3, 1, step_s=5.0)}), 2.9)
    assert not emitted(effects, "hang_detected")
    s, effects = advance(s, replace(steady, beats={"w0": replace(w0, beat=3), "w1": pulse(3, 1, step_s=5.0)}), 3.0)
    [hang] = emitted(effects, "hang_detected")
    assert hang == {"proc": "w1", "hung_rank": 1, "step": 3, "phase": "backward", "last_progress_t": 1.0,
                    "silent_s": 2.0, "rule": "silence", "timeout_s": 2.0,
                    "reason": "rank 1 silent (no heartbeat) for 2.0 s in backward of step 3 (silence timeout 2 s) "
                              "while rank(s) [0] wait for it"}
    assert Fence("w1") in effects and s.fenced == {"w1"}
    assert s.swap.hang.verdict_t == 3.0 and s.root_cause.startswith("rank 1 (w1) hung: rank 1 silent")
    s, effects = advance(s, killed("w1"), 3.1)
    assert emitted(effects, "failure_detected")[0]["exit"] == "hung, and fenced (SIGKILL)"
    assert s.phase is Phase.SETTLING and s.swap.cause.startswith("rank 1 (w1) hung")


def test_a_rank_that_beats_without_progress_is_fenced_after_the_hang_timeout():
    s = started(replace(CONFIG, hang_timeout_s=5.0, silence_timeout_s=2.0))
    steady = durable(s, 0)
    s, effects = advance(s, replace(steady, beats={"w0": pulse(3, 1), "w1": pulse(3, 1)}), 1.0)
    assert emitted(effects, "hang_timeout") == [{"timeout_s": 5.0, "reason": "--hang-timeout 5 s",
                                                 "silence_timeout_s": 2.0}]
    for beat, now in enumerate((3.0, 5.9), start=2):  # both beat on; w1's step and phase never change
        s, effects = advance(s, replace(steady, beats={"w0": pulse(4, beat, waiting=True), "w1": pulse(3, beat)}), now)
        assert not emitted(effects, "hang_detected")
    s, effects = advance(s, replace(steady, beats={"w0": pulse(4, 4, waiting=True), "w1": pulse(3, 4)}), 6.0)
    [hang] = emitted(effects, "hang_detected")
    assert (hang["hung_rank"], hang["rule"], hang["timeout_s"], hang["silent_s"]) == (1, "progress", 5.0, 5.0)
    assert hang["reason"] == ("rank 1 made no progress for 5.0 s in backward of step 3 (last heartbeat 0.0 s ago; "
                              "hang timeout 5.0 s) while rank(s) [0] wait for it")
    assert Fence("w1") in effects


def test_no_hang_is_looked_for_until_every_rank_has_a_heartbeat():
    s = started(replace(CONFIG, hang_timeout_s=5.0))
    s, effects = advance(s, replace(durable(s, 0), beats={"w0": pulse(1, 1)}), 100.0)
    assert not emitted(effects, "hang_timeout") and not emitted(effects, "hang_detected")


# ---- silent processes: idle spares, and anyone during a recovery -------------------------------

def test_a_silent_spare_is_fenced_after_the_longer_timeout_and_its_replicas_placed_anew():
    """A SIGSTOPped holder: the ranks replicating to it would block at their next copy until it woke."""
    s = started(replace(CONFIG, silence_timeout_s=2.0, hang_timeout_s=1.0))
    s, _ = advance(s, replace(durable(s, 0, 1), alive={"w0": 1, "w1": 1, "s0": 0}), 1.0)  # s0 still importing
    s, effects = advance(s, Inputs(alive={"w0": 9, "w1": 9, "s0": 0}), 50.0)
    assert not emitted(effects, "hang_detected")  # a process that never beat is not judged: its exit tells
    s, _ = advance(s, Inputs(alive={"w0": 10, "w1": 10, "s0": 5}), 51.0)
    s, effects = advance(s, Inputs(alive={"w0": 30, "w1": 30, "s0": 5}), 52.9)
    assert not emitted(effects, "hang_detected")
    s, effects = advance(s, Inputs(alive={"w0": 31, "w1": 31, "s0": 5}), 53.0)
    [hang] = emitted(effects, "hang_detected")
    assert hang == {"proc": "s0", "hung_rank": None, "step": None, "phase": "steady", "last_progress_t": 51.0,
                    "silent_s": 2.0, "rule": "silence", "timeout_s": 2.0,
                    "reason": "s0 silent (no heartbeat) for 2.0 s while holding replicas (timeout 2 s)"}
    assert Fence("s0") in effects and s.fenced == {"s0"}
    assert s.swap.hang == Hang(None, "s0", 51.0, 53.0) and s.root_cause.startswith("spare s0 hung: s0 silent")
    s, effects = advance(s, killed("s0", pid=7), 53.1)
    assert emitted(effects, "failure_detected")[0]["exit"] == "hung, and fenced (SIGKILL)"
    s, effects = advance(s, Inputs(), 54.0)
    plan = effects[0].plan  # it held both ranks' replicas: a new generation places them (on the peers)
    assert (plan.generation, plan.ranks, plan.spares, plan.holders) == (1, ("w0", "w1"), (), (("w1",), ("w0",)))
    assert s.phase is Phase.AWAIT_READY


def test_silence_is_timed_from_when_the_last_beat_arrived_not_from_the_tick_that_read_it():
    """The shell may read liveness up to QUIET_TICK_S late: a beat is dated by its arrival in the store (a
    rank's heartbeat, a spare's beacon), so the verdict falls when it would have had the beat been read at once."""
    s = started(replace(CONFIG, silence_timeout_s=2.0, hang_timeout_s=1.0))
    steady = durable(s, 0)
    s, _ = advance(s, replace(steady, beats={"w0": pulse(3, 1), "w1": pulse(3, 1)}, alive={"s0": 1},
                              beats_t={"w0": 0.95, "w1": 0.95}, alive_t={"s0": 0.95}), 1.0)
    s, effects = advance(s, replace(steady, beats={"w0": pulse(3, 2), "w1": pulse(3, 2)}, alive={"s0": 2},
                                    beats_t={"w0": 2.5, "w1": 1.01}, alive_t={"s0": 1.02}), 2.96)
    assert not emitted(effects, "hang_detected")
    s, effects = advance(s, replace(steady, beats={"w0": pulse(3, 3), "w1": pulse(3, 2)}, alive={"s0": 2},
                                    beats_t={"w0": 3.0, "w1": 1.01}, alive_t={"s0": 1.02}), 3.015)
    [hang] = emitted(effects, "hang_detected")  # 2.005 s after w1's last beat arrived, though read 0.055 s ago
    assert (hang["proc"], hang["rule"]) == ("w1", "silence")
    s, effects = advance(s, replace(steady, alive={"s0": 2}, alive_t={"s0": 1.02}), 3.025)
    assert [h["proc"] for h in emitted(effects, "hang_detected")] == ["s0"]
    assert emitted(effects, "hang_detected")[0]["last_progress_t"] == 1.02


def test_the_shell_waits_longer_while_the_job_only_trains_but_never_past_a_verdict_due():
    """next_tick: the busy period while anything is in flight; while only liveness can change, the quiet
    period, cut short at the moment a silence verdict could fall due (so a hang is fenced no later than a tick
    every 20 ms would fence it), but never below the busy period: a verdict overdue that never falls (a rank
    that finished, or one not joined yet) once made the loop spin, starving the ranks of a job whose
    coordinator runs in rank 0."""
    s = started(replace(CONFIG, silence_timeout_s=2.0, hang_timeout_s=5.0))
    assert next_tick(s, 1.0, 0.02, 0.05) == 0.05  # nothing beat yet: nothing can fall due
    s, _ = advance(s, replace(durable(s, 0), beats={"w0": pulse(3, 1), "w1": pulse(3, 1)}, alive={"s0": 1},
                              beats_t={"w0": 0.9, "w1": 0.97}, alive_t={"s0": 0.95}), 1.0)
    assert next_tick(s, 1.0, 0.02, 0.05) == 0.05
    assert next_tick(s, 2.87, 0.02, 0.05) == pytest.approx(0.03)  # w0's silence falls due at 2.9
    assert next_tick(s, 2.89, 0.02, 0.05) == 0.02  # never less than the busy period
    assert next_tick(s, 3.5, 0.02, 0.05) == 0.02  # overdue without a verdict (a finished rank): no spinning
    assert next_tick(replace(s, persisting=Persisting(1, ("w0",), 0.0, 9.0, "test")), 1.0, 0.02, 0.05) == 0.02
    assert next_tick(replace(s, stopping_t=1.0), 1.0, 0.02, 0.05) == 0.02
    s, _ = advance(s, killed("w1"), 1.1)
    assert s.phase is Phase.SETTLING and next_tick(s, 1.1, 0.02, 0.05) == 0.02


def test_a_spare_in_its_own_set_up_is_given_the_hang_timeout_not_the_silence_timeout_alone():
    """A spare imports and runs the script's warm-up while it idles: a GIL held for seconds is not a hang."""
    s = started(replace(CONFIG, silence_timeout_s=1.5, hang_timeout_s=5.0))
    s, _ = advance(s, replace(durable(s, 0, 1), alive={"w0": 1, "w1": 1, "s0": 1}), 1.0)
    s, effects = advance(s, Inputs(alive={"w0": 9, "w1": 9, "s0": 1}), 5.9)
    assert not emitted(effects, "hang_detected")
    s, effects = advance(s, Inputs(alive={"w0": 10, "w1": 10, "s0": 1}), 6.1)
    assert [h["proc"] for h in emitted(effects, "hang_detected")] == ["s0"]


def test_a_process_silent_during_a_recovery_is_fenced_after_the_hang_timeout_and_planned_with_the_first():
    """No step runs while the coordinator awaits the ready reports: the beacon is all there is to judge, for the
    longer of the silence and hang timeouts (a taker runs its script's set-up meanwhile)."""
    s = started(replace(CONFIG, spares=2, silence_timeout_s=2.0, hang_timeout_s=5.0))
    s, _ = advance(s, Inputs(alive={"w0": 1, "w1": 1, "s0": 1, "s1": 1}), 9.0)
    s = recovering(s, "w1", 10.0)
    assert (s.plan.ranks, s.plan.spares) == (("w0", "s1"), ("s0",))
    s, effects = advance(s, replace(ready(1), alive={"w0": 2, "s1": 2, "s0": 2}), 11.0)  # w0 stops before ready
    s, effects = advance(s, replace(ready(1), alive={"w0": 2, "s1": 9, "s0": 9}), 15.9)
    assert not emitted(effects, "hang_detected") and s.phase is Phase.AWAIT_READY
    s, effects = advance(s, replace(ready(1), alive={"w0": 2, "s1": 10, "s0": 10}), 16.0)
    [hang] = emitted(effects, "hang_detected")
    assert (hang["proc"], hang["hung_rank"], hang["phase"], hang["timeout_s"]) == ("w0", 0, "await_ready", 5.0)
    assert hang["reason"] == "w0 silent (no heartbeat) for 5.0 s while generation 1 recovers (timeout 5 s)"
    assert Fence("w0") in effects and s.swap.cause == "rank 1 (w1, pid 100) killed by SIGKILL"  # the first cause
    s, effects = advance(s, killed("w0", pid=41), 16.1)
    s, effects = advance(s, Inputs(), 17.0)
    plan = effects[0].plan
    assert (plan.generation, plan.ranks) == (2, ("s0", "s1"))  # planned from generation 0: both ranks replaced
    assert effects[1] == Abort(1, plan.reason)


def test_a_beacon_at_rest_behind_a_heartbeat_is_not_silence():
    """A rank's beacon rests while its heartbeat goes out (runtime/watch.Beacon); a rank that has not yet left
    the aborted generation keeps beating, so during the recovery its heartbeat's arrivals (the shell's
    alive_t: the later of its beacon's and its heartbeat's) are its sign of life; once they stop too, it is
    fenced the timeout after the last of them."""
    s = started(replace(CONFIG, spares=2, silence_timeout_s=2.0, hang_timeout_s=5.0))
    s, _ = advance(s, Inputs(alive={"w0": 1, "w1": 1, "s0": 1, "s1": 1}), 9.0)
    s = recovering(s, "w1", 10.0)
    rest = {"w0": 1, "s1": 1, "s0": 1}  # no beacon count moves from here on
    s, effects = advance(s, replace(ready(1), alive=rest, alive_t={"w0": 14.0, "s1": 14.5, "s0": 14.5}), 14.5)
    s, effects = advance(s, replace(ready(1), alive=rest, alive_t={"w0": 14.0, "s1": 18.9, "s0": 18.9}), 18.9)
    assert not emitted(effects, "hang_detected")  # 8.9 s after w0's last count: its heartbeat arrived at 14.0
    s, effects = advance(s, replace(ready(1), alive=rest, alive_t={"w0": 14.0, "s1": 19.0, "s0": 19.0}), 19.0)
    [hang] = emitted(effects, "hang_detected")
    assert (hang["proc"], hang["last_progress_t"], hang["silent_s"]) == ("w0", 14.0, 5.0)


# ---- script errors ------------------------------------------------------------------------

def test_a_script_error_stops_the_job_at_once_without_a_swap():
    s = started()
    error = ScriptError(rank=0, step=3, error="ValueError: boom")
    s, effects = advance(s, killed("w0", code=1, script_error=error), 4.0)
    assert kinds(effects) == ["script_error", "job_failed", "PublishStatus", "Stop", "Say"]
    assert emitted(effects, "script_error") == [{"proc": "w0", "rank": 0, "step": 3,
                                                 "error": "the training script raised ValueError: boom"}]
    reason = emitted(effects, "job_failed")[0]["reason"]
    assert reason.startswith("error in the training script on rank 0 (w0) at step 3: raised ValueError: boom.")
    assert s.exit_code == 1 and s.plan.generation == 0
    assert (effects[2].status.outcome, effects[2].status.reason) == ("failed", reason)


def test_a_checkpoint_of_another_job_refused_by_a_rank_stops_the_job_with_exit_2_in_one_line():
    s = started(replace(CONFIG, resume="/ckpt/step-4"))
    why = "cannot resume from /ckpt/step-4: it holds the state of another job (model.w has shape [4] ...)"
    error = ScriptError(rank=0, step=0, error=f"CheckpointError: {why}", refused=True)
    s, effects = advance(s, killed("w0", code=1, script_error=error), 4.0)
    assert s.exit_code == 2 and emitted(effects, "job_failed")[0]["reason"] == why
    assert [(e.text, e.error) for e in effects if type(e).__name__ == "Say"] == [(why, True)]  # one line
    assert Stop("failed", grace_s=5.0) in effects


def test_a_called_spares_set_up_error_names_the_spare_the_rank_and_step_and_that_a_spare_was_used():
    s = started()
    error = ScriptError(rank=1, step=0, error="EOFError: Ran out of input", taking_over=4)
    s, effects = advance(s, killed("s0", code=1, script_error=error), 4.0)
    reason = emitted(effects, "job_failed")[0]["reason"]
    assert reason.startswith("error in the training script on spare s0, in the script's set-up as it took over "
                             "rank 1 at step 4: raised EOFError: Ran out of input. This is a bug in the script, not "
                             "a node failure; a spare was used for the failure before it, and no other is tried")
    assert s.exit_code == 1


def test_an_exit_before_init_is_a_script_error():
    s = started()
    s, effects = advance(s, Inputs(exits=(ExitReport("w1", 2, 5, started=False),)), 1.0)
    [error] = emitted(effects, "script_error")
    assert error["error"] == "the training script exited with code 2 before deadpool.init()"


def test_later_exits_of_a_tick_that_ended_the_job_are_not_looked_at():
    s = started()
    exits = (ExitReport("w0", 1, 5, started=False), ExitReport("w1", -9, 6, started=True))
    s, effects = advance(s, Inputs(exits=exits), 1.0)
    assert not emitted(effects, "failure_detected") and s.exit_code == 1


# ---- nodes --------------------------------------------------------------------------------

def test_a_process_lost_with_its_node_is_a_failure():
    s = started(NODES)
    s, effects = advance(s, killed("w1", lost_with_node="node 1 (its agent was silent for 5.1 s)"), 3.0)
    assert emitted(effects, "failure_detected")[0]["exit"] == "lost with node 1 (its agent was silent for 5.1 s)"
    s, effects = advance(s, Inputs(), 4.0)
    assert effects[0].plan.ranks == ("w0", "s0")


def joined(s: CoordinatorState, t: float) -> CoordinatorState:
    """Step 1 is committed; spare node 3 joins: its spare s1 is ordered."""
    s, _ = advance(s, durable(s, 0, 1), t - 0.5)
    s, effects = advance(s, Inputs(joined={3: "host3"}), t)
    assert emitted(effects, "spare_node_joined") == [{"node": 3, "host": "host3", "procs": ["s1"]}]
    assert Spawn("s1", "spare", 3) in effects and set(s.joining) == {3}
    return s


def test_a_spare_node_that_joins_refills_the_pool_in_a_new_generation():
    s = joined(started(NODES), 1.0)
    s, effects = advance(s, Inputs(), 1.5)
    assert not [e for e in effects if isinstance(e, PublishPlan)]  # its spare has not started yet
    s, effects = advance(s, Inputs(started=frozenset({"s1"})), 2.0)
    plan = effects[0].plan
    assert (plan.generation, plan.spares, s.phase, s.joining) == (1, ("s0", "s1"), Phase.AWAIT_READY, {})
    s, _ = advance(s, ready(0, 1), 2.5)
    s, effects = advance(s, Inputs(resumed=frozenset({0, 1})), 3.5)
    [refill] = emitted(effects, "pool_refilled")
    assert (refill["nodes"], refill["procs"], refill["took_s"], refill["restored_step"]) == ([3], ["s1"], 1.5, 1)
    assert not emitted(effects, "swap_complete") and s.phase is Phase.STEADY


def test_a_join_during_a_recovery_waits_until_the_steady_state():
    s = recovering(started(NODES), "w1", 1.0)
    s, effects = advance(s, Inputs(joined={3: "host3"}), 2.5)
    assert effects == () and s.joins == {3: "host3"}
    s, _ = advance(s, ready(0, 1), 2.6)
    s, _ = advance(s, Inputs(resumed=frozenset({0, 1})), 2.7)
    s, effects = advance(s, Inputs(), 2.8)
    assert emitted(effects, "spare_node_joined") and s.joins == {}


def test_a_joined_node_whose_spares_do_not_start_in_time_is_dropped():
    s = joined(started(NODES), 1.0)
    s, effects = advance(s, Inputs(), 1.0 + NODES.connect_timeout_s + 0.1)
    assert Fence("s1") in effects and s.joining == {}
    assert emitted(effects, "spare_node_dropped")[0]["reason"] == "its spares did not start within 60 s"


# ---- waiting for a spare ------------------------------------------------------------------

WAITING = replace(NODES, spares=0, spare_wait_s=10.0)


def test_with_no_spare_left_the_job_waits_for_one_and_stops_when_the_wait_runs_out():
    s = started(WAITING)
    s, _ = advance(s, killed("w1"), 1.0)
    s, effects = advance(s, Inputs(), 2.0)
    [awaited] = emitted(effects, "spare_awaited")
    assert (awaited["nodes"], awaited["ranks"], awaited["spare_wait_s"]) == ([1], [1], 10.0)
    assert "--coordinator 10.0.0.1:29500 --secret-file RUN_DIR/secret --spare`" in effects[1].text
    assert (s.phase, s.deadline) == (Phase.AWAIT_SPARE, 12.0)
    s, effects = advance(s, Inputs(), 11.9)
    assert effects == ()
    s, effects = advance(s, Inputs(), 12.0)
    [none] = emitted(effects, "no_spare")
    assert none["waited_s"] == 10.0 and s.exit_code == 1
    assert "no spare node joined within --spare-wait 10 s" in emitted(effects, "job_failed")[0]["reason"]


def test_a_spare_node_that_joins_during_the_wait_takes_the_lost_rank():
    s = started(WAITING)
    s, _ = advance(s, durable(s, 0, 1), 0.5)
    s, _ = advance(s, killed("w1"), 1.0)
    s, _ = advance(s, Inputs(), 2.0)
    s, effects = advance(s, Inputs(joined={2: "host2"}), 3.0)
    assert Spawn("s0", "spare", 2) in effects and s.phase is Phase.AWAIT_SPARE
    s, effects = advance(s, Inputs(started=frozenset({"s0"})), 4.0)
    plan = effects[0].plan
    assert (plan.generation, plan.ranks, s.phase, s.awaiting_since) == (1, ("w0", "s0"), Phase.AWAIT_READY, None)
    s, _ = advance(s, ready(0, 1), 4.5)
    s, effects = advance(s, Inputs(resumed=frozenset({0, 1})), 5.0)
    assert emitted(effects, "swap_complete")[0]["replaced"] == {1: "s0"}
    assert emitted(effects, "pool_refilled")[0]["nodes"] == [2]


def test_a_status_is_published_only_when_it_changes():
    s, effects = start(CONFIG)
    for t in (1.0, 2.0):
        s, effects = advance(s, Inputs(), t)
        assert not [e for e in effects if isinstance(e, PublishStatus)]


def test_advance_refuses_a_job_that_ended():
    s = replace(started(), exit_code=0)
    with pytest.raises(AssertionError):
        advance(s, Inputs(), 1.0)
