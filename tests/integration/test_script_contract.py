"""What a training script may count on, and the mistakes of a first port named as the script's, with real
processes: the smallest jobs of tests/integration/scripts/tiny.py (one or two workers, one spare)."""

from __future__ import annotations

import pytest

from deadpool.config import Fault

from .conftest import SCRIPTS, Job, run_job

TINY = SCRIPTS / "tiny.py"


def tiny(run_dir, *args: str, steps: int = 6, workers: int = 1, **job) -> Job:
    return run_job(run_dir, steps=steps, workers=workers, spares=1, script=TINY, script_args=args, **job)


def test_an_unseeded_script_drawing_its_data_in_set_up_is_bit_for_bit_after_a_swap(tmp_path):
    """init() seeds torch with --seed plus the rank, a spare once it knows its rank: the spare that takes
    rank 0 draws the same data (torch.randn, before run) as the worker it replaced."""
    reference = tiny(tmp_path / "reference")
    swapped = tiny(tmp_path / "swapped", faults=(Fault(kind="kill", rank=0, step=3, phase="backward"),))
    assert reference.code == swapped.code == 0 and swapped.summary["swaps"] == 1
    assert swapped.summary["final_state_sha256"] == reference.summary["final_state_sha256"]
    assert swapped.summary["losses"] == reference.summary["losses"]


def test_a_seed_set_after_init_wins_and_one_set_before_init_is_replaced(tmp_path):
    """init() seeds torch with --seed plus the rank: a script's torch.manual_seed before init() changes nothing,
    one after init() decides the model and data whatever --seed is (drawn from torch's generator in the set-up;
    the losses, which depend on them only, are compared: --seed still seeds Python's and NumPy's generators)."""
    def final(name: str, *args: str, seed: int = 0) -> list[float]:
        job = tiny(tmp_path / name, *args, steps=2, seed=seed)
        assert job.code == 0
        return job.summary["losses"]["0"]

    before = final("before-1", "--seed-before-init", "1")
    assert before == final("before-2", "--seed-before-init", "2")
    after = final("after", "--seed-after-init", "1", seed=9)
    assert after == final("after-other-seed", "--seed-after-init", "1", seed=3)
    assert after != before  # torch seeded with 1, not with --seed 0 plus rank 0


@pytest.mark.parametrize("mistake, message", [
    ("outside_run", "UsageError: the model was used outside session.run(): call it only in the step function"),
    ("register_ddp", "UsageError: 'model' is a torch DistributedDataParallel: pass the plain module to "
                     "session.wrap instead"),
    ("wrap_ddp", "UsageError: session.wrap got a torch DistributedDataParallel: pass the plain module to "
                 "session.wrap instead"),
    ("nothing_trainable", "UsageError: nothing trainable: session.run() found no model. Pass the model to "
                          "session.wrap"),
    ("run_twice", "UsageError: session.run() was called a second time: call it once"),
    ("no_optimizer", "UsageError: register the optimizer before session.run(): session.register(optimizer=optimizer)"),
    ("global_object", "ConfigError: cannot snapshot variables.position: values of type Position are not supported "
                      "(use tensors, numpy arrays, numbers, strings, lists, tuples and dicts). "
                      "train_step_rebinding_an_object rebinds it with nonlocal/global, so DeadPool snapshots it"),
])
def test_a_usage_error_stops_the_job_as_the_scripts_own_naming_what_to_change(tmp_path, mistake, message):
    job = tiny(tmp_path, "--mistake", mistake, steps=2)
    assert job.code == 1 and job.summary["swaps"] == 0
    assert job.summary["error"].startswith("error in the training script on rank 0 (w0) at step ")
    assert message in job.summary["error"] and "no spare was used" in job.summary["error"]
    assert not job.named("failure_detected") and not job.named("spare_called")


def test_session_replaying_is_true_exactly_for_the_steps_run_again_after_a_swap(tmp_path):
    """Snapshots every 4 steps, rank 1 killed in step 7: both ranks (the spare too) run the steps after the
    restored snapshot (4, or 0 if rank 1's copy of 4 was still on its way) again, and see session.replaying
    there only: as many steps as summary.json's steps_replayed. The first step after the recovery is
    snapshotted although the interval would skip it."""
    job = tiny(tmp_path, steps=8, workers=2, snapshot_every=4,
               faults=(Fault(kind="kill", rank=1, step=7, phase="backward"),))
    assert job.code == 0 and job.summary["swaps"] == 1
    [recovery] = job.summary["recoveries"]
    replayed = range(recovery["restored_step"] + 1, 7)
    assert len(replayed) == job.summary["steps_replayed"] >= 2
    seen = {(e["proc"], e["step"]) for e in job.named("replaying")}
    assert seen == {(proc, step) for proc in ("w0", "s0") for step in replayed}
    assert {(e["proc"], e["step"]) for e in job.named("step") if e["replay"]} == seen
    # the first step after the recovery is snapshotted whatever the interval, then every 4th again
    first = recovery["restored_step"] + 1
    after = sorted({e["step"] for e in job.named("snapshot") if e["gen"] == recovery["generation"]})
    assert after == [first] + [s for s in range(first + 1, 9) if s % 4 == 0], after


