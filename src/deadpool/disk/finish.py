"""Finalizes a checkpoint once its parts cover every rank: one DCP metadata, the manifest last, rename, prune.

    finalize(step):  parts of .tmp-{step} cover ranks 0..W-1?  no -> None (not yet)
                     parts not used (a rank written by two writers: the first by name wins) are removed
                     .metadata      = union of the parts' DCP metadata, paths rewritten to part-{writer}/...
                     manifest.json  = every file's size and xxh3-128 (written last; files and dirs fsynced)
                     rename .tmp-{step} -> step-{step}, fsync root; prune older checkpoints
    A crash anywhere leaves either the tmp dir (finalize again redoes the metadata and manifest) or the
    finished checkpoint (finalize again only prunes). One process finalizes a given step at a time.

The disk is trusted as far as DCP's own metadata loading goes: `.metadata` is DCP's format, a pickle, and
torch's FileSystemReader unpickles it (the parts' when merging, the checkpoint's when reading); everything
DeadPool itself reads (manifest.json, part.json) is JSON, and every file is checked against its hash first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from deadpool.disk.chunks import private_key
from deadpool.disk.manifest import (
    FORMAT,
    FORMATS,
    MANIFEST,
    METADATA,
    PART_JSON,
    Identity,
    file_entry,
    files_reason,
    fsync_dir,
    listing,
    read_json,
    step_dir,
    tmp_dir,
    write_durably,
)
from deadpool.disk.write import read_part
from deadpool.errors import CheckpointError


def finalize(root: str | os.PathLike, step: int, world_size: int, identity: Identity | None,
             keep: int) -> Path | None:
    """Makes checkpoint `step` visible if its parts cover every rank, and keeps the newest `keep` complete
    checkpoints; returns its path, or None while parts are missing. `identity` None: the one the parts carry
    (the coordinator, and a resume that completes a dead job's checkpoint, hold no snapshot to derive it from)."""
    identity = identity or _parts_identity(tmp_dir(root, step), step)
    if identity is None:
        return step_dir(root, step) if step_dir(root, step).exists() else None
    if keep < 1 or world_size != identity.world_size:
        raise ValueError(f"finalize needs keep >= 1 (got {keep}) and the identity's world size "
                         f"({identity.world_size}, got {world_size})")
    root, final = Path(root), step_dir(root, step)
    if not final.exists():
        tmp = tmp_dir(root, step)
        chosen = _choose(tmp, step, world_size, identity)
        if chosen is None:
            return None
        owners, records = chosen
        for extra in {p.name for p in tmp.glob("part-*")} - set(records):
            shutil.rmtree(tmp / extra, ignore_errors=True)
        tables = {r: records[owners[r]]["ranks"][str(r)] for r in sorted(owners)}
        _check_slices(tables)
        write_durably(tmp / METADATA, pickle.dumps(merge(tmp, owners, records)))
        files = {f"{name}/{f}": entry for name, record in records.items() for f, entry in record["files"].items()}
        files.update({f"{name}/{PART_JSON}": file_entry(tmp / name / PART_JSON) for name in records})
        files[METADATA] = file_entry(tmp / METADATA)
        ranks = {str(r): {"part": owners[r], **{k: t[k] for k in RANK_KEYS if k in t}} for r, t in tables.items()}
        manifest = {"format": FORMAT, "step": step, "world_size": world_size,
                    "identity": identity.to_json(), "ranks": ranks, "files": files, "created": time.time()}
        write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        for name in records:
            fsync_dir(tmp / name)
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
        fsync_dir(root)
    prune(root, step, keep)
    return final


RANK_KEYS = ("crc", "hash", "nbytes", "meta_bytes", "slice", "lead", "slice_hash")  # what read_rank needs, per rank


def _check_slices(tables: dict[int, dict[str, Any]]) -> None:
    """Ranks that hold slices must all do, and their pieces must make the lead region exactly once, by their
    byte ranges (every row of every stable tensor written by one rank); CheckpointError if not."""
    pieces = sorted((tuple(t["slice"]), t["lead"], r) for r, t in tables.items() if "slice" in t)
    if not pieces:
        return
    whole = sorted(set(tables) - {r for _, _, r in pieces})
    if whole:
        raise CheckpointError(f"ranks {whole} wrote whole snapshots and the others slices of the replicated state: "
                              "one checkpoint holds one or the other")
    end, lead = 0, pieces[0][1]
    for (start, stop), their_lead, rank in pieces:
        if start != end or their_lead != lead:
            raise CheckpointError(f"rank {rank}'s slice {[start, stop]} of a {their_lead}-byte replicated state does "
                                  f"not follow the others' (bytes {end} of {lead} covered): a row is missing or twice")
        end = stop
    if end != lead:
        raise CheckpointError(f"the slices cover bytes 0-{end} of the {lead}-byte replicated state only")


def _parts_identity(tmp: Path, step: int) -> Identity | None:
    """The identity of the first part of `step` that has one (a part left by another job is then skipped)."""
    for part in sorted(tmp.glob("part-*")):
        record = read_json(part / PART_JSON)
        if record is not None and record.get("format") in FORMATS and record.get("step") == step:
            return Identity.from_json(record["identity"])
    return None


def _choose(tmp: Path, step: int, world_size: int,
            identity: Identity) -> tuple[dict[int, str], dict[str, dict[str, Any]]] | None:
    """(rank -> the part that supplies it, part -> its part.json) if the complete parts cover every rank."""
    owners: dict[int, str] = {}
    records: dict[str, dict[str, Any]] = {}
    for part in sorted(tmp.glob("part-*")):
        record = read_part(part, step, identity)
        new = [] if record is None else [int(r) for r in record["ranks"] if int(r) < world_size
                                         and int(r) not in owners]
        if record is not None and new:
            records[part.name] = record
            owners.update({r: part.name for r in new})
    if sorted(owners) != list(range(world_size)):
        return None
    return owners, records


def merge(tmp: Path, owners: dict[int, str], records: dict[str, dict[str, Any]]) -> Metadata:
    """One DCP Metadata over all parts: every stored tensor under its private key (but a slice's rows: they are
    not a tensor of the rank), each chunk of a global tensor also under its fqn (and tied aliases) at its
    offsets, and each shared tensor's private key pointing at rank 0's bytes. All entries of one stored tensor
    point at the same bytes."""
    parts = {name: FileSystemReader(tmp / name).read_metadata() for name in records}
    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, tuple[str, ...]] = {}

    def place(fqn: str, props: TensorProperties, size: torch.Size, offsets: tuple[int, ...],
              sizes: torch.Size, info: Any) -> None:
        entry = tensors.setdefault(fqn, TensorStorageMetadata(props, size, []))
        if entry.size != size or entry.properties.dtype != props.dtype:
            raise CheckpointError(f"{fqn}: chunks of {entry.properties.dtype} {list(entry.size)} and "
                                  f"{props.dtype} {list(size)} in one checkpoint")
        entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), sizes))
        storage[MetadataIndex(fqn, offsets)] = info

    for rank in sorted(owners):
        name = owners[rank]
        table = records[name]["ranks"][str(rank)]
        for key, chunk in [(table["meta"], None), *table["chunks"].items()]:
            stored = parts[name].state_dict_metadata[key]
            assert isinstance(stored, TensorStorageMetadata)
            zeros = (0,) * len(stored.size)
            raw = parts[name].storage_data[MetadataIndex(key, zeros)]
            info = dataclasses.replace(raw, relative_path=f"{name}/{raw.relative_path}")
            if chunk is None or not chunk.get("sliced"):  # a slice's rows are read by their global fqn only
                place(key, stored.properties, stored.size, zeros, stored.size, info)
            for path in [] if chunk is None or chunk["fqn"] == key else chunk["paths"]:
                fqn = ".".join(path)
                place(fqn, stored.properties, torch.Size(chunk["shape"]), tuple(chunk["offsets"]), stored.size, info)
                planner[fqn] = tuple(path)
    for rank in sorted(owners):
        for index, shared in records[owners[rank]]["ranks"][str(rank)]["shared"].items():
            _share(tensors, storage, rank, int(index), shared, place)
    for fqn, entry in tensors.items():
        if not _covers(entry):
            raise CheckpointError(f"the chunks of {fqn} do not cover its global shape {list(entry.size)} exactly")
    version = next(iter(parts.values())).version
    return Metadata(state_dict_metadata=dict(tensors), planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(save_id=uuid.uuid4().hex), version=version)


