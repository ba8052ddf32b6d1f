"""One frozen job configuration: validated once, written as JSON into the run directory, read by every process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from deadpool.errors import ConfigError

FAULT_KINDS = ("kill", "kill_node", "hang", "error", "corrupt_replica")
# Phases of no step (given as step 0): start-up, in deadpool.init() and before snapshot 0 is committed; and a
# holder's hand-over of a replica to the spare taking its rank over, in a recovery.
STEP_ZERO_PHASES = ("init", "setup", "handover", "handover_data")
FAULT_PHASES = ("step_start", "forward", "backward", "after_optimizer", "snapshot_copy", "replicate", "recovery",
                *STEP_ZERO_PHASES)
BACKLOG_POLICIES = ("wait", "skip")
DIVERGENCE_ACTIONS = ("stop", "warn")
# A rank's watch thread beats every 0.1 s. The longest gap the coordinator saw between two beats of a live rank,
# over 8,333 gaps in 20 jobs (17 with a recovery) on 2 cores at load 5-18, was 0.22 s once training ran, 1.5 s while
# every process set up at once (set-up is judged by the longer hang timeout: policy.hang_verdict). 1.5 s keeps a
# margin of 7x over the first. A SIGSTOP of the example (0.7 s steps, load 10-18) cost 2.4-3.2 s to the next step
# with 1.5 s, 3.3-3.8 s with 2 s.
SILENCE_TIMEOUT_S = 1.5


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault: `kind` hits `rank` in `phase` of `step`, once per job.

    `kill` SIGKILLs the process running that rank; `kill_node` SIGKILLs its whole node (its agent and every
    process it started, at once); `hang` stops it with SIGSTOP (it stays alive,
    silent, holding its sockets: only the hang detector can tell); `error` raises an exception in
    the training script (a bug, not a node failure); `corrupt_replica` flips a byte of the replica
    of that rank's snapshot `step` in its holder's memory (phase is ignored). Phase `recovery`
    fires while the rank recovers from another failure that struck during `step` (once the new
    plan names it, before it reports its snapshots). Four phases have no step (step 0): `init` fires in
    deadpool.init() before the rank joins its group, `setup` in session.run() just before snapshot 0 is taken,
    `handover` in the holder of `rank`'s replica the first time it streams it to the spare taking the rank
    over, once it announced the stream (the taker waits for it) and before it connects, and `handover_data`
    there once the two are connected, the first snapshot's header sent and its data not (the taker is
    receiving).
    """

    kind: str
    rank: int
    step: int
    phase: str = "backward"

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"fault kind {self.kind!r} is not one of {FAULT_KINDS}")
        if self.phase not in FAULT_PHASES:
            raise ConfigError(f"fault phase {self.phase!r} is not one of {FAULT_PHASES}")
        if self.phase in STEP_ZERO_PHASES and self.kind != "corrupt_replica":
            if self.rank < 0 or self.step != 0:
                raise ConfigError(f"a fault in phase {self.phase} (no step of its own) needs rank >= 0 and step 0, "
                                  f"got rank={self.rank} step={self.step}")
        elif self.rank < 0 or self.step < 1:
            raise ConfigError(f"fault needs rank >= 0 and step >= 1, got rank={self.rank} step={self.step}")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything a DeadPool job needs to know; process identity travels separately in the environment.

    snapshot_every: 0 turns snapshots off, K snapshots after every K-th step, "auto" measures the
    snapshot cost and picks the densest interval whose cost stays within `snapshot_budget` of a step.
    settle_s: failures that arrive within this window of the first are recovered as one set.
    on_divergence: what the coordinator does when data-parallel replicas stop being bit-identical.
    replicas: how many processes hold each rank's snapshots, never on the rank's own node: spares first,
    peer workers when spares run short (coordinator/policy.place_replicas).
    seed: seeds Python's, NumPy's and torch's global RNGs in every process (plus its rank), and PYTHONHASHSEED.
    nproc_per_node: 0 runs every process under the launcher itself, on this machine; R > 0 runs them on
    nodes of R processes, one agent per node (launcher/node.py): workers / R worker nodes and spares / R
    spare nodes. node_timeout_s: an agent silent this long has lost its node. netns: each node in a network
    namespace of its own on this machine (launcher/netns.py), so all traffic crosses real interfaces.
    gpus_per_node: GPUs the processes of this node share out (coordinator/policy.place_devices); None
    counts the visible ones at launch, 0 trains on the CPU.
    deterministic: makes a replayed step compute the same bits on a GPU (torch's deterministic kernels,
    cuBLAS's fixed workspace, cuDNN without autotuning); the CPU kernels are deterministic already.
    hang_timeout_s: a rank that beats but makes no progress this long while its peers wait is fenced; None
    adapts it to the job (coordinator/policy.py: hang_timeout). silence_timeout_s: a rank whose heartbeat
    stops this long (SIGSTOP, a frozen machine) is fenced, whatever the step time.
    token: the job's id, in every store key and replica header: not a secret (protocol/store.py keeps
    strangers out). secret_file: the file (mode 0600) with the job's secret, which every connection to
    the control plane must prove it holds (protocol/wire.py). interface: the network interface this
    machine's process groups listen on (gloo's GLOO_SOCKET_IFNAME), the one that holds the job's address.
    persist_dir: where committed snapshots are written to disk (the disk tier, deadpool/disk); "" = never.
    persist_every: a checkpoint every N commits; persist_interval_s: or every S seconds, whichever comes
    first (0 = not by time). keep: complete checkpoints kept (the older ones are deleted). stop_grace_s: how
    long a job stopped by SIGTERM may take to persist its newest commit before it exits. resume: the
    checkpoint directory this job starts from (`--resume`, resolved by the launcher); "" = step 0.
    spare_wait_s: when a rank fails and no spare is left, how long the coordinator waits for a spare node
    to join (`deadpool agent --spare`) and start its spares before it stops the job; 0 stops at once.
    The survivors wait for the next plan that much longer than the collective timeout.
    slices: under data parallelism each of the N ranks snapshots, hashes and replicates only its 1/N slice of
    the replicated state (parameters, optimizer state) plus its private state (runtime/slices.py); False
    takes whole snapshots on every rank (what benchmarks compare against).
    """

    script: str
    script_args: tuple[str, ...] = ()
    workers: int
    spares: int = 0
    run_dir: str
    store_host: str = "127.0.0.1"
    store_port: int = 0
    token: str = ""
    secret_file: str = ""
    interface: str = ""
    backend: str = "auto"
    snapshot_every: int | str = 1
    snapshot_budget: float = 0.01
    backlog_policy: str = "wait"
    on_divergence: str = "stop"
    replicas: int = 1
    seed: int = 0
    nproc_per_node: int = 0
    node_timeout_s: float = 5.0
    netns: bool = False
    gpus_per_node: int | None = None
    deterministic: bool = True
    poll_interval_s: float = 0.02
    settle_s: float = 0.05
    hang_timeout_s: float | None = None
    silence_timeout_s: float = SILENCE_TIMEOUT_S
    spare_wait_s: float = 0.0
    slices: bool = True
    persist_dir: str = ""
    persist_every: int = 10
    persist_interval_s: float = 0.0
    keep: int = 2
    stop_grace_s: float = 20.0
    resume: str = ""
    recovery_timeout_s: float = 30.0
    collective_timeout_s: float = 60.0
    connect_timeout_s: float = 60.0
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.spares < 0:
            raise ConfigError(f"--spares must be 0 or more, got {self.spares}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        every = self.snapshot_every
        if not (every == "auto" or (isinstance(every, int) and not isinstance(every, bool) and every >= 0)):
            raise ConfigError(f"--snapshot-every must be a step count >= 0 (0 = off) or 'auto', got {every!r}")
        if not 0.0 < self.snapshot_budget < 1.0:
            raise ConfigError(f"--snapshot-budget is a fraction of step time in (0, 1), got {self.snapshot_budget}")
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1 (holders of each rank's snapshots), got {self.replicas}")
        if self.backlog_policy not in BACKLOG_POLICIES:
            raise ConfigError(f"--backlog-policy must be one of {BACKLOG_POLICIES}, got {self.backlog_policy!r}")
        if self.on_divergence not in DIVERGENCE_ACTIONS:
            raise ConfigError(f"--on-divergence must be one of {DIVERGENCE_ACTIONS}, got {self.on_divergence!r}")
        if self.nproc_per_node < 0 or (self.nproc_per_node and (self.workers % self.nproc_per_node
                                                                 or self.spares % self.nproc_per_node)):
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must divide the workers ({self.workers}) and "
                              f"spares ({self.spares}) into whole nodes")
        if self.netns and not self.nproc_per_node:
            raise ConfigError("--netns puts nodes in network namespaces: give --nnodes (and --nproc-per-node)")
        if not self.node_timeout_s > 0:
            raise ConfigError(f"--node-timeout must be positive, got {self.node_timeout_s}")
        if any(f.kind == "kill_node" for f in self.faults) and not self.nproc_per_node:
            raise ConfigError("a kill_node fault needs nodes: run with --nnodes (one agent per node)")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ConfigError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"--seed must be in [0, 2**32), got {self.seed}")
        # Each deadline must leave room for the one it waits on.
        chain = [("poll-interval", self.poll_interval_s), ("recovery-timeout", self.recovery_timeout_s),
                 ("collective-timeout", self.collective_timeout_s)]
        for (a, va), (b, vb) in zip(chain, chain[1:]):
            if not 0 < va < vb:
                raise ConfigError(f"timeouts must satisfy 0 < {a} < {b}, got {a}={va}s {b}={vb}s")
        if not 0 <= self.settle_s < self.recovery_timeout_s:
            raise ConfigError(f"--settle-window must be in [0, recovery-timeout), got {self.settle_s}s")
        hang = self.hang_timeout_s
        if hang is not None and not self.poll_interval_s < hang < self.collective_timeout_s:
            raise ConfigError(f"--hang-timeout must lie between the poll interval ({self.poll_interval_s}s) and "
                              f"the collective timeout ({self.collective_timeout_s}s), got {hang}s: a survivor "
                              "must not give up on a collective before a hung peer is fenced")
        if not self.poll_interval_s < self.silence_timeout_s < self.collective_timeout_s:  # also rejects NaN
            raise ConfigError(f"--silence-timeout must lie between the poll interval ({self.poll_interval_s}s) and "
                              f"the collective timeout ({self.collective_timeout_s}s), got {self.silence_timeout_s}s")
        if not 0 <= self.spare_wait_s < float("inf"):  # also rejects NaN
            raise ConfigError(f"--spare-wait must be a number of seconds >= 0, got {self.spare_wait_s}")
        if self.spare_wait_s and not self.nproc_per_node:
            raise ConfigError("--spare-wait waits for a spare node to join (`deadpool agent --spare`): give --nnodes")
        if not self.connect_timeout_s > 0:  # also rejects NaN
            raise ConfigError(f"connect timeout must be positive, got {self.connect_timeout_s}")
        if self.persist_every < 0 or not 0 <= self.persist_interval_s < float("inf"):
            raise ConfigError(f"--persist-every must be >= 0 commits and --persist-interval >= 0 s, got "
                              f"{self.persist_every} and {self.persist_interval_s}")
        if self.persist_dir and not (self.persist_every or self.persist_interval_s):
            raise ConfigError("--persist-dir needs --persist-every N (commits) or --persist-interval S (seconds)")
        if self.persist_dir and self.snapshot_every == 0:
            raise ConfigError("--persist-dir writes committed snapshots to disk: snapshots must be on "
                              "(--snapshot-every K or auto, not 0)")
        if self.keep < 2:
            raise ConfigError(f"--keep must be at least 2 (one to fall back to if the newest is damaged), "
                              f"got {self.keep}")
        if not 0 < self.stop_grace_s < float("inf"):
            raise ConfigError(f"--stop-grace must be a positive number of seconds, got {self.stop_grace_s}")
        for fault in self.faults:
            if fault.rank >= self.workers:
                raise ConfigError(f"fault targets rank {fault.rank} but the job has ranks 0..{self.workers - 1}")

    @property
    def world_size(self) -> int:
        return self.workers

    @property
    def nodes(self) -> int:
        """Worker and spare nodes, when the job runs on node agents (0 otherwise)."""
        return (self.workers + self.spares) // self.nproc_per_node if self.nproc_per_node else 0

    @property
    def plan_wait_s(self) -> float:
        """How long a process whose generation failed waits for the next plan: a collective's worth, and
        --spare-wait more, while the coordinator may be waiting for a spare node to join."""
        return self.collective_timeout_s + self.spare_wait_s

    def config_hash(self) -> str:
        """What a checkpoint of this job records of its config, and a job that resumes from it must share
        (deadpool/disk.Identity): the seed and the script, not its arguments (more steps, another log interval)."""
        shared = json.dumps({"seed": self.seed, "script": Path(self.script).name})
        return hashlib.sha256(shared.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "JobConfig":
        raw = json.loads(text)
        raw["script_args"] = tuple(raw["script_args"])
        raw["faults"] = tuple(Fault(**f) for f in raw["faults"])
        return cls(**raw)

    def write(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def read(cls, path: Path) -> "JobConfig":
        return cls.from_json(Path(path).read_text())
