"""The records of a job's life that cross processes through the control plane: frozen, one writer each.

Each names its key, its one writer and its readers; those of a generation carry its number, and a reader
ignores (or refuses) one of another generation. Parsed strictly (protocol/record.py). The plan is in
protocol/plan.py, the node agents' records in protocol/nodes.py, the job status in protocol/status.py.

    coordinator --Published, Abort, Commit, Target, Running, Shutdown, Fence, PersistOrder--> processes
    process     --Started, Heartbeat, Durable, Ready, Resumed, ScriptError, Device, PersistReport--> coordinator
    rank        --Listening, Handover (its replica streams' own keys)--> the holder or taker at the other end
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from deadpool.errors import ProtocolError
from deadpool.protocol.kinds import Ending
from deadpool.protocol.record import Record, json_object


def _parse(kind: str, text: str | bytes, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """The JSON object of one record, with every field present and of its type."""
    raw = json_object(kind, text)
    for name, types in fields.items():
        allowed = types if isinstance(types, tuple) else (types,)
        value = raw.get(name)
        is_bool_for_number = isinstance(value, bool) and bool not in allowed  # JSON true is no step number
        if name not in raw or not isinstance(value, allowed) or is_bool_for_number:
            raise ProtocolError(f"malformed {kind} record: field {name!r} is missing or not {types}")
    return {name: raw[name] for name in fields}


@dataclass(frozen=True)
class PersistOrder:
    """The coordinator's order to write committed step `step` to disk; writers[rank] is the process that
    writes that rank's snapshot (an idle holder of its replica, else the rank itself). Writer: coordinator."""

    step: int
    gen: int
    writers: tuple[str, ...]
    reason: str

    def ranks_of(self, proc: str) -> list[int]:
        return [rank for rank, writer in enumerate(self.writers) if writer == proc]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PersistOrder:
        raw = _parse("PersistOrder", text, {"step": int, "gen": int, "writers": list, "reason": str})
        if not all(isinstance(w, str) for w in raw["writers"]):
            raise ProtocolError("malformed PersistOrder record: writers must be process names")
        return cls(raw["step"], raw["gen"], tuple(raw["writers"]), raw["reason"])


@dataclass(frozen=True)
class PersistReport:
    """A writer's answer to a PersistOrder: its part of checkpoint `step` is on disk (ok) or why not.
    Writer: the process `proc`, once per order."""

    step: int
    proc: str
    ranks: tuple[int, ...]
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PersistReport:
        raw = _parse("PersistReport", text, {"step": int, "proc": str, "ranks": list, "ok": bool, "error": str,
                                             "nbytes": int, "seconds": (int, float)})
        return cls(raw["step"], raw["proc"], tuple(raw["ranks"]), raw["ok"], raw["error"], raw["nbytes"],
                   float(raw["seconds"]))


# ---- the coordinator's ---------------------------------------------------------------------

@dataclass(frozen=True)
class Published(Record):
    """The newest generation whose plan is out. Key gen. Writer: the coordinator, after the plan. Readers:
    processes waiting for a new generation (recovery, idle spares)."""

    gen: int


@dataclass(frozen=True)
class Abort(Record):
    """Generation `gen` is over (a failure). Key abort/{g}. Writer: the coordinator. Readers: the watch of each
    process in it (runtime/watch.py), and recoveries waiting in it."""

    gen: int
    reason: str


@dataclass(frozen=True)
class Commit(Record):
    """The newest step every rank holds durably in generation `gen` (None: none yet), and the steps skipped
    that can never be committed. Key g{g}/committed. Writer: the coordinator. Readers: each rank's snapshot
    engine and step loop, and holders (runtime/holding.py): neither overwrites the committed slot."""

    gen: int
    step: int | None
    abandoned: tuple[int, ...]


@dataclass(frozen=True)
class Target(Record):
    """The step a recovery restores, or a fresh start. Key g{g}/target. Writer: the coordinator. Readers:
    every rank of g."""

    gen: int
    step: int | None  # None: nothing was committed (a death in start-up), every rank begins afresh


@dataclass(frozen=True)
class Running(Record):
    """Generation `gen` finished recovering: its replica placement is the live one. Key running/{g}. Writer:
    the coordinator. Readers: idle spares, which then drop the replicas they no longer hold."""

    gen: int


