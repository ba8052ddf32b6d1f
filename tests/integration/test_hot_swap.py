"""Real processes, real SIGKILLs: a killed worker is replaced by a spare and the run stays bit-for-bit equal."""

from __future__ import annotations

import json
import time

import pytest

from deadpool.config import Fault
from deadpool.runtime.cadence import CALIBRATION_STEPS, REPRICE_STEPS, longest_gap, snapshots_after

from .conftest import SCRIPTS, Job, run_job


def assert_same_training(job: Job, reference: Job) -> None:
    """The exact oracle: same final state of every rank, same loss at every step, same samples per step."""
    assert job.code == 0, job.summary["error"]
    assert job.summary["rank_state_sha256"] == reference.summary["rank_state_sha256"]
    assert job.summary["final_state_sha256"] == reference.summary["final_state_sha256"]
    assert job.summary["losses"] == reference.summary["losses"]
    batches = job.batches()
    assert batches == reference.batches()  # no sample skipped, none trained on twice in the final history
    ids = [i for samples in batches.values() for i in samples]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("phase", ["step_start", "backward", "snapshot_copy", "replicate", "after_optimizer"])
def test_sigkill_in_any_phase_is_hot_swapped_bit_for_bit(tmp_path, reference, phase):
    job = run_job(tmp_path, faults=(Fault(kind="kill", rank=1, step=6, phase=phase),))
    assert_same_training(job, reference)
    [fault] = job.named("fault_injected")
    assert (fault["target_rank"], fault["step"], fault["phase"]) == (1, 6, phase)
    assert job.summary["swaps"] == 1
    [recovery] = job.summary["recoveries"]
    assert recovery["failed_rank"] == 1 and recovery["replaced"] == {"1": "s0"}
    assert recovery["kill_step"] == 6
    # Bound from the slot-reuse rule: optimizer step 5 waited for snapshot 4's copy, which waited for
    # snapshot 3's commit; so step 3 is committed at the kill, 4 and 5 may be (load decides)
    assert recovery["restored_step"] in (3, 4, 5)
    assert recovery["steps_replayed"] == 5 - recovery["restored_step"]
    # every rank (survivors and the spare, through the same state machine) resumed from the same step
    resumed = {e["rank"]: e["restored_step"] for e in job.named("recovered")}
    [activated] = job.named("spare_activated")
    assert resumed == {rank: recovery["restored_step"] for rank in range(4)}
    assert activated["restored_step"] == recovery["restored_step"] and activated["proc"] == "s0"
    assert {e["gen"] for e in job.named("finished")} == {1}
    # each rank (the taker as rank 1) reported what it holds; the coordinator chose from exactly that
    ready, [decided] = {e["rank"]: e for e in job.named("recovery_ready")}, job.named("restore_decided")
    assert decided["holdings"] == {str(r): e["holds"] for r, e in sorted(ready.items())} and ready[1]["proc"] == "s0"
    assert decided["target"] == recovery["restored_step"] and all(recovery["restored_step"] in e["holds"]
                                                                   for e in ready.values())
    # the gather: survivors whose weights are still the restored step's (rank 1 killed before their optimizer
    # step 6, step 5 restored) copy the others' pieces from their live tensors and only the taker receives them
    restored, lead = recovery["restored_step"], max(e["slice"][1] for e in job.named("snapshot"))
    needy = [1] if phase in ("step_start", "backward") and restored == 5 else [0, 1, 2, 3]
    gathered = {e["rank"]: e for e in job.named("pieces_gathered")}
    piece = {e["rank"]: e["slice"][1] - e["slice"][0] for e in job.named("snapshot") if e["step"] == restored}
    assert sorted(gathered) == [0, 1, 2, 3] and all(e["needy"] == needy for e in gathered.values())
    assert {e["mode"] for e in gathered.values()} == {"point-to-point" if needy == [1] else "broadcast"}
    assert all(e["received"] == (lead - piece[r] if r in needy else 0) for r, e in gathered.items())


