"""Tells a failure of some rank (recover from it) from an error of the script's own (stop the job).

The rule, by type and by where an error was raised, never by the words of its message:

1. PeerFailure (and SwapAborted, a wait on peers past its deadline): raised where DeadPool itself
   communicates (its collectives, joining a group, replica streams, the abort): a failure, at once.
2. Any other DeadPoolError: DeadPool's own verdict (a protocol breach, a bad config): not a failure.
3. Anything else is a failure only if the coordinator aborts this generation: a peer's death always ends in
   an abort (or in the job's end), a bug of the script's never does. How long to wait for the abort depends
   on where the error came from: a RuntimeError raised inside torch.distributed (the script's own
   `dist.all_reduce`, FSDP's collectives) waits as long as a survivor waits for the next plan, since gloo
   raises a dead peer's error as a plain RuntimeError; any other error only a moment (ABORT_GRACE_S).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable

import torch.distributed as dist

from deadpool.errors import CheckpointError, ConfigError, DeadPoolError, PeerFailure, SwapAborted
from deadpool.runtime.terminate import before_exit

RECOVERABLE = (PeerFailure, SwapAborted)  # what a survivor recovers from on sight; anything else is judged
ABORT_GRACE_S = 1.0  # an error from outside torch.distributed counts as a failure if the abort comes this soon


@dataclass(frozen=True)
class Verdict:
    failure: bool
    reason: str


def raised_in_torch_distributed(error: BaseException) -> bool:
    """True for a RuntimeError raised inside torch.distributed: one of its types (DistError), or raised by
    the innermost frame of its traceback being torch.distributed's code (a c10d call, FSDP's collectives)."""
    if isinstance(error, dist.DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("torch.distributed")


def classify(error: BaseException, aborted: Callable[[], bool], ended: Callable[[], bool], plan_wait_s: float,
             poll_s: float, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> Verdict:
    """The rule of this module's docstring. `aborted()`: this generation's abort was seen; `ended()`: the
    job is shutting down (no abort will come)."""
    if isinstance(error, RECOVERABLE):
        return Verdict(True, f"{type(error).__name__} raised by DeadPool")
    if isinstance(error, DeadPoolError):
        return Verdict(False, f"{type(error).__name__} is DeadPool's own verdict")
    inside = raised_in_torch_distributed(error)
    where, patience = ("inside", plan_wait_s) if inside else ("outside", ABORT_GRACE_S)
    where += " torch.distributed"
    start = clock()
    while True:
        if aborted():
            return Verdict(True, f"raised {where}, and the generation was aborted within {clock() - start:.2f} s")
        if ended():
            return Verdict(False, f"raised {where}, and the job ended without aborting the generation")
        if clock() - start >= patience:
            return Verdict(False, f"raised {where}, and the generation was not aborted within {patience:g} s")
        sleep(poll_s)


def report_script_errors(publish: Callable[[dict[str, Any]], None], whose: Callable[[], dict[str, Any]],
                         judged: Callable[[BaseException], bool]) -> None:
    """Makes an uncaught exception that is no peer's failure known to the coordinator before the traceback
    is printed, so that it stops the job instead of replaying the error on a spare: one the step loop let
    through (`judged`: the script's error, or a bug of DeadPool's that a spare would meet again), or,
    raised outside the loop, one neither DeadPool's (a ConfigError is the user's) nor raised inside
    torch.distributed (whose failure it is cannot be told there)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        outside = not (isinstance(error, DeadPoolError) or raised_in_torch_distributed(error))
        if isinstance(error, Exception) and (judged(error) or isinstance(error, ConfigError) or outside):
            first = str(error).splitlines()[0] if str(error) else ""
            refused = isinstance(error, CheckpointError)  # --resume was given another job's checkpoint: no bug
            try:
                publish({**whose(), "error": f"{kind.__name__}: {first}", "refused": refused})
            except Exception:  # the coordinator is gone: the exit code still tells
                pass
        previous(kind, error, tb)

    sys.excepthook = hook



def end_quietly_after_errors() -> None:
    """Ends the process with os._exit(1) after an uncaught exception, once its traceback is printed and the
    atexit handlers registered since ran (a script's, registered after init(), run first). The interpreter's
    finalization would otherwise destroy process groups whose gloo threads may still hold work (a replica
    being sent, an async collective), which aborts the process with C++'s "terminate called without an
    active exception" after an ordinary script error (torch does not destroy its groups before
    finalization: pytorch/pytorch#179291 was abandoned). An atexit handler, not the excepthook, ends it:
    torch.distributed's excepthook, installed over this one by every init_process_group, prints the
    traceback only after the hooks it wraps return."""
    crashed: list[bool] = []
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if isinstance(error, Exception):
            crashed.append(True)
        previous(kind, error, tb)

    def leave() -> None:
        if crashed:
            before_exit()  # last words if the launcher is gone, and what must run at any exit (terminate.py)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = hook
    atexit.register(leave)
