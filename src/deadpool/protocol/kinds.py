"""The words processes exchange whose values are fixed: roles, progress phases, exit kinds, job endings.

Each is a str enum, so it is written to JSON (and compared with what a reader holds) as its plain value.
"""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """What a process was started as. Its name says it too (w0, s1): process names are made from the role's
    letter and a number, and never reused within a job."""

    WORKER = "worker"
    SPARE = "spare"

    @classmethod
    def of(cls, name: str) -> Role:
        """The role a process named `name` was started as (a spare that took a rank keeps its name)."""
        return cls.SPARE if name.startswith("s") else cls.WORKER


class Phase(str, enum.Enum):
    """Progress phases the coordinator treats apart (coordinator/hangs.py); a rank's other phases are the
    points of its step it names freely (forward, optimizer, commit, ...)."""

    START = "start"        # the script's set-up, before session.run: may take any time, never judged hung
    FINISHED = "finished"  # the last phase a rank reports: the silence that follows is its exit


class ExitKind(str, enum.Enum):
    """How a process's exit counts (coordinator/policy.classify_exit)."""

    FINISHED = "finished"          # exited 0: done training
    SCRIPT_ERROR = "script_error"  # its script raised: replaying would raise again, so the job stops
    FAILURE = "failure"            # killed, crashed, fenced: a spare takes its rank


class Outcome(str, enum.Enum):
    """Where the job as a whole stands (the job-status record)."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class Ending(str, enum.Enum):
    """How the coordinator ended the job (the shutdown record)."""

    DONE = "done"
    FAILED = "failed"
    TERMINATED = "terminated"  # SIGTERM