def _covers(entry: TensorStorageMetadata) -> bool:
    """Whether the chunks make the tensor exactly once: by their sizes, and for chunks of whole rows (slices,
    FSDP's Shard(0)) by their rows too, which must follow each other (no row twice, none missing)."""
    if sum(math.prod(c.sizes) for c in entry.chunks) != math.prod(entry.size):
        return False
    if len(entry.size) == 0 or any(c.offsets[1:] != (0,) * (len(entry.size) - 1) or c.sizes[1:] != entry.size[1:]
                                   for c in entry.chunks):
        return True
    rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in entry.chunks if c.sizes[0])
    return all(a == b for (_, b), (a, _) in zip([(0, 0), *rows], rows)) and (not rows or rows[-1][1] == entry.size[0])


def _share(tensors: dict[str, TensorStorageMetadata], storage: dict[MetadataIndex, Any], rank: int, index: int,
           shared: dict[str, Any], place: Any) -> None:
    """Rank `rank`'s tensor `index`, stored by rank 0 under its fqn: its private key points at those bytes."""
    entry = tensors.get(shared["fqn"])
    zeros = (0,) * len(shared["shape"])
    dtype = getattr(torch, shared["dtype"])
    if (entry is None or list(entry.size) != shared["shape"] or entry.properties.dtype != dtype
            or MetadataIndex(shared["fqn"], zeros) not in storage):
        raise CheckpointError(f"rank {rank}'s {shared['fqn']} ({shared['dtype']} {shared['shape']}) is not in rank 0's "
                              "snapshot as one whole tensor of that dtype and shape: its replicated state differs")
    place(private_key(rank, index), entry.properties, entry.size, zeros, entry.size,
          storage[MetadataIndex(shared["fqn"], zeros)])


def prune(root: Path, newest: int, keep: int) -> None:
    """Deletes checkpoints older than the newest `keep` complete ones, and temporary dirs up to `newest`.
    Complete here means the manifest and every file it lists are there (hashes are checked when reading)."""
    complete = [s for s, path in listing(root, "step") if _complete(path)]
    if complete:
        oldest_kept = complete[:keep][-1]
        for s, path in listing(root, "step"):
            if s < oldest_kept:
                shutil.rmtree(path, ignore_errors=True)
    for s, path in listing(root, ".tmp"):
        if s <= newest:
            shutil.rmtree(path, ignore_errors=True)


def _complete(path: Path) -> bool:
    manifest = read_json(path / MANIFEST)
    return manifest is not None and isinstance(manifest.get("files"), dict) \
        and files_reason(path, manifest["files"], hashes=False) is None