def test_with_slices_off_whole_snapshots_are_hot_swapped_bit_for_bit(tmp_path, reference):
    """--slices off: every rank copies, sends and restores all of its state; nothing is gathered."""
    job = run_job(tmp_path, faults=(Fault(kind="kill", rank=2, step=5, phase="backward"),), slices=False)
    assert_same_training(job, reference)
    snapshots = job.named("snapshot")
    assert all(e["slice"] is None and e["held"] == e["bytes"] for e in snapshots)
    assert not job.named("pieces_gathered")


def test_two_failures_with_two_spares(tmp_path, reference):
    faults = (Fault(kind="kill", rank=1, step=4, phase="backward"), Fault(kind="kill", rank=3, step=8, phase="forward"))
    job = run_job(tmp_path, spares=2, faults=faults)
    assert_same_training(job, reference)
    assert job.summary["swaps"] == 2
    first, second = job.summary["recoveries"]
    assert (first["failed_rank"], second["failed_rank"]) == (1, 3)
    assert first["replaced"] == {"1": "s1"} and second["replaced"] == {"3": "s0"}


def test_a_kill_in_backward_between_two_buckets_is_hot_swapped_bit_for_bit(tmp_path):
    """Rank 1 dies in backward once the later layers' buckets are launched and before the earlier ones are:
    the survivors' all-reduces in flight are abandoned with the generation (no wait outlives the abort), and
    the replay reduces in the same buckets in the same order, bit for bit. Small buckets (50 KB) put the
    fault point in the middle of the layout (checked below, not assumed)."""
    def run(name: str, *faults: Fault) -> Job:
        return run_job(tmp_path / name, steps=8, faults=faults, script=SCRIPTS / "small_buckets.py",
                       script_prefix=("0.05", str(tmp_path / f"{name}.json")))

    reference = run("reference")
    job = run("faulty", Fault(kind="kill", rank=1, step=5, phase="backward"))
    assert_same_training(job, reference)
    assert job.summary["swaps"] == 1 and job.summary["recoveries"][0]["kill_step"] == 5
    layout = json.loads((tmp_path / "faulty.json").read_text())
    buckets, point = layout["buckets"], layout["backward_point"]
    [where] = [b for b, members in enumerate(buckets) if point in members]
    assert 0 < where < len(buckets) - 1, f"the fault point's parameter is in bucket {where} of {len(buckets)}"
    assert all(i > point for bucket in buckets[:where] for i in bucket)  # ready before it: reverse order


def test_a_second_kill_in_the_middle_of_a_recovery(tmp_path, reference):
    """Rank 2 dies while the job recovers from rank 1's death: the coordinator abandons generation 1
    for generation 2, both spares take over, and the run is still bit-for-bit the reference."""
    faults = (Fault(kind="kill", rank=1, step=5, phase="backward"),
              Fault(kind="kill", rank=2, step=5, phase="recovery"))
    job = run_job(tmp_path, spares=2, faults=faults)
    assert_same_training(job, reference)
    assert [e["failed_rank"] for e in job.named("failure_detected")] == [1, 2]
    [swap] = job.summary["recoveries"]  # one recovery, completed in generation 2
    assert swap["generation"] == 2 and swap["replaced"] == {"1": "s1", "2": "s0"}
    assert {e["gen"] for e in job.named("recovered")} == {2}


def test_deaths_in_start_up_are_taken_over_and_every_rank_begins_afresh_bit_for_bit(tmp_path, reference):
    """Nothing is committed before snapshot 0: rank 1 dies in deadpool.init() (the others wait in generation 0's
    rendezvous), a spare takes it and every rank begins afresh; rank 2 then dies in that new start, before its
    snapshot 0, and the other spare takes it the same way. The run is bit for bit the reference."""
    faults = (Fault(kind="kill", rank=1, step=0, phase="init"), Fault(kind="kill", rank=2, step=0, phase="setup"))
    job = run_job(tmp_path, spares=2, faults=faults)
    assert_same_training(job, reference)
    assert job.summary["faults_not_fired"] == []
    assert [(e["target_rank"], e["phase"], e["gen"]) for e in job.named("fault_injected")] == [(1, "init", 0),
                                                                                              (2, "setup", 1)]
    assert [(r["replaced"], r["restored_step"]) for r in job.summary["recoveries"]] == [({"1": "s1"}, None),
                                                                                       ({"2": "s0"}, None)]
    assert [e["target"] for e in job.named("restore_decided")] == [None, None]
    assert not [e for e in job.named("step") if e["gen"] < 2]  # no step ran before the last start
    first = job.named("commit")[0]
    assert (first["step"], first["gen"]) == (0, 2)  # nothing was committed before the last start