def test_a_job_of_one_worker_replays_unknowingly_no_survivor_saw_the_steps(tmp_path):
    """One worker killed in step 7: its spare runs the steps after the restored snapshot again,
    but with no surviving rank to say they were run, `replaying` stays false (the README's caveat)."""
    job = tiny(tmp_path, steps=8, workers=1, snapshot_every=4, faults=(Fault(kind="kill", rank=0, step=7),))
    assert job.code == 0 and job.summary["swaps"] == 1
    [recovery] = job.summary["recoveries"]
    again = [e["step"] for e in job.named("step") if e["proc"] == "s0" and e["step"] < 7]
    assert again == list(range(recovery["restored_step"] + 1, 7)) and again  # run again by the spare
    assert not job.named("replaying") and not [e for e in job.named("step") if e["replay"]]


def test_a_step_function_returning_nothing_gets_its_losses_from_session_log(tmp_path):
    """A loss given to session.log on steps 1 and 3, none at all on step 2: that step's loss is null."""
    job = tiny(tmp_path, "--log-loss", steps=3)
    assert job.code == 0
    logged = [e["loss"] for e in job.named("train")]
    assert len(logged) == 2 and all(isinstance(loss, float) for loss in logged)
    assert job.summary["losses"] == {"0": [logged[0], None, logged[1]]} and job.summary["final_loss"] == logged[-1]


def test_ranks_given_different_steps_stop_the_job_naming_the_disagreement_and_no_rank_is_fenced(tmp_path):
    job = tiny(tmp_path, "--steps-of-rank1", "5", steps=3, workers=2)
    assert job.code == 1 and job.summary["swaps"] == 0
    assert ("raised UsageError: the ranks disagree on the steps to run: session.run(steps=...) is 3 on some ranks "
            "and 5 on others") in job.summary["error"]
    assert job.summary["final_step"] == 1  # found at the end of step 1, before any rank ran on alone
    assert not job.named("hang_detected") and not job.named("failure_detected") and not job.named("spare_called")


def test_a_counter_kept_in_an_attribute_is_stopped_by_the_replay_check_naming_the_step(tmp_path):
    """The data position lives in an attribute: the survivor's is not rolled back, so it replays the steps
    after the restored snapshot on other batches than the first time; the job stops at the first of them."""
    job = tiny(tmp_path, "--counter-in-attribute", steps=8, workers=2, snapshot_every=4,
               faults=(Fault(kind="kill", rank=1, step=7, phase="backward"),))
    assert job.code == 1
    [recovery] = job.summary["recoveries"]
    first = recovery["restored_step"] + 1
    assert job.summary["error"].startswith(
        f"error in the training script on rank 0 (w0) at step {first}: raised ReplayMismatch: step {first} replayed "
        "on rank 0 after a failure was fed other inputs than the first time")
    assert "a counter or data position kept in an attribute of your own object" in job.summary["error"]


def test_an_error_in_a_called_spares_set_up_names_the_spare_the_rank_its_step_and_that_a_spare_was_used(tmp_path):
    job = tiny(tmp_path, "--spare-set-up-fails", steps=5, workers=2,
               faults=(Fault(kind="kill", rank=1, step=3, phase="backward"),))
    assert job.code == 1
    [stopped] = job.named("script_error")
    assert stopped["proc"] == "s0"
    assert job.summary["error"].startswith("error in the training script on spare s0, in the script's set-up as it "
                                           "took over rank 1 at step ")
    assert "raised EOFError: Ran out of input" in job.summary["error"]
    assert "a spare was used for the failure before it" in job.summary["error"]


def test_a_rank_killed_after_session_run_returned_is_not_replaced_and_the_others_finish_their_own_code(tmp_path):
    """Rank 1 is SIGKILLed in the script's code after session.run() (its final evaluation): no spare is called,
    as no rank trains any more; rank 0 ends its own code after run() (it logs after rank 1's death), then the
    job fails, exit 1, saying that training is complete at its last step."""
    job = tiny(tmp_path, "--rank1-dies-after-run", steps=3, workers=2)
    assert job.code == 1 and job.summary["swaps"] == 0 and job.summary["final_step"] == 3
    assert job.summary["error"].startswith("rank 1 (w1, pid ") and (
        "killed by SIGKILL after ranks [0, 1] had finished training: a failure in the script's code after "
        "session.run() is not recovered. Training is complete on every rank: its last step, 3, is committed."
        ) in job.summary["error"]
    [death] = job.named("failure_detected")
    [after] = job.named("after_run")
    assert after["proc"] == "w0" and after["t"] > death["t"]
    assert not job.named("spare_called") and not job.named("plan_published")[1:]
