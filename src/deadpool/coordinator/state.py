"""The coordinator's typed values: its state, the inputs its shell gathers each tick, the effects it applies.

Everything here is immutable: `machine.advance` returns a new state instead of changing one, so a test can
hold any state, feed it inputs with a fake clock and compare what comes out. No I/O, no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

from deadpool.config import JobConfig
from deadpool.coordinator.hangs import Alive
from deadpool.coordinator.policy import Durable
from deadpool.protocol.kinds import Ending, Role
from deadpool.protocol.plan import Plan
from deadpool.protocol.records import Heartbeat, PersistOrder, PersistReport, ScriptError
from deadpool.protocol.status import JobStatus, Recovery


class Phase(enum.Enum):
    STEADY = "steady"
    SETTLING = "settling"
    AWAIT_READY = "await_ready"
    AWAIT_RESUMED = "await_resumed"
    AWAIT_SPARE = "await_spare"


# ---- records ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Failure:
    """One process lost in a recovery; its fields are the swap_complete event's `failed` entries."""

    proc: str
    rank: int | None
    exit: str  # how it ended, as a user reads it (policy.classify_exit's reason)
    who: str   # "rank 1 (w1, pid 42)" or "spare s0 (pid 43)"


@dataclass(frozen=True)
class Hang:
    """The verdict that started a recovery, when a hang did: the swap_complete event's `hang`."""

    rank: int | None  # None: a spare (an idle holder of replicas)
    proc: str
    last_progress_t: float
    verdict_t: float


@dataclass(frozen=True)
class Swap:
    """The recovery in flight, from its first failure to the generation that completes it."""

    detected_t: float
    cause: str
    failed: tuple[Failure, ...] = ()
    hang: Hang | None = None


@dataclass(frozen=True)
class Joining:
    """A spare node that joined the running job, while its spares start."""

    host: str
    procs: Mapping[str, int]  # its spares -> their placeholder ranks
    deadline: float           # by when they must have started (--connect-timeout)


@dataclass(frozen=True)
class Refill:
    """Spare nodes entering the pool, from their spares' start to the generation that places replicas on them."""

    t: float
    nodes: tuple[int, ...]
    procs: tuple[str, ...]


@dataclass(frozen=True)
class Liveness:
    """The coordinator's view of one rank's heartbeat, on its own clock."""

    beat_t: float
    progress_t: float
    beat: Heartbeat | None = None                 # the last heartbeat read
    progress: tuple[int, str, int] = (-1, "", 0)  # step, phase, marks: any change is progress


@dataclass(frozen=True)
class Persisting:
    """A checkpoint being written (coordinator/persist.py): ordered, then finalized once every writer reported."""

    step: int
    writers: tuple[str, ...]  # rank -> the process writing its snapshot
    ordered_t: float
    deadline: float
    reason: str
    finalizing: bool = False


# ---- inputs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExitReport:
    """A process that ended, with what the store says about it."""

    name: str
    returncode: int
    pid: int | None
    started: bool                       # it reached deadpool.init()
    script_error: ScriptError | None = None
    lost_with_node: str | None = None   # no exit of its own: its node was lost ("node 2 (why)")


@dataclass(frozen=True)
class Inputs:
    """What the shell read in one tick. Reports are read for the phase the state was in before the tick."""

    exits: tuple[ExitReport, ...] = ()
    joined: Mapping[int, str] = field(default_factory=dict)   # spare nodes that joined: node -> host
    durable: Mapping[int, Durable] = field(default_factory=dict)  # steady: rank -> its durable report
    beats: Mapping[str, Heartbeat] = field(default_factory=dict)  # steady: rank's process -> its heartbeat
    ready: Mapping[int, list[int]] = field(default_factory=dict)  # awaiting ready: rank -> intact steps
    resumed: frozenset[int] = frozenset()                          # awaiting resumed: ranks that rejoined
    started: frozenset[str] = frozenset()                          # joining spares that reached init()
    alive: Mapping[str, int] = field(default_factory=dict)         # planned process -> its beacon's count
    # When each heartbeat, and each process's last sign of life (its beacon or heartbeat, whichever came later)
    # arrived, on the coordinator's clock (the store's own table times its writes): a tick that reads a beat
    # late still dates it right. A process absent: arrived at the tick.
    beats_t: Mapping[str, float] = field(default_factory=dict)
    alive_t: Mapping[str, float] = field(default_factory=dict)
    persist_reports: Mapping[str, PersistReport] = field(default_factory=dict)  # writers of the order in flight
    finalized: Mapping[int, bool] = field(default_factory=dict)    # checkpoint step -> complete on disk
    terminate: bool = False                                        # SIGTERM: persist the newest commit, then stop


