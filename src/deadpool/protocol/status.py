"""The job-status record: what the coordinator publishes whenever the job's state changes (`deadpool status`).
Key status, and run_dir/status.json. Writer: the coordinator (coordinator/server.py). Reader: `deadpool status`.

Plain JSON, checked field by field on the way in: a reader refuses a malformed record with a clear error
instead of showing half of it (no pickle anywhere).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from deadpool.errors import ProtocolError
from deadpool.protocol.kinds import Outcome

VERSION = 1


@dataclass(frozen=True)
class Member:
    """One process of the newest plan: a rank, or an idle spare (rank None), and the replicas it holds."""

    proc: str
    rank: int | None
    node: int | None        # None: one machine, no nodes
    holds: tuple[int, ...]  # the ranks whose snapshots it holds


@dataclass(frozen=True)
class Recovery:
    """A completed swap: what failed, which step everyone restored, how long from detection to resuming."""

    generation: int
    cause: str
    restored_step: int | None
    detect_to_resume_s: float
    replaced: Mapping[str, str]  # rank (as JSON keys are) -> the spare that took it


@dataclass(frozen=True)
class JobStatus:
    generation: int
    phase: str                   # the coordinator's (state.Phase): steady, settling, await_ready, ...
    outcome: Outcome
    reason: str | None           # why it failed
    exit_code: int | None
    members: tuple[Member, ...]  # ranks in rank order, then idle spares in pool order
    committed: int | None        # the last committed step
    recoveries: tuple[Recovery, ...]
    hang_timeout_s: float | None  # the one in force (None until every rank has a heartbeat)
    hang_timeout_reason: str

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, **asdict(self)})

    @classmethod
    def from_json(cls, text: str | bytes) -> JobStatus:
        """Refuses anything but a complete record of this version, naming the first field that is wrong."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ProtocolError(f"job status is not JSON: {error}") from None
        fields = _record(raw, "job status", {"version": int, **_TOP})
        if fields["version"] != VERSION:
            raise ProtocolError(f"job status has version {fields['version']}, this reader knows {VERSION}")
        *first, last = (o.value for o in Outcome)
        if fields["outcome"] not in (*first, last):
            raise ProtocolError(f"job status: outcome must be {', '.join(first)} or {last}, got {fields['outcome']!r}")
        members = tuple(Member(**{**m, "holds": tuple(_ints(m["holds"], "members.holds"))})
                        for m in (_record(m, "job status member", _MEMBER) for m in fields["members"]))
        recoveries = tuple(Recovery(**_record(r, "job status recovery", _RECOVERY)) for r in fields["recoveries"])
        for recovery in recoveries:
            _record(recovery.replaced, "job status recovery.replaced", dict.fromkeys(recovery.replaced, str))
        del fields["version"]
        return cls(**{**fields, "outcome": Outcome(fields["outcome"]), "members": members, "recoveries": recoveries})


# field -> its JSON type(s)
_NONE = type(None)
_TOP: dict[str, Any] = {"generation": int, "phase": str, "outcome": str, "reason": (str, _NONE),
                        "exit_code": (int, _NONE), "members": list, "committed": (int, _NONE), "recoveries": list,
                        "hang_timeout_s": (int, float, _NONE), "hang_timeout_reason": str}
_MEMBER: dict[str, Any] = {"proc": str, "rank": (int, _NONE), "node": (int, _NONE), "holds": list}
_RECOVERY: dict[str, Any] = {"generation": int, "cause": str, "restored_step": (int, _NONE),
                             "detect_to_resume_s": (int, float), "replaced": dict}


def _record(raw: object, what: str, kinds: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` as a dict with exactly these fields, each of its kind (a bool is no number here)."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(raw).__name__}")
    missing, unknown = sorted(set(kinds) - set(raw)), sorted(set(raw) - set(kinds))
    if missing or unknown:
        wrong = [f"{kind} {', '.join(names)}" for kind, names in (("missing", missing), ("unknown", unknown)) if names]
        raise ProtocolError(f"{what}: {'; '.join(wrong)}")
    for name, kind in kinds.items():
        value = raw[name]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ProtocolError(f"{what}: {name} has the wrong type ({type(value).__name__}): {value!r}")
    return dict(raw)


def _ints(values: list[Any], what: str) -> list[int]:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ProtocolError(f"job status: {what} must hold rank numbers, got {values!r}")
    return values


def write_status(path: Path, status: JobStatus) -> None:
    """Replaces the file at once (temporary file, rename), readable by its owner only: a reader never sees
    half a record."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(status.to_json())
    os.replace(tmp, path)
