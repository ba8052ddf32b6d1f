"""A process's part of the disk tier: writes the committed snapshots the coordinator orders it to write, from
host memory, in a thread of its own; writes its own rank's last commit as training ends; restores a rank from
a checkpoint when the job resumes (`deadpool run --resume`).

    coordinator: persist/order = {step, writers}  -->  this thread: copy the slot out, check it, write the part
    this thread: persist/{step}/{proc} = report   -->  coordinator: assemble the checkpoint (deadpool/disk)

A snapshot is copied out of its slot before it is written (a newer snapshot may overwrite the slot meanwhile)
and the copy is checked against the slot's checksum, so what reaches the disk is exactly what was committed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from deadpool.config import JobConfig
from deadpool.errors import CheckpointError, ProtocolError
from deadpool.protocol.records import PersistOrder, PersistReport
from deadpool.runtime.context import Context
from deadpool.runtime.slots import Slot, checksum, held_ranges
from deadpool.runtime.state import Stateful, flatten

POLL_S = 0.1  # how often a process looks for a new order: checkpoints are minutes apart, a write takes seconds


def copy_out(rank: int, slots: list[Slot], step: int) -> Slot:
    """A private copy of rank's snapshot `step`, exactly as committed: of the bytes it holds only (a slice's
    piece and private state, slots.held_ranges), in a buffer of the slot's size whose other bytes are never
    touched, so their pages are never allocated (a slot that size is mapped lazily by the allocator)."""
    slot = next((s for s in slots if s.step == step), None)
    if slot is None:
        raise ProtocolError(f"snapshot {step} of rank {rank} is no longer held here (a newer one replaced it)")
    meta, digest, nbytes = slot.meta, slot.digest, slot.nbytes
    data = torch.empty(nbytes, dtype=torch.uint8)
    for start, end in held_ranges(meta, nbytes):
        data[start:end].copy_(slot.buffer[start:end])
    if slot.step != step or checksum(meta, data) != digest:
        raise ProtocolError(f"snapshot {step} of rank {rank} changed while it was copied (a newer one replaced it)")
    return Slot(buffer=data, step=step, meta=meta, nbytes=nbytes, digest=digest, trusted=True)


def held_nbytes(slot: Slot) -> int:
    """The bytes of a snapshot that reach the disk: those it holds (a slice: its piece and private state)."""
    return sum(end - start for start, end in slot.held())


class Persister:
    """Carries out the coordinator's persist orders addressed to this process. `sources(rank)` gives the slots
    holding a rank's snapshots here (its own, or a replica it holds); it changes when a spare takes a rank."""

    def __init__(self, ctx: Context, sources: Callable[[int], list[Slot]]) -> None:
        self.ctx = ctx
        self.sources = sources
        self.stop = threading.Event()
        self.writing = threading.Lock()  # an order and the end of training may name the same part at once
        self.thread: threading.Thread | None = None
        if ctx.config.persist_dir:
            import deadpool.disk  # noqa: F401  # now: a SIGTERM's last words may run while the interpreter exits
            self.thread = threading.Thread(target=self._run, name="deadpool-persist", daemon=True)
            self.thread.start()

    def write(self, step: int, ranks: list[int]) -> PersistReport:
        """Writes these ranks' snapshot `step` as this process's part of checkpoint `step` (once: an order and
        the end of training may ask for the same part at the same time)."""
        from deadpool.disk import Identity, write_part  # torch.distributed.checkpoint: only with a disk tier

        ctx, config, start = self.ctx, self.ctx.config, time.monotonic()
        try:
            with self.writing:
                snapshots = {rank: copy_out(rank, self.sources(rank), step) for rank in ranks}
                nbytes = sum(held_nbytes(slot) for slot in snapshots.values())
                identity = Identity.of(snapshots[ranks[0]].meta, config.workers, config.config_hash())
                write_part(Path(config.persist_dir), step, ctx.proc, snapshots, identity)
        except Exception as error:  # reported: the coordinator drops this checkpoint, the job goes on
            report = PersistReport(step, ctx.proc, tuple(ranks), ok=False, error=f"{type(error).__name__}: {error}")
            ctx.events.emit("persist_part_failed", step=step, ranks=ranks, error=report.error)
            return report
        seconds = time.monotonic() - start
        ctx.events.emit("persist_part", step=step, ranks=ranks, nbytes=nbytes, seconds=seconds)
        return PersistReport(step, ctx.proc, tuple(ranks), ok=True, nbytes=nbytes, seconds=seconds)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5.0)

    def _run(self) -> None:
        ctx, key = self.ctx, self.ctx.keys.persist_order()
        done: PersistOrder | None = None
        try:
            plane = ctx.own_plane()  # the training thread's client must never wait behind a write
            while not self.stop.wait(POLL_S):
                order = plane.poll(key, PersistOrder)
                if order is None or order == done:
                    continue
                done = order
                ranks = order.ranks_of(ctx.proc)
                if ranks:
                    plane.put(ctx.keys.persisted(ctx.proc), self.write(order.step, ranks))
        except Exception as error:  # the job is over (the store closed) or the order was malformed
            if not self.stop.is_set():
                ctx.events.emit("persister_stopped", error=f"{type(error).__name__}: {error}")


