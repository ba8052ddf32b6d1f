"""Writes one process's part of a checkpoint: some ranks' snapshots of one step, as a DCP save of their chunks.

    root/.tmp-{step:010d}/part-{writer}/  __0_0.distcp, .metadata   (dcp.save, files fsynced)
                                          part.json                 (last: the chunk table and file hashes)

Inside a part every tensor is saved under its rank's private key; part.json says which global tensor (fqn,
global shape, offsets, tied aliases) each one is a chunk of, and finalize (finish.py) builds the real fqns.
A part is usable exactly when its part.json is there and its files have the sizes it lists.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from deadpool.disk.chunks import RankChunks, chunk_rank, meta_key
from deadpool.disk.manifest import (
    FORMAT,
    FORMATS,
    PART_JSON,
    Identity,
    bytes_hash,
    file_entry,
    files_reason,
    fsync_dir,
    read_json,
    step_dir,
    tmp_dir,
    write_durably,
)
from deadpool.runtime.digest import hash_name
from deadpool.runtime.slots import Slot


def write_part(root: str | os.PathLike, step: int, writer: str, snapshots: Mapping[int, Slot],
               identity: Identity, thread_count: int = 1) -> Path | None:
    """Writes `snapshots` (rank -> a slot holding `step`) into this writer's part of checkpoint `step`;
    returns the part's directory, or None when checkpoint `step` is already complete. Idempotent: a part
    that is already there, for the same ranks and identity, is left alone. Every slot must be usable (its
    checksum holds) and its padding zero (pieces.py zeroes it), so that a rank read back from disk has
    exactly the slot's bytes and CRC."""
    if step_dir(root, step).exists():
        return None
    part = tmp_dir(root, step) / f"part-{writer}"
    existing = read_part(part, step, identity)
    if existing is not None and set(map(str, snapshots)) <= set(existing["ranks"]):
        return part
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    fsync_dir(part.parent)
    fsync_dir(part.parent.parent)
    table: dict[str, Any] = {}
    state: dict[str, torch.Tensor] = {}
    for rank, slot in sorted(snapshots.items()):
        _check(rank, slot, step)
        chunks = chunk_rank(slot.meta, slot.data, rank, identity.world_size)
        state.update({c.key: c.tensor for c in chunks.chunks})
        state[meta_key(rank)] = torch.frombuffer(bytearray(slot.meta), dtype=torch.uint8)
        table[str(rank)] = _rank_table(chunks, slot)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(part, thread_count=thread_count), no_dist=True)
    files = {name: file_entry(part / name) for name in sorted(os.listdir(part))}
    record = {"format": FORMAT, "step": step, "writer": writer, "identity": identity.to_json(),
              "ranks": table, "files": files}
    write_durably(part / PART_JSON, json.dumps(record).encode())
    return part


def read_part(part: Path, step: int, identity: Identity) -> dict[str, Any] | None:
    """A part's part.json if the part is complete (its files have the listed sizes) and of this step and
    identity; None otherwise (half written, damaged, or left by another job)."""
    record = read_json(part / PART_JSON)
    if (record is None or record.get("format") not in FORMATS or record.get("step") != step
            or record.get("identity") != identity.to_json()):
        return None
    return record if files_reason(part, record["files"], hashes=False) is None else None


def _check(rank: int, slot: Slot, step: int) -> None:
    if slot.step != step or not slot.usable():
        raise ValueError(f"rank {rank}'s slot holds step {slot.step} (usable: {slot.usable()}), not an intact "
                         f"snapshot of step {step}")
    specs = json.loads(slot.meta)["tensors"]
    raw = slot.data.numpy()
    starts = sorted([offset for _, _, offset, _ in specs] + [slot.nbytes])
    gaps = [(end, starts[bisect.bisect_left(starts, end)]) for end in (offset + n for _, _, offset, n in specs)]
    held = slot.held()  # a slice's bytes outside its piece are not its own: not looked at
    if any(np.any(raw[max(a, start): min(b, end)]) for a, b in gaps for start, end in held):
        raise ValueError(f"rank {rank}'s slot has non-zero padding between its tensors: the disk keeps tensors "
                         "only, so it could not give these bytes back")


def _rank_table(chunks: RankChunks, slot: Slot) -> dict[str, Any]:
    """part.json's entry for one rank: for each stored key its global tensor and place in it; for each
    shared tensor the fqn rank 0 stores it under (and its shape and dtype, checked against rank 0's). A slice
    adds its piece, the lead region's size and the piece's hash: what checks the piece in the other ranks'
    snapshots rebuilt from the checkpoint (read.py)."""
    meta = json.loads(slot.meta)
    specs = meta["tensors"]
    table = {"crc": slot.digest, "hash": hash_name(), "nbytes": slot.nbytes, "meta": meta_key(chunks.rank),
             "meta_bytes": len(slot.meta),
             "chunks": {c.key: {"fqn": c.fqn, "paths": [list(p) for p in c.paths], "shape": list(c.global_shape),
                                "offsets": list(c.offsets), "dtype": str(c.tensor.dtype).removeprefix("torch."),
                                **({"sliced": True} if c.sliced else {})}
                        for c in chunks.chunks},
             "shared": {str(i): {"fqn": fqn, "shape": specs[i][1], "dtype": specs[i][0]}
                        for i, fqn in chunks.shared.items()}}
    if "slice" in meta:
        start, end = meta["slice"]
        table.update({"slice": [start, end], "lead": meta["lead"],
                      "slice_hash": bytes_hash(slot.data.numpy().data[start:end])})
    return table
