"""Finds the newest intact checkpoint that fits the job, and reads one rank's snapshot back from it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from deadpool.disk.chunks import meta_key, private_key, shard_rows, tensor_paths
from deadpool.disk.manifest import (
    FORMATS,
    MANIFEST,
    METADATA,
    Identity,
    bytes_hash,
    compatible,
    files_reason,
    listing,
    read_json,
)
from deadpool.errors import CheckpointError
from deadpool.runtime.digest import hasher_named
from deadpool.runtime.slots import checksum
from deadpool.runtime.state import Layout


def verify(path: str | os.PathLike) -> str | None:
    """Why checkpoint `path` cannot be used (no manifest, a file missing, truncated or corrupted), or None.
    Reads and hashes every file it lists."""
    return _checked(Path(path))[1]


def newest(root: str | os.PathLike, identity: Identity | None = None,
           on_skip: Callable[[Path, str], None] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """(path, manifest) of the newest checkpoint under `root` that is complete, intact and (given an
    identity) fits this job; every newer one is skipped with `on_skip(path, reason)`. None if none is."""
    for _, path in listing(root, "step"):
        manifest, reason = _checked(path)
        if manifest is not None and reason is None and identity is not None:
            unfit = compatible(manifest, identity)
            reason = None if unfit is None else f"does not fit this job: {unfit}"
        if manifest is not None and reason is None:
            return path, manifest
        if on_skip is not None:
            on_skip(path, reason or "unreadable")
    return None


def _checked(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not (path / MANIFEST).exists():
        return None, f"no {MANIFEST} (never finished, or damaged)"
    manifest = read_json(path / MANIFEST)
    if manifest is None:
        return None, f"{MANIFEST} is not readable JSON"
    if manifest.get("format") not in FORMATS:
        readable = ", ".join(map(str, FORMATS[:-1])) + f" and {FORMATS[-1]}"
        return None, f"{MANIFEST} has format {manifest.get('format')!r}, this DeadPool reads {readable}"
    try:
        if METADATA not in manifest["files"]:
            return None, f"{MANIFEST} lists no {METADATA}"
        return manifest, files_reason(path, manifest["files"], hashes=True)
    except (KeyError, TypeError, AttributeError) as error:
        return None, f"{MANIFEST} is malformed ({type(error).__name__}: {error})"


def read_rank(path: str | os.PathLike, rank: int) -> tuple[bytes, torch.Tensor]:
    """Rank `rank`'s snapshot from checkpoint `path` (verify it first): its metadata bytes and a byte buffer
    with every tensor at its layout offset and zero padding, exactly the slot that was written (its CRC is
    checked against the slot's). Plain `dcp.load`s, straight into views of the one buffer.

    A rank that wrote a slice gets its stable tensors whole, from every rank's piece (read by their global
    fqns), each piece checked against the hash its writer recorded, and the metadata of a whole snapshot
    (without "slice"): its slot holds every byte, so its checksum must cover every byte, and the restored rank
    takes its own slice again at its next snapshot, whatever this job's setting."""
    path = Path(path)
    manifest = read_json(path / MANIFEST)
    if manifest is None or str(rank) not in manifest.get("ranks", {}):
        raise CheckpointError(f"{path} holds no snapshot of rank {rank}")
    entry = manifest["ranks"][str(rank)]
    meta = _meta(path, entry, rank)
    parsed = json.loads(meta)
    where = tensor_paths(parsed["skeleton"]) if "slice" in parsed else {}
    buffer = torch.zeros(entry["nbytes"], dtype=torch.uint8)
    views = {".".join(where[i][0][0]) if where and parsed["stable"][i] else private_key(rank, i):
             buffer[offset: offset + n].view(getattr(torch, dtype)).reshape(shape)
             for i, (dtype, shape, offset, n) in enumerate(parsed["tensors"]) if n}
    if views:
        dcp.load(views, checkpoint_id=path, no_dist=True)
    try:  # checkpoints from before the blocked hash name none: plain xxh3_64
        hasher = hasher_named(entry.get("hash", "xxh3_64"))
    except ValueError as error:
        raise CheckpointError(f"rank {rank}'s snapshot in {path} cannot be checked: {error}") from None
    if checksum(meta, buffer, hasher=hasher) != entry["crc"]:
        raise CheckpointError(f"rank {rank}'s snapshot read from {path} does not match the checksum of the slot "
                              "it was written from")
    if not where:
        return meta, buffer
    raw = buffer.numpy().data
    for other, piece in sorted(manifest["ranks"].items(), key=lambda item: int(item[0])):
        start, end = piece["slice"]
        if bytes_hash(raw[start:end]) != piece["slice_hash"]:
            raise CheckpointError(f"rank {rank}'s snapshot read from {path}: bytes {start}-{end} of the replicated "
                                  f"state (rank {other}'s slice) do not match the hash they were written with")
    del parsed["slice"]
    return json.dumps(parsed).encode(), buffer