@dataclass(frozen=True)
class Shutdown(Record):
    """The job is over. Key shutdown. Writer: the coordinator, last. Readers: every process and node agent."""

    how: Ending


@dataclass(frozen=True)
class Fence(Record):
    """Kill `proc` (SIGKILL): it is hung or beyond reach. Key fence/{proc}. Writer: the coordinator (through
    coordinator/nodes.py, or launcher/inprocess.py's Peers). Reader: the node agent running `proc`."""

    proc: str


# ---- each process's --------------------------------------------------------------------------

@dataclass(frozen=True)
class Started(Record):
    """`proc` reached deadpool.init(): if it exits later, it failed while DeadPool ran. Key started/{proc}.
    Writer: the process. Reader: the coordinator."""

    proc: str


@dataclass(frozen=True)
class Heartbeat(Record):
    """One rank's pulse: a beat counter and where its training thread is (step, phase, marks, whether it
    waits on peers); any change is a sign of life. Key hb/{proc}. Writer: the rank's watch thread
    (runtime/watch.py), and its training thread's last words. Reader: the coordinator (coordinator/fences.py),
    to which a pulse of another generation is a sign of life, not progress."""

    gen: int
    beat: int
    step: int
    phase: str
    marks: int
    waiting: bool
    step_s: float | None


@dataclass(frozen=True)
class ScriptError(Record):
    """The user's script raised: the job stops with its traceback. Key error/{proc}. Writer: the process
    (runtime/failures.report_script_errors). Reader: the coordinator, when the process exits."""

    rank: int | None
    step: int | None
    error: str
    taking_over: int | None = None  # a called spare's set-up raised: the step it was restoring for its rank
    gen: int | None = None          # the generation it raised in
    refused: bool = False           # not the script's error: the checkpoint given to --resume is another job's


@dataclass(frozen=True)
class Device(Record):
    """The GPU `proc` trains on; a spare without one of its own takes the device of the rank it replaces.
    Key device/{proc}. Writer: the process. Readers: spares taking its rank over (runtime/member.py)."""

    proc: str
    gpu: int


# ---- ranks, per generation -----------------------------------------------------------------------

@dataclass(frozen=True)
class Durable(Record):
    """The snapshot steps rank `rank` holds durably in generation `gen` (local copy + every holder's ack),
    the ones it skipped (--backlog-policy skip), and under data parallelism each step's fingerprint of the
    replicated state: the hash of all of it, or sliced (runtime/pieces.py) of the rank's own piece, with an
    audit (piece, hash of that piece of the rank's live state). Key g{g}/durable/{rank}. Writer: the rank's
    snapshot engine. Reader: the coordinator (commits, the divergence check); no report yet reads as none held."""

    gen: int
    rank: int
    steps: tuple[int, ...]
    skipped: tuple[int, ...]
    fingerprints: Mapping[int, int] = field(default_factory=dict)
    audits: Mapping[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Ready(Record):
    """The snapshot steps rank `rank` can restore in recovering generation `gen`, checksums verified.
    Key g{g}/ready/{rank}. Writer: the rank (runtime/recovery.py). Reader: the coordinator (picks the target)."""

    gen: int
    rank: int
    steps: tuple[int, ...]


@dataclass(frozen=True)
class Resumed(Record):
    """Rank `rank` restored `step` and runs generation `gen`. Key g{g}/resumed/{rank}. Writer: the rank.
    Reader: the coordinator (the recovery is over when every rank resumed)."""

    gen: int
    rank: int
    step: int


@dataclass(frozen=True)
class Listening(Record):
    """Where the sender of a replica stream of generation `gen` waits for its holder (or taker) to connect.
    Key {stream}addr. Writer: the sender (runtime/stream.offer). Reader: the other end (stream.join)."""

    gen: int
    host: str
    port: int


@dataclass(frozen=True)
class Handover(Record):
    """How many snapshots of a taken rank its holder streams to the taker in generation `gen`. Key
    g{g}/xfer/{rank}/count. Writer: the holder (runtime/replica.send_replica). Reader: the taker."""

    gen: int
    snapshots: int
