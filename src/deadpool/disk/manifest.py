"""Names, identity and integrity of checkpoints on disk: the manifest, file hashes, durable small writes."""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from deadpool.disk.chunks import stable_shapes

FORMAT = 3  # of manifest.json and part.json, as written: each rank's checksum names its hash (digest.hash_name)
FORMATS = (1, 2, 3)  # read here: 1 whole snapshots and shards, 2 slices too, both checksummed with plain xxh3_64
MANIFEST = "manifest.json"
PART_JSON = "part.json"
METADATA = ".metadata"  # DCP's own name for its metadata file (torch's filesystem.py)
HASH = "xxh3_128"
_NAME = re.compile(r"^(step|\.tmp)-(\d{10})$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:010d}"


def tmp_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f".tmp-{step:010d}"


def listing(root: str | os.PathLike, kind: str) -> list[tuple[int, Path]]:
    """(step, path) of the `step-*` ("step") or `.tmp-*` (".tmp") directories under root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(2)), root / m.group(0)) for m in map(_NAME.match, os.listdir(root))
             if m is not None and m.group(1) == kind]
    return sorted(found, reverse=True)


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must match to be restored into a job: its config, its parallelism
    ("replicated": data parallel, "sharded": FSDP), its world size, and the global shape of every
    stable tensor (parameters and optimizer state) by fqn."""

    config_hash: str
    parallelism: str
    world_size: int
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As JSON (shapes as lists): parts are matched to a step by this, so every writer of one step passes an
        equal identity (Identity.of any rank's snapshot gives the same)."""
        return {"config_hash": self.config_hash, "parallelism": self.parallelism, "world_size": self.world_size,
                "shapes": {k: list(v) for k, v in self.shapes.items()}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Identity:
        return cls(raw["config_hash"], raw["parallelism"], raw["world_size"],
                   {k: list(v) for k, v in raw["shapes"].items()})

    @classmethod
    def of(cls, meta: bytes, world_size: int, config_hash: str) -> Identity:
        """The identity of a job from one rank's snapshot metadata (any rank: the shapes are global)."""
        parsed = json.loads(meta)
        return cls(config_hash, "replicated" if parsed["replicated"] else "sharded", world_size,
                   stable_shapes(parsed))


def compatible(manifest: dict[str, Any], identity: Identity) -> str | None:
    """None if the checkpoint fits this job, else one line naming what differs."""
    saved = Identity.from_json(manifest["identity"])
    diffs = []
    if manifest["world_size"] != identity.world_size:
        diffs.append(f"world size {manifest['world_size']} in the checkpoint, {identity.world_size} now")
    if saved.parallelism != identity.parallelism:
        diffs.append(f"parallelism {saved.parallelism} in the checkpoint, {identity.parallelism} now")
    if saved.config_hash != identity.config_hash:
        diffs.append(f"config hash {saved.config_hash} in the checkpoint, {identity.config_hash} now")
    missing = [k for k in identity.shapes if k not in saved.shapes]
    extra = [k for k in saved.shapes if k not in identity.shapes]
    if missing:
        diffs.append(f"{_few(missing)} missing from the checkpoint")
    if extra:
        diffs.append(f"{_few(extra)} in the checkpoint only")
    for name, shape in identity.shapes.items():
        if name in saved.shapes and list(saved.shapes[name]) != list(shape):
            diffs.append(f"{name} has shape {list(saved.shapes[name])} in the checkpoint, {list(shape)} now")
    return "; ".join(diffs) or None


def shapes_misfit(manifest: dict[str, Any], shapes: dict[str, list[int]]) -> str | None:
    """One line naming what of a live job's state (`shapes`: fqn -> global shape of its parameters, and of the
    optimizer state built so far) the checkpoint lacks or holds in another shape, or None. Names only in the
    checkpoint are not looked at: an optimizer builds its state at its first step."""
    saved = manifest["identity"]["shapes"]
    missing = [k for k in shapes if k not in saved]
    other = [f"{name} has shape {list(saved[name])} in the checkpoint, {list(shape)} now"
             for name, shape in shapes.items() if name in saved and list(saved[name]) != list(shape)]
    diffs = [f"{_few(missing)} missing from the checkpoint"] if missing else []
    if other:
        diffs.append(other[0] + (f" (and {len(other) - 1} more of other shapes)" if len(other) > 1 else ""))
    return "; ".join(diffs) or None


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def bytes_hash(data: memoryview) -> str:
    """xxh3-128 of bytes in memory: a slice's, checked when another rank's snapshot is rebuilt with it."""
    return xxhash.xxh3_128(data).hexdigest()


def file_hash(path: Path, block: int = 8 << 20) -> str:
    """xxh3-128 of a file's bytes (tens of GB/s: the disk, not the hash, sets the pace)."""
    h = xxhash.xxh3_128()
    buffer = bytearray(block)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, HASH: file_hash(path)}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Writes a whole file or nothing: a uniquely named temporary, fsynced, renamed, directory fsynced."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None if it is missing or unreadable (a torn or foreign file)."""
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def files_reason(base: Path, files: dict[str, dict[str, Any]], hashes: bool) -> str | None:
    """Why the listed files under `base` are not as listed (missing, wrong size, with `hashes` wrong
    xxh3-128), or None."""
    for name, entry in files.items():
        path = base / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} expected (truncated or rewritten)"
        if hashes and file_hash(path) != entry[HASH]:
            return f"{name} does not match its {HASH} hash (corrupted)"
    return None
