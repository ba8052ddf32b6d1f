"""Finds the newest intact checkpoint that fits the job, and reads one rank's snapshot back from it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from deadpool.disk.chunks import meta_key, private_key
from deadpool.disk.manifest import FORMAT, MANIFEST, METADATA, Identity, compatible, files_reason, listing, read_json
from deadpool.errors import CheckpointError
from deadpool.runtime.slots import checksum


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
    if manifest.get("format") != FORMAT:
        return None, f"{MANIFEST} has format {manifest.get('format')!r}, this DeadPool reads {FORMAT}"
    try:
        if METADATA not in manifest["files"]:
            return None, f"{MANIFEST} lists no {METADATA}"
        return manifest, files_reason(path, manifest["files"], hashes=True)
    except (KeyError, TypeError, AttributeError) as error:
        return None, f"{MANIFEST} is malformed ({type(error).__name__}: {error})"


def read_rank(path: str | os.PathLike, rank: int) -> tuple[bytes, torch.Tensor]:
    """Rank `rank`'s snapshot from checkpoint `path` (verify it first): its metadata bytes and a byte buffer
    with every tensor at its layout offset and zero padding, exactly the slot that was written (its CRC is
    checked against the slot's). Plain `dcp.load`s, straight into views of the one buffer."""
    path = Path(path)
    manifest = read_json(path / MANIFEST)
    if manifest is None or str(rank) not in manifest.get("ranks", {}):
        raise CheckpointError(f"{path} holds no snapshot of rank {rank}")
    entry = manifest["ranks"][str(rank)]
    meta_t = torch.empty(entry["meta_bytes"], dtype=torch.uint8)
    dcp.load({meta_key(rank): meta_t}, checkpoint_id=path, no_dist=True)
    meta = meta_t.numpy().tobytes()
    buffer = torch.zeros(entry["nbytes"], dtype=torch.uint8)
    views = {private_key(rank, i): buffer[offset: offset + n].view(getattr(torch, dtype)).reshape(shape)
             for i, (dtype, shape, offset, n) in enumerate(json.loads(meta)["tensors"]) if n}
    if views:
        dcp.load(views, checkpoint_id=path, no_dist=True)
    if checksum(meta, buffer) != entry["crc"]:
        raise CheckpointError(f"rank {rank}'s snapshot read from {path} does not match the checksum of the slot "
                              "it was written from")
    return meta, buffer
