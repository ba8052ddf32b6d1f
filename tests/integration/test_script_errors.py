"""A bug in the training script is not a node failure: the job stops with its traceback, no spare is used."""

from __future__ import annotations

import time

from deadpool.config import Fault

from .conftest import SCRIPTS, run_job


def test_an_exception_in_train_step_stops_the_job_without_a_swap(tmp_path):
    started = time.monotonic()
    job = run_job(tmp_path, workers=2, faults=(Fault(kind="error", rank=1, step=5, phase="forward"),))
    assert time.monotonic() - started < 60
    assert job.code == 1 and job.summary["swaps"] == 0
    [stopped] = job.named("script_error")
    assert (stopped["rank"], stopped["step"], stopped["proc"]) == (1, 5, "w1")
    assert job.named("job_failed")[0]["t"] - job.named("fault_injected")[0]["t"] < 15
    error = job.summary["error"]
    assert error.startswith("error in the training script on rank 1 (w1) at step 5: raised InjectedError: "
                            "injected error on rank 1 in forward of step 5")
    assert "not a node failure, so no spare was used" in error and "--spares" not in error
    assert not job.named("failure_detected") and not job.named("plan_published")[1:]
    assert not job.named("spare_called")  # the spare was never touched
    logs = {p.stem: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    assert sum(log.count("Traceback (most recent call last)") for log in logs.values()) == 1
    assert "InjectedError: injected error on rank 1" in logs["w1"]
    # each log is the process's stdout and stderr: no C++ abort after the error, in any process
    assert not [name for name, log in logs.items() if "terminate called" in log]


def test_a_script_that_fails_before_init_stops_the_job(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import deadpool\n\nraise ValueError('a bug before init')\ndeadpool.init()\n")
    started = time.monotonic()
    job = run_job(tmp_path / "run", workers=2, script=script, script_args=())
    assert time.monotonic() - started < 60
    assert job.code == 1 and job.summary["swaps"] == 0
    assert "exited with code 1 before deadpool.init()" in job.summary["error"]
    assert "not a node failure" in job.summary["error"]
    assert not job.named("failure_detected") and not job.named("spare_called")


def test_a_scripts_own_timeout_error_stops_the_job_without_a_swap(tmp_path):
    """An error of the script's own that speaks of sockets and timeouts is still the script's: it is not
    raised where DeadPool communicates, and no abort follows it."""
    job = run_job(tmp_path, steps=6, workers=2, spares=1, script=SCRIPTS / "own_timeout.py", script_args=())
    assert job.code == 1 and job.summary["swaps"] == 0
    [stopped] = job.named("script_error")
    assert (stopped["rank"], stopped["step"], stopped["proc"]) == (1, 3, "w1")
    assert job.summary["error"].startswith("error in the training script on rank 1 (w1) at step 3: raised "
                                           "TimeoutError: socket timed out")
    assert not job.named("failure_detected") and not job.named("spare_called")
    assert [e["proc"] for e in job.named("failure_seen")] in ([], ["w0"])  # w0 may see w1 go, never w1 itself
    [judged] = [e for e in job.named("error_judged") if e["proc"] == "w1"]
    assert (judged["error"], judged["failure"]) == ("TimeoutError", False)
    assert judged["reason"] == "raised outside torch.distributed, and the generation was not aborted within 1 s"
    log = (tmp_path / "logs" / "w1.log").read_text()
    assert log.count("Traceback (most recent call last)") == 1 and "TimeoutError: socket timed out" in log