def source_rank(manifest: dict, rank: int, world_size: int) -> int:
    """Whose own state (RNGs, data position) in a checkpoint `rank` of a job of `world_size` loads: its own, or,
    when another number of workers wrote it (`--resume` only), that of rank mod their number. The parameters
    and optimizer state are every rank's (data parallel) or cut anew into this job's shards (FSDP)."""
    return rank % int(manifest["world_size"])


def load_from_disk(path: Path, rank: int, slot: Slot, world_size: int) -> int:
    """Loads rank's snapshot from checkpoint `path` into `slot` (trusted: the checkpoint's files were checked
    against its manifest); returns its step."""
    from deadpool.disk import read_rank, read_resharded
    from deadpool.disk.manifest import MANIFEST, read_json

    manifest = read_json(path / MANIFEST)
    if manifest is None:
        raise CheckpointError(f"{path} has no readable {MANIFEST}")
    source = source_rank(manifest, rank, world_size)
    if manifest["world_size"] != world_size and manifest["identity"]["parallelism"] == "sharded":
        meta, data = read_resharded(path, source, rank, world_size)
    else:
        meta, data = read_rank(path, source)
    buffer = slot.reserve(data.numel())
    buffer.copy_(data)
    step = int(json.loads(meta)["step"])
    slot.seal(step, meta, checksum(meta, buffer), trusted=True)
    return step


def on_disk(config: JobConfig, step: int) -> bool:
    """Whether checkpoint `step` is complete in the persist dir already (nothing to write)."""
    from deadpool.disk import step_dir

    return step_dir(config.persist_dir, step).exists()


def checkpoint_of(config: JobConfig, step: int) -> Path:
    """Where checkpoint `step` is: in the persist dir, or the one this job resumed from."""
    from deadpool.disk import step_dir

    path = step_dir(config.persist_dir, step) if config.persist_dir else None
    if path is not None and path.exists():
        return path
    if config.resume:
        return Path(config.resume)
    raise ProtocolError(f"checkpoint {step} is not on disk (--persist-dir {config.persist_dir or 'not given'})")


def check_fits(path: Path, tree: dict[str, Stateful]) -> None:
    """Before a rank resumes: CheckpointError (the job is refused, exit 2) if the checkpoint's shapes are not the
    live state's (another model), in one line naming the first that differs."""
    from deadpool.disk.chunks import stable_shapes
    from deadpool.disk.manifest import MANIFEST, read_json, shapes_misfit

    flat = flatten(tree)  # views of the live tensors: nothing is copied
    live = stable_shapes({"skeleton": flat.skeleton, "stable": flat.stable,
                          "tensors": [(None, list(t.shape)) for t in flat.tensors]})
    misfit = shapes_misfit(read_json(path / MANIFEST) or {"identity": {"shapes": {}}}, live)
    if misfit is not None:
        raise CheckpointError(f"cannot resume from {path}: it holds the state of another job ({misfit})")


def describe_misfit(path: str, error: Exception) -> CheckpointError:
    """A checkpoint whose state does not load into this job's (names check_fits cannot see: those only the
    checkpoint has). The job is refused (exit 2), as for another --seed."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return CheckpointError(f"cannot resume from {path}: it holds the state of another job ({first})")