def test_failure_with_no_spare_left_ends_with_a_clear_error(tmp_path):
    faults = (Fault(kind="kill", rank=1, step=3, phase="backward"),
              Fault(kind="kill", rank=2, step=6, phase="backward"))
    started = time.monotonic()
    job = run_job(tmp_path, workers=3, spares=1, faults=faults)  # ranks 1 and 2 fail: three ranks show it
    assert time.monotonic() - started < 60  # bounded: nothing waits for a timeout
    assert job.code == 1
    assert job.summary["swaps"] == 1
    error = job.summary["error"]
    assert "rank 2 (w2," in error and "killed by SIGKILL" in error and "no spare is left" in error
    committed = [e["step"] for e in job.events if e["event"] == "commit"]
    assert f"Last committed step: {max(committed)}." in error
    [failed] = job.named("job_failed")
    assert failed["root_cause"].startswith("rank 2 (w2,")  # the recovered first failure is not blamed


def test_no_spare_at_all(tmp_path):
    job = run_job(tmp_path, workers=2, spares=0, faults=(Fault(kind="kill", rank=0, step=3, phase="backward"),))
    assert job.code == 1 and job.summary["swaps"] == 0
    assert "rank 0 (w0," in job.summary["error"] and "no spare is left in the pool" in job.summary["error"]


def test_corrupted_replica_is_never_restored_from(tmp_path, reference):
    """The spare's copy of rank 2's snapshot 5 has a flipped byte: recovery falls back to step 4,
    which every rank still holds intact, and the run is still bit-for-bit equal.

    Each forward pass is paused 0.3 s (slow_steps.py: the numbers are the reference's), so that snapshot 5 is
    always replicated before the kill in step 6's backward pass (checked below, not assumed).
    """
    faults = (Fault(kind="corrupt_replica", rank=2, step=5), Fault(kind="kill", rank=2, step=6, phase="backward"))
    job = run_job(tmp_path, faults=faults, script=SCRIPTS / "slow_steps.py", script_prefix=("0.3",))
    [rejected] = [e for e in job.named("replica_rejected") if e.get("step") == 5]
    assert rejected["of_rank"] == 2 and "checksum" in rejected["error"]
    [decided] = job.named("restore_decided")
    assert decided["holdings"]["2"] == [4] and decided["target"] == 4
    assert "fall back to step 4" in decided["reason"]
    assert job.summary["recoveries"][0]["restored_step"] == 4
    assert_same_training(job, reference)


def test_corrupted_replica_with_no_intact_fallback_stops_cleanly(tmp_path):
    """Killed while sending snapshot 6, rank 2's only other replica (5) is corrupt: the spare holds
    nothing intact that was committed, so the job stops and says why instead of restoring bad bytes. (The
    spare, on the same machine, maps rank 2's slots: the header it got before the kill named snapshot 6,
    whole in rank 2's arena, so it holds 6, which no rank reported durable.)"""
    faults = (Fault(kind="corrupt_replica", rank=2, step=5), Fault(kind="kill", rank=2, step=6, phase="replicate"))
    job = run_job(tmp_path, workers=3, faults=faults)
    assert job.code == 1
    [decided] = job.named("restore_decided")
    assert decided["target"] is None and decided["holdings"]["2"] == [6]
    assert "cannot recover from memory" in job.summary["error"]
    assert not job.named("recovered")


