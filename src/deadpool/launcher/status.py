"""`deadpool status RUN_DIR [--json]`: where a job stands (generation, ranks, holders, commits, recoveries,
outcome), from the status record its coordinator rewrites whenever it changes; running or ended alike."""

from __future__ import annotations

import json
from pathlib import Path

from deadpool.config import JobConfig
from deadpool.errors import ConfigError, ControlPlaneError, ProtocolError
from deadpool.events import read_events
from deadpool.protocol.keys import Keys
from deadpool.protocol.kinds import Outcome
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.secret import read_secret
from deadpool.protocol.status import JobStatus
from deadpool.protocol.store import StoreClient
from deadpool.report import replica_memory


def read_status(run_dir: Path) -> tuple[JobStatus, str]:
    """The job's status record, and where it came from: live from its coordinator, through the authenticated
    control plane, while the job runs; else the copy the coordinator last wrote into the run directory."""
    live = _live_status(Path(run_dir))
    return (live, "live") if live is not None else (_file_status(Path(run_dir)), "run directory")


def _live_status(run_dir: Path) -> JobStatus | None:
    """None when no coordinator answers for this run directory (the job has ended, or it is not ours)."""
    try:
        config = JobConfig.read(run_dir / "config.json")
        client = StoreClient(config.store_host, config.store_port, read_secret(config.secret_file), timeout_s=1.0)
    except (OSError, ConfigError, ControlPlaneError):
        return None
    try:
        return ControlPlane(client).get(Keys(config.token).status(), JobStatus, timeout_s=1.0)
    except ControlPlaneError:
        return None
    finally:
        client.close()


def _file_status(run_dir: Path) -> JobStatus:
    path = run_dir / "status.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: not a DeadPool run directory, or its coordinator has not "
                          "started yet") from None
    try:
        return JobStatus.from_json(text)
    except ProtocolError as error:
        raise ConfigError(f"{path}: {error}") from None


def host_memory(run_dir: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Holder -> host bytes of the replicas it holds, of its own and mapped from its senders' slots on the
    same machine, from the holders' own replica_memory events."""
    path = Path(run_dir) / "events.jsonl"
    events = list(read_events(path)) if path.exists() else []
    return replica_memory(events), replica_memory(events, "mapped")


def render(status: JobStatus, memory: dict[str, int], mapped: dict[str, int] | None = None) -> str:
    """The status as a person reads it."""
    if status.outcome == Outcome.RUNNING:
        head = f"job: running, generation {status.generation} ({status.phase.replace('_', ' ')})"
    elif status.outcome == Outcome.FAILED:
        head = f"job: failed (exit code {status.exit_code}) in generation {status.generation}: {status.reason}"
    else:
        head = f"job: finished (exit code {status.exit_code}) in generation {status.generation}"
    lines = [head, f"last commit: {'none' if status.committed is None else f'step {status.committed}'}", "ranks:"]
    where = {m.proc: "" if m.node is None else f" on node {m.node}" for m in status.members}
    lines += [f"  rank {m.rank}: {m.proc}{where[m.proc]}" for m in status.members if m.rank is not None]
    holders = [m for m in status.members if m.rank is None or m.holds]
    lines.append("spares and holders:" if holders else "spares and holders: none")
    for m in holders:
        role = "idle spare" if m.rank is None else f"rank {m.rank}"
        holds = f"holds rank(s) {', '.join(map(str, m.holds))}" if m.holds else "holds nothing"
        nbytes = f", {memory[m.proc] / 2**20:.1f} MiB of host memory" if m.proc in memory else ""
        if mapped and mapped.get(m.proc):
            nbytes += f" (and {mapped[m.proc] / 2**20:.1f} MiB of its senders' slots, mapped)"
        lines.append(f"  {m.proc}{where[m.proc]} ({role}): {holds}{nbytes}")
    lines.append(f"recoveries: {len(status.recoveries)}")
    for r in status.recoveries:
        took = ", ".join(f"{proc} took rank {rank}" for rank, proc in r.replaced.items()) or "no rank replaced"
        restored = "began afresh" if r.restored_step is None else f"restored step {r.restored_step}"
        lines.append(f"  generation {r.generation}: {r.cause}; {restored}; {took}; "
                     f"{r.detect_to_resume_s:.2f} s from detection to resume")
    timeout = "not set yet" if status.hang_timeout_s is None else (
        f"{status.hang_timeout_s:.1f} s ({status.hang_timeout_reason})")
    lines.append(f"hang timeout: {timeout}")
    return "\n".join(lines)


def status_main(run_dir: Path, as_json: bool) -> int:
    (status, source), (memory, mapped) = read_status(run_dir), host_memory(run_dir)
    if as_json:
        print(json.dumps({**json.loads(status.to_json()), "replica_memory_bytes": memory,
                          "replica_mapped_bytes": mapped, "source": source}, indent=2))
    else:
        stale = status.outcome == Outcome.RUNNING and source != "live"
        tail = "; no coordinator answers for it: the job was stopped or killed, this is its last record)"
        print(render(status, memory, mapped) + f"\n(read from: {source}" + (tail if stale else ")"))
    return 0