def read_resharded(path: str | os.PathLike, source: int, rank: int, world_size: int) -> tuple[bytes, torch.Tensor]:
    """Rank `rank` of a job of `world_size` workers, from a checkpoint of sharded (FSDP) state that another
    number of workers wrote (verify it first): its shard of every sharded tensor cut anew as FSDP cuts it for
    `world_size` (torch.chunk's rows), read from whichever saved shards overlap it (DCP's resharding), and
    everything else (unsharded tensors, own state: RNGs, data position) as rank `source` had it. Returns the
    metadata and bytes of the slot this rank would have held, laid out for its new shapes."""
    path = Path(path)
    manifest = read_json(path / MANIFEST)
    if manifest is None or str(source) not in manifest.get("ranks", {}):
        raise CheckpointError(f"{path} holds no snapshot of rank {source}")
    parsed = json.loads(_meta(path, manifest["ranks"][str(source)], source))
    where = tensor_paths(parsed["skeleton"])
    keys, shapes, regions = [], [], {}
    for i, (dtype, shape, _, _) in enumerate(parsed["tensors"]):
        sharded = where[i][0][1].get("D")
        if sharded is None or sharded["placements"] == ["R"]:
            keys.append(private_key(source, i))
            shapes.append(torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
            continue
        dim, full = sharded["placements"][0], list(sharded["shape"])
        first, full[dim] = shard_rows(full[dim], rank, world_size)
        keys.append(".".join(where[i][0][0]))
        regions[keys[-1]] = tuple(first if d == dim else 0 for d in range(len(full)))
        shapes.append(torch.empty(full, dtype=getattr(torch, dtype), device="meta"))
    layout = Layout.of(shapes, lead=parsed["stable"])
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = {keys[i]: buffer[offset: offset + n].view(getattr(torch, dtype)).reshape(shape)
             for i, (dtype, shape, offset, n) in enumerate(layout.specs) if n}
    dcp.load(views, checkpoint_id=path, planner=_RegionPlanner(regions), no_dist=True)
    parsed.update(tensors=layout.to_json(), nbytes=layout.nbytes, lead=layout.lead_nbytes)
    return json.dumps(parsed).encode(), buffer


class _RegionPlanner(DefaultLoadPlanner):
    """Reads each key into a plain tensor that is the region of its global tensor at `regions[key]` (offsets;
    none: the whole tensor), from every saved chunk that overlaps it."""

    def __init__(self, regions: dict[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions = regions

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for key, tensor in self.state_dict.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if not isinstance(saved, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint holds no tensor {key}")
            offsets = self.regions.get(key, (0,) * tensor.dim())
            region = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            items += create_read_items_for_chunk_list(key, saved, [region])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the region itself: DCP's offsets within it are relative to it


def _meta(path: Path, entry: dict[str, Any], rank: int) -> bytes:
    """Rank's snapshot metadata, as its slot held it."""
    meta = torch.empty(entry["meta_bytes"], dtype=torch.uint8)
    dcp.load({meta_key(rank): meta}, checkpoint_id=path, no_dist=True)
    return meta.numpy().tobytes()
