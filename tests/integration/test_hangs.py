"""Hangs: a rank stopped (SIGSTOP) or spinning is found by its missing progress, fenced and swapped."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from deadpool.config import SILENCE_TIMEOUT_S, Fault

from .conftest import SCRIPTS, SMALL, Background, Job, run_job
from .test_hot_swap import assert_same_training

SPINNING = Path(__file__).with_name("scripts") / "spinning_train.py"


def assert_hung_rank_swapped(job: Job, rank: int) -> None:
    """The hung rank, and only it, is named, fenced and replaced; nobody timed out in a collective."""
    [verdict] = job.named("hang_detected")
    assert verdict["hung_rank"] == rank and verdict["reason"].startswith(f"rank {rank} ")
    [failure] = job.named("failure_detected")
    assert failure["failed_rank"] == rank and failure["exit"] == "hung, and fenced (SIGKILL)"
    [recovery] = job.summary["recoveries"]
    assert recovery["fault"] == "hang" and recovery["failed_ranks"] == [rank]
    assert recovery["cause"].startswith(f"rank {rank} (w{rank}) hung")
    assert not any("Timed out" in e["cause"] for e in job.named("failure_seen"))  # released by the abort


# forward and after_optimizer were dropped for CI time (2026-12-01): the phases either side of each are kept
@pytest.mark.parametrize("phase", ["step_start", "backward", "snapshot_copy", "replicate"])
def test_sigstop_in_any_phase_is_fenced_and_swapped_bit_for_bit(tmp_path, reference, phase):
    job = run_job(tmp_path, faults=(Fault(kind="hang", rank=2, step=6, phase=phase),))
    assert_same_training(job, reference)
    assert_hung_rank_swapped(job, 2)  # silent, or without progress first if its phase began earlier
    [recovery] = job.summary["recoveries"]
    assert recovery["kill_step"] == 6
    [verdict] = job.named("hang_detected")
    assert verdict["silent_s"] >= verdict["timeout_s"]  # never called hung before its timeout


def test_a_rank_spinning_in_python_is_fenced_and_swapped_bit_for_bit(tmp_path, reference):
    """The spinning rank keeps its heartbeat but makes no progress while its peers wait in the all-reduce."""
    job = run_job(tmp_path, script=SPINNING, script_prefix=("w1", "6"), script_args=SMALL)
    assert_same_training(job, reference)
    assert_hung_rank_swapped(job, 1)
    [verdict] = job.named("hang_detected")
    assert "made no progress" in verdict["reason"] and "silent" not in verdict["reason"]  # it kept beating


def test_a_silent_rank_is_fenced_after_the_silence_timeout_whatever_the_step_time(tmp_path):
    """Steps slowed to 1 s make the hang timeout 8 s or more; the SIGSTOPped rank, whose heartbeat stops, is
    fenced by the silence timeout instead (read from the events: wall-clock thresholds fail on a busy host)."""
    job = run_job(tmp_path, steps=3, workers=2, script=SCRIPTS / "slow_steps.py", script_prefix=("1.0",),
                  faults=(Fault(kind="hang", rank=1, step=2, phase="backward"),))
    assert job.code == 0
    assert_hung_rank_swapped(job, 1)
    at = next(i for i, e in enumerate(job.events) if e["event"] == "hang_detected")
    [*_, in_force] = [e for e in job.events[:at] if e["event"] == "hang_timeout"]
    assert in_force["timeout_s"] >= 8.0 and in_force["silence_timeout_s"] == SILENCE_TIMEOUT_S
    [verdict] = job.named("hang_detected")
    assert (verdict["rule"], verdict["timeout_s"]) == ("silence", SILENCE_TIMEOUT_S)
    assert verdict["reason"].startswith("rank 1 silent (no heartbeat) for ")
    assert f"(silence timeout {SILENCE_TIMEOUT_S:g} s)" in verdict["reason"]


@pytest.mark.parametrize("phase", ["step_start", "forward", "backward", "after_optimizer"])
def test_a_hang_verdict_names_the_exact_phase_and_step_the_rank_stopped_in(tmp_path, phase):
    """Steps of milliseconds, shorter than the heartbeat's poll: the rank publishes where it stops before
    its SIGSTOP, so the verdict never names an older point."""
    job = run_job(tmp_path, steps=4, workers=2, spares=1, script=SCRIPTS / "tiny.py", script_args=(),
                  faults=(Fault(kind="hang", rank=1, step=3, phase=phase),))
    assert job.code == 0
    [verdict] = job.named("hang_detected")
    assert verdict["reason"].startswith("rank 1 silent (no heartbeat) for ")
    assert f" in {phase} of step 3 " in verdict["reason"]


def test_a_hung_spare_holding_replicas_is_fenced_and_its_replicas_placed_anew_bit_for_bit(tmp_path, reference):
    """SIGSTOP the only spare mid-run: the ranks replicating to it would block at their next copy until it woke.
    Its beacon stops, the coordinator fences it after the silence timeout, and the spare-lost path re-places
    its replicas (on the peers: no spare is left); the run is the reference's, bit for bit."""
    job = Background(tmp_path / "run")
    job.wait_for(lambda e: e["event"] == "step" and e["step"] >= 4)
    os.kill(job.pid("s0"), signal.SIGSTOP)
    job = job.join()
    assert job.code == 0, job.summary["error"]
    [verdict] = job.named("hang_detected")
    assert (verdict["proc"], verdict["hung_rank"], verdict["rule"]) == ("s0", None, "silence")
    assert verdict["reason"].startswith("s0 silent (no heartbeat) for ") and verdict["silent_s"] >= SILENCE_TIMEOUT_S
    [lost] = job.named("failure_detected")
    assert (lost["proc"], lost["exit"]) == ("s0", "hung, and fenced (SIGKILL)")
    assert job.named("plan_published")[-1]["spares"] == []
    assert_same_training(job, reference)


def test_a_rank_hung_in_the_middle_of_a_recovery_is_fenced_and_replaced_bit_for_bit(tmp_path, reference):
    """Rank 2 stops (SIGSTOP) while the job recovers from rank 1's death, before it reports its snapshots: no
    step runs, so its beacon's silence is what tells, within the hang timeout (not the recovery timeout, which
    would end the job). It is fenced, generation 1 is abandoned for generation 2 and both spares take over."""
    faults = (Fault(kind="kill", rank=1, step=5, phase="backward"),
              Fault(kind="hang", rank=2, step=5, phase="recovery"))
    job = run_job(tmp_path, spares=2, faults=faults)
    assert_same_training(job, reference)
    [verdict] = job.named("hang_detected")
    assert (verdict["proc"], verdict["hung_rank"], verdict["phase"]) == ("w2", 2, "await_ready")
    assert verdict["reason"].startswith("w2 silent (no heartbeat) for ")
    assert verdict["reason"].endswith(" while generation 1 recovers (timeout " + f"{verdict['timeout_s']:g} s)")
    assert [(e["failed_rank"], e["exit"]) for e in job.named("failure_detected")] == [
        (1, "killed by SIGKILL"), (2, "hung, and fenced (SIGKILL)")]
    [swap] = job.summary["recoveries"]  # one recovery, completed in generation 2
    assert swap["generation"] == 2 and swap["replaced"] == {"1": "s1", "2": "s0"}
    assert {e["gen"] for e in job.named("recovered")} == {2}