def test_snapshot_every_auto_picks_an_interval_and_still_recovers(tmp_path):
    """Killed at the end of the calibration: the spare that takes the rank over has timed too few blocks
    and abstains; the survivors' measurements pick the interval, every rank agrees, and the run ends as
    the failure-free one. REPRICE_STEPS later the ranks agree again, the spare now with blocks of its own."""
    again = CALIBRATION_STEPS + REPRICE_STEPS
    steps = again + 4
    reference = run_job(tmp_path / "reference", steps=steps)
    job = run_job(tmp_path / "job", steps=steps, snapshot_every="auto",
                  faults=(Fault(kind="kill", rank=3, step=CALIBRATION_STEPS - 1, phase="backward"),))
    assert_same_training(job, reference)
    [recovery] = job.summary["recoveries"]
    restored = recovery["restored_step"]
    assert restored in (CALIBRATION_STEPS - 3, CALIBRATION_STEPS - 2)  # the last calibration snapshots
    decided = job.named("snapshot_interval")
    assert {e["gen"] for e in decided} == {1}
    assert sorted(e["at_step"] for e in decided) == [CALIBRATION_STEPS] * 4 + [again] * 4
    first = {e["proc"]: e for e in decided if e["at_step"] == CALIBRATION_STEPS}
    second = {e["proc"]: e for e in decided if e["at_step"] == again}
    # blocks of 5 steps, none after 5..9, one after each of 10..14, and so on: the survivors timed whole
    # blocks 6..10 to 26..30 (the first step after the restore has no start), four neighbouring pairs; the
    # spare none whole
    assert {proc: e["blocks"] for proc, e in first.items()} == {"w0": 4, "w1": 4, "w2": 4, "s0": 0}
    chosen = {e["every"] for e in first.values()}
    assert len(chosen) == 1 and min(chosen) >= 1  # every rank agreed on one interval
    every = chosen.pop()
    # the second agreement: every rank timed blocks 36..40 to 81..85 alike (the last two the probe, at an
    # interval of BLOCK or less), so each has the same new pairs, and the survivors keep their calibration's
    steady = second["s0"]["blocks"]
    assert steady > 0
    assert {proc: e["blocks"] for proc, e in second.items()} == {
        "w0": 4 + steady, "w1": 4 + steady, "w2": 4 + steady, "s0": steady}
    assert {e["was"] for e in second.values()} == {every} and len({e["every"] for e in second.values()}) == 1
    later = second["s0"]["every"]
    snapshots = sorted({e["step"] for e in job.named("snapshot") if e["gen"] == 1 and e["step"] >= CALIBRATION_STEPS})
    assert snapshots == [s for s in range(CALIBRATION_STEPS, steps + 1)  # the calibration's end, then agreed
                         if snapshots_after(s, None if s == CALIBRATION_STEPS else every if s <= again else later)]
    assert [(i["generation"], i["step"], i["every"], i["replay_steps"]) for i in job.summary["snapshot_intervals"]] \
        == [(1, CALIBRATION_STEPS, every, longest_gap(every)), (1, again, later, longest_gap(later))]
    assert all(i["replay_s"] > 0 for i in job.summary["snapshot_intervals"])
    # host memory: two slots of its snapshot per worker, in shared memory; the spare, on the same machine,
    # maps them (two per held rank) and allocates nothing of its own (docs/benchmarks.md)
    size = {r: max(e["bytes"] for e in job.named("snapshot") if e["rank"] == r and e["gen"] == 0) for r in range(4)}
    assert {e["sent"] for e in job.named("snapshot")} == {0}  # nothing crossed a stream
    memory = job.summary["memory"]
    assert (memory["w1"]["slots_bytes"], memory["w1"]["replica_bytes"]) == (2 * size[1], 0)
    assert memory["s0"]["replica_mapped_bytes"] == sum(2 * n for n in size.values())
    assert (memory["s0"]["replica_bytes"], memory["s0"]["replica_held_bytes"]) == (0, 0)
    # w0 holds rank 3's replicas after the recovery (the pool is empty): the restored snapshot is resent as a
    # stream (the slot it came from is the dead rank's arena, which no one can map anew) into a slot of w0's
    # own, which the next snapshots, mapped, replace
    assert (memory["w0"]["total_bytes"], memory["w0"]["replica_bytes"]) == (2 * size[0] + size[3], size[3])
    assert memory["w0"]["replica_mapped_bytes"] == 2 * size[3]