# ---- effects ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PublishPlan:
    """Empty durable reports, then the plan, then the generation number (and the events' generation)."""

    plan: Plan


@dataclass(frozen=True)
class Abort:
    gen: int
    reason: str


@dataclass(frozen=True)
class WriteCommit:
    gen: int
    step: int | None
    abandoned: tuple[int, ...]


@dataclass(frozen=True)
class WriteTarget:
    gen: int
    step: int | None  # None: nothing was committed yet, every rank begins afresh (loop._begin)


@dataclass(frozen=True)
class MarkRunning:
    gen: int


@dataclass(frozen=True)
class Spawn:
    """Resets the process's heartbeat, starts it, and logs process_spawned with its pid."""

    name: str
    role: Role
    rank: int


@dataclass(frozen=True)
class Fence:
    name: str


@dataclass(frozen=True)
class Relabel:
    name: str
    label: str


@dataclass(frozen=True)
class OrderPersist:
    order: PersistOrder


@dataclass(frozen=True)
class Finalize:
    """Every part of checkpoint `step` is on disk: the shell assembles it (disk/) and reports back."""

    step: int
    ordered_t: float | None  # None: the parts were written as the ranks finished, unordered
    nbytes: int | None  # None with ordered_t: no writer reported to the coordinator (their persist_part events did)
    write_s: float | None


@dataclass(frozen=True)
class Emit:
    event: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Say:
    text: str
    error: bool = False  # to stderr


@dataclass(frozen=True)
class PublishStatus:
    status: JobStatus


@dataclass(frozen=True)
class Stop:
    """The job ends: `failed` fences every live process first; the shutdown key says how it ended."""

    how: Ending
    grace_s: float


Effect = (PublishPlan | Abort | WriteCommit | WriteTarget | MarkRunning | Spawn | Fence | Relabel | Emit | Say
          | PublishStatus | Stop | OrderPersist | Finalize)


# ---- the state -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CoordinatorState:
    config: JobConfig
    steady: Plan                        # the last plan that finished recovering
    plan: Plan                          # the newest published plan (== steady unless recovering)
    phase: Phase = Phase.STEADY
    deadline: float = float("inf")
    lost: frozenset[str] = frozenset()  # processes lost since the steady plan
    fenced: frozenset[str] = frozenset()
    finished: frozenset[str] = frozenset()
    committed: int | None = None
    abandoned: tuple[int, ...] = ()
    agreed: int | None = None           # the newest step whose replicas were checked equal
    warned: int = -1                    # the generation in which a divergence was last reported
    swap: Swap | None = None
    root_cause: str | None = None
    live: Mapping[str, Liveness] = field(default_factory=dict)
    alive: Mapping[str, Alive] = field(default_factory=dict)  # every planned process's beacon, as last seen
    announced: float = 0.0              # the hang timeout last written to the events
    announced_reason: str = ""
    joins: Mapping[int, str] = field(default_factory=dict)       # nodes that joined, not admitted yet
    joining: Mapping[int, Joining] = field(default_factory=dict)  # spare nodes whose spares are starting
    refill: Refill | None = None        # spares entering the pool in the generation being published
    awaiting_since: float | None = None  # when the coordinator began to wait for a spare node
    recoveries: tuple[Recovery, ...] = ()
    exit_code: int | None = None        # set once the job ended
    failure: str | None = None          # why it failed
    status: JobStatus | None = None     # the job status last published
    persisting: Persisting | None = None  # the checkpoint being written
    persisted: int | None = None        # the newest step complete on disk (a resumed job's: the one it resumed)
    commits_since_persist: int = 0
    persisted_t: float | None = None    # when the last checkpoint completed (or the first commit came)
    stopping_t: float | None = None     # SIGTERM arrived (or no spare is left): the job persists, then stops
    stop_failure: str | None = None     # stopping because the job cannot go on (no spare left): why
    last_try: bool = False              # stopping: the parts on disk are being assembled one last time
    after_training: str | None = None   # a rank failed after training ended: the job's failure once the rest end
