"""Tests for deadpool/runtime/failures.py: a peer's failure is told from the script's own error by type and by
where it was raised (and whether the generation is then aborted), never by the words of its message."""

import subprocess
import sys

import pytest
import torch.distributed as dist

from deadpool.errors import (
    CheckpointError,
    CollectiveAborted,
    ConfigError,
    GenerationAborted,
    PeerFailure,
    ProtocolError,
    SwapAborted,
    WorkerFailure,
)
from deadpool.runtime.failures import ABORT_GRACE_S, classify, raised_in_torch_distributed, report_script_errors


def raised(error: BaseException, module: str = __name__) -> BaseException:
    """`error` as raised by code of `module` (its traceback's innermost frame is there)."""
    try:
        exec("raise error", {"__name__": module, "error": error})
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


IN_C10D = "torch.distributed.distributed_c10d"


class Clock:
    """A fake clock that `sleep` advances; the abort (or the job's end) appears at a given time."""

    def __init__(self, abort_at: float = float("inf"), end_at: float = float("inf")) -> None:
        self.now, self.abort_at, self.end_at, self.polls = 0.0, abort_at, end_at, 0

    def aborted(self) -> bool:
        self.polls += 1
        return self.now >= self.abort_at

    def ended(self) -> bool:
        return self.now >= self.end_at

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def judge(error: BaseException, clock: Clock):
    return classify(error, clock.aborted, clock.ended, plan_wait_s=60.0, poll_s=0.5, clock=lambda: clock.now,
                    sleep=clock.sleep)


@pytest.mark.parametrize("error", [PeerFailure("the gradient all-reduce failed"), CollectiveAborted("abandoned"),
                                   GenerationAborted("generation 0 was aborted"), SwapAborted("no slot")])
def test_deadpools_own_failure_types_are_failures_at_once(error):
    clock = Clock()
    verdict = judge(error, clock)
    assert verdict.failure and verdict.reason == f"{type(error).__name__} raised by DeadPool"
    assert clock.polls == 0 and clock.now == 0


@pytest.mark.parametrize("error", [ProtocolError("ranks disagree"), ConfigError("bad state name")])
def test_deadpools_other_errors_stop_the_job(error):
    verdict = judge(raised(error), Clock(abort_at=0.0))
    assert not verdict.failure and verdict.reason == f"{type(error).__name__} is DeadPool's own verdict"


@pytest.mark.parametrize("error", [
    TimeoutError("socket timed out"),  # the words gloo uses, from the script's own code
    RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:17580"),
    ConnectionResetError("Connection reset by peer"),
    ValueError("text file not found: /data/missing.txt"),
])
def test_the_scripts_own_error_is_not_a_failure_whatever_it_says(error):
    clock = Clock()
    verdict = judge(raised(error), clock)
    assert not verdict.failure
    assert verdict.reason == ("raised outside torch.distributed, and the generation was not aborted within "
                              f"{ABORT_GRACE_S:g} s")
    assert clock.now == ABORT_GRACE_S


def test_any_error_is_a_failure_when_the_generation_is_aborted():
    """A dying peer can surface as any error (a host sync after the communicator was aborted): the abort says so."""
    verdict = judge(raised(ValueError("CUDA error: an illegal memory access")), Clock(abort_at=0.5))
    assert verdict.failure
    assert verdict.reason == "raised outside torch.distributed, and the generation was aborted within 0.50 s"


def test_an_error_inside_torch_distributed_waits_for_the_abort_as_long_as_for_a_plan():
    """The script's own dist.all_reduce raises a dead peer's error as a plain RuntimeError: the coordinator's abort
    may come late (it may wait for a spare node first), and decides."""
    verdict = judge(raised(RuntimeError("Connection closed by peer"), IN_C10D), Clock(abort_at=30.0))
    assert verdict.failure
    assert verdict.reason == "raised inside torch.distributed, and the generation was aborted within 30.00 s"


def test_an_error_inside_torch_distributed_without_an_abort_is_the_scripts():
    """A misuse of a collective (no peer failed): no abort comes, and the error is the script's."""
    clock = Clock()
    verdict = judge(raised(RuntimeError("Tensors must be CPU and dense"), IN_C10D), clock)
    assert not verdict.failure and clock.now == 60.0
    assert verdict.reason == "raised inside torch.distributed, and the generation was not aborted within 60 s"


def test_the_jobs_end_stops_the_wait():
    verdict = judge(raised(RuntimeError("Connection closed by peer"), IN_C10D), Clock(end_at=2.0))
    assert not verdict.failure
    assert verdict.reason == "raised inside torch.distributed, and the job ended without aborting the generation"


def test_where_an_error_was_raised():
    assert raised_in_torch_distributed(raised(RuntimeError("x"), IN_C10D))
    assert raised_in_torch_distributed(raised(RuntimeError("x"), "torch.distributed.fsdp._fully_shard._fsdp_api"))
    assert raised_in_torch_distributed(dist.DistBackendError("NCCL communicator was aborted"))  # a type of its own
    assert not raised_in_torch_distributed(raised(RuntimeError("gloo socket timed out")))
    assert not raised_in_torch_distributed(raised(ValueError("Invalid function argument"), IN_C10D))  # a misuse
    assert not raised_in_torch_distributed(raised(RuntimeError("x"), "torch.nn.functional"))


def test_uncaught_errors_reported_to_the_coordinator(monkeypatch):
    """What stops the job as the script's error: what the step loop let through, and, outside it, an error
    that is neither DeadPool's (but the user's ConfigError) nor raised inside torch.distributed."""
    monkeypatch.setattr(sys, "excepthook", lambda *info: None)
    reports: list[dict] = []
    let_through = raised(RuntimeError("Tensors must be CPU and dense"), IN_C10D)
    misfit = CheckpointError("cannot resume from /ckpt/step-4: it holds the state of another job")
    report_script_errors(reports.append, lambda: {"rank": 1}, lambda error: error in (let_through, misfit))
    for error in (let_through, raised(TimeoutError("socket timed out")), ConfigError("bad name"),
                  WorkerFailure("w1 was fenced out"), raised(RuntimeError("Connection closed by peer"), IN_C10D),
                  misfit):
        sys.excepthook(type(error), error, error.__traceback__)
    assert reports == [{"rank": 1, "error": "RuntimeError: Tensors must be CPU and dense", "refused": False},
                       {"rank": 1, "error": "TimeoutError: socket timed out", "refused": False},
                       {"rank": 1, "error": "ConfigError: bad name", "refused": False},
                       {"rank": 1, "error": f"CheckpointError: {misfit}", "refused": True}]  # refused: exit 2


def test_an_uncaught_error_ends_the_process_after_its_traceback_and_exit_handlers(tmp_path):
    """os._exit(1) once the traceback is printed and the atexit handlers ran: no interpreter finalization,
    whose destruction of gloo groups aborts the process with C++ noise after a script error."""
    script = tmp_path / "script.py"
    script.write_text("import atexit\nfrom deadpool.runtime.failures import end_quietly_after_errors\n"
                      "end_quietly_after_errors()\natexit.register(lambda: print('handler ran', flush=True))\n"
                      "raise ValueError('a bug of the script')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "handler ran\n"
    assert done.stderr.startswith("Traceback") and "ValueError: a bug of the script" in done.stderr
