"""Tests for deadpool/runtime/loop.py: what the step loop tells the hang detector while torch.compile runs."""

from pathlib import Path

import torch
from torch._dynamo.callback import callback_handler

from deadpool.events import EventLog, read_events
from deadpool.runtime.loop import _count_compilation_as_waiting
from deadpool.runtime.watch import Progress


def test_a_rank_compiling_counts_as_waiting_and_each_compilation_is_logged(tmp_path: Path) -> None:
    """A first step that compiles for minutes is not a hang: while torch.compile runs, the rank's phase is
    `compile` and it counts as waiting; afterwards its phase is what it was, and a `compiled` event says how
    long it took, at which step. A script's torch._dynamo.reset() drops every compile callback: the loop's
    check at each step registers them again."""
    progress, events = Progress(), EventLog(tmp_path / "events.jsonl", role="worker", proc="w0")
    progress.mark(3, "forward")
    before = list(callback_handler.start_callbacks), list(callback_handler.end_callbacks)
    seen: list[tuple[str, bool]] = []
    try:
        keep = _count_compilation_as_waiting(progress, events)
        torch._dynamo.reset()  # as a script may, between two steps
        assert not callback_handler.start_callbacks
        keep()  # the next step's check
        keep()  # registered once, however often it is called
        callback_handler.register_start_callback(lambda _: seen.append((progress.phase, progress.waiting)))
        compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
        assert len(callback_handler.start_callbacks) == len(callback_handler.end_callbacks) + 1
    finally:  # the callbacks are global to the process: leave it as it was
        callback_handler.start_callbacks[:], callback_handler.end_callbacks[:] = before
    assert seen == [("compile", True)]
    assert (progress.phase, progress.waiting) == ("forward", False)
    [event] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "compiled"]
    assert event["step"] == 3 and event["duration_s"] >= 0
