"""Structured events: every process appends one JSON object per line to the run's events.jsonl."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator


class EventLog:
    """Appends events with one `write` each, so lines from many processes never interleave.

    Lines are far below the size at which O_APPEND writes to a local file could be split, and a
    write to the page cache costs microseconds, so the training thread may log directly.
    """

    def __init__(self, path: Path, *, role: str, proc: str) -> None:
        self.path = Path(path)
        self.role = role
        self.proc = proc
        self.rank: int | None = None
        self.generation = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "t": time.monotonic(), "wall": time.time(), "role": self.role,
                  "proc": self.proc, "rank": self.rank, "gen": self.generation, "pid": os.getpid(), **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Yields the events of a run in file order; a torn last line (a killed writer) is skipped."""
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
