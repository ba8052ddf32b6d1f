"""A rank's snapshot as chunks of global tensors plus private ones: which tensor goes under which DCP key (pure).

Rank 0 stores every tensor it has under its global fqn (the state-tree path joined with ".", as DCP flattens
nested dicts), so a plain model loads its parameters and buffers from a checkpoint with `dcp.load`. FSDP
shards (skeleton "D" nodes on a 1-D mesh over the whole job, torch.chunk layout) are chunks of their global
tensor at their offsets, from every rank. Under data parallelism (`replicated`) the other ranks' stable
tensors are bit-identical to rank 0's (checked at commit), so they are not stored again: they are *shared*,
read back from rank 0's copy. A data-parallel slot that holds only its piece of them ("slice", slices.py)
stores the rows in its piece, as chunks of the global tensors: the N ranks' pieces make every stable tensor
once, and each is read back whole by its fqn. Everything else of rank r is private, under
`_deadpool/rank{r}/t{i}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from deadpool.runtime.slices import spans
from deadpool.runtime.state import Layout


def private_key(rank: int, index: int) -> str:
    """The key of tensor `index` of `rank`: every tensor a checkpoint holds of a rank can be read whole by this
    key, but the stable tensors of a rank that wrote a slice (read whole by their global fqn)."""
    return f"_deadpool/rank{rank}/t{index}"


def meta_key(rank: int) -> str:
    return f"_deadpool/rank{rank}/meta"


Path = tuple[str, ...]


@dataclass(frozen=True)
class Chunk:
    """One stored tensor of a rank: the piece of global tensor `fqn` at `offsets` (a whole tensor: all 0), or
    the rank's own tensor when `fqn` is its private key. It can be read whole by `key` (the private key),
    but `sliced` rows (of a stable tensor the rank holds a piece of), which the key names in the rank's part
    only. `paths`: the state-tree paths of the global tensor, the first one `fqn`'s, the others tied aliases."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    key: str
    paths: tuple[Path, ...] = ()
    sliced: bool = False

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(".".join(p) for p in self.paths[1:])


@dataclass
class RankChunks:
    """What one rank's snapshot stores (`chunks`), and its tensors stored by rank 0 instead (`shared`:
    tensor index -> global fqn; none when the snapshot holds a slice)."""

    rank: int
    chunks: list[Chunk]
    shared: dict[int, str]


def chunk_rank(meta: bytes, data: torch.Tensor, rank: int, world_size: int) -> RankChunks:
    """The chunks of one rank's snapshot (`data`: the slot's bytes, laid out as `meta` says). Each chunk's
    tensor aliases `data` (no copy) and owns exactly its own bytes, so DCP writes it without cloning it."""
    parsed = json.loads(meta)
    where = tensor_paths(parsed["skeleton"])
    raw = data.numpy()
    rows = piece_rows(parsed, rank)
    out = RankChunks(rank, [], {})
    for i, (dtype, shape, offset, n) in enumerate(parsed["tensors"]):
        if i not in where:
            raise ValueError(f"tensor {i} of rank {rank}'s snapshot is not in its skeleton")
        paths = tuple(p for p, _ in where[i])
        fqn, key = ".".join(paths[0]), private_key(rank, i)
        dt = getattr(torch, dtype)
        tensor = torch.frombuffer(raw[offset: offset + n], dtype=dt) if n else torch.empty(0, dtype=dt)
        tensor = tensor.reshape(shape)
        shard = shard_of(where[i][0][1], tuple(shape), rank, world_size, fqn)
        if shard is not None and parsed["replicated"]:
            raise ValueError(f"{fqn} is sharded but the snapshot says its stable tensors are replicated (HSDP is "
                             "not supported)")
        if rows is not None and parsed["stable"][i]:
            if i in rows:
                out.chunks.append(_rows_of(fqn, raw[offset: offset + n], dt, tuple(shape), rows[i], key, paths))
        elif shard is not None and n:
            out.chunks.append(Chunk(fqn, shard[0], shard[1], tensor, key, paths))
        elif shard is None and rank == 0:
            out.chunks.append(Chunk(fqn, tuple(shape), (0,) * len(shape), tensor, key, paths))
        elif shard is None and parsed["replicated"] and parsed["stable"][i]:
            out.shared[i] = fqn
        else:  # this rank's own: not part of a global tensor (or an empty shard, which adds nothing to it)
            out.chunks.append(Chunk(key, tuple(shape), (0,) * len(shape), tensor, key))
    return out


def piece_rows(parsed: dict[str, Any], rank: int) -> dict[int, tuple[int, int]] | None:
    """Stable tensor index -> (first row, end row) of the rows a sliced snapshot stores: those of its piece
    (slices.spans), and on rank 0 the empty stable tensors too (in no piece, yet a model may have them). None
    for a snapshot that holds all its stable tensors."""
    piece = parsed.get("slice")
    if piece is None:
        return None
    if not parsed["replicated"]:
        raise ValueError(f"rank {rank}'s snapshot holds a slice but its stable tensors are not replicated")
    layout = Layout(Layout.from_json(parsed["tensors"], parsed["nbytes"]).specs, parsed["nbytes"], parsed["lead"])
    rows = {i: (first, end) for i, first, end in spans(layout, piece[0], piece[1])}
    if rank == 0:
        rows.update({i: (0, 0) for i, (_, _, _, n) in enumerate(layout.specs) if parsed["stable"][i] and not n})
    return rows


def _rows_of(fqn: str, raw: Any, dtype: torch.dtype, shape: tuple[int, ...], rows: tuple[int, int], key: str,
             paths: tuple[Path, ...]) -> Chunk:
    """Rows [first, end) of a stable tensor (`raw`: its bytes) as a chunk of it, owning exactly their bytes
    (a 0-dim tensor is one row; an empty one is whole)."""
    first, end = rows
    if not raw.size:
        return Chunk(fqn, shape, (0,) * len(shape), torch.empty(shape, dtype=dtype), key, paths, sliced=True)
    row_bytes = raw.size // (shape[0] if shape else 1)
    tensor = torch.frombuffer(raw[first * row_bytes: end * row_bytes], dtype=dtype)
    offsets = (first,) + (0,) * (len(shape) - 1) if shape else ()
    return Chunk(fqn, shape, offsets, tensor.reshape((end - first, *shape[1:]) if shape else ()), key, paths,
                 sliced=True)


def tensor_paths(skeleton: Any) -> dict[int, list[tuple[Path, dict]]]:
    """Tensor index -> every (path, node) that refers to it, in state-dict order (tied tensors: several).
    Dict keys become strings as DCP writes them (str(k)); list and tuple items their index."""
    found: dict[int, list[tuple[Path, dict]]] = {}

    def walk(node: Any, path: Path) -> None:
        if not isinstance(node, dict):
            return
        if "T" in node:
            found.setdefault(node["T"], []).append((path, node))
        elif "d" in node:
            for k, v in node["d"]:
                walk(v, path + (k if isinstance(k, str) else str(k) if isinstance(k, int) else json.dumps(k),))
        else:
            for j, v in enumerate(node["l"] if "l" in node else node["t"]):
                walk(v, path + (str(j),))

    walk(skeleton, ())
    return found


def shard_of(node: dict, shape: tuple[int, ...], rank: int, world_size: int,
             fqn: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(global shape, offsets) of an FSDP shard: Shard(dim) on a 1-D mesh of the whole job, laid out as
    torch.chunk does (each rank ceil(n/W) rows, the last ones fewer or none). None for anything else
    (a plain tensor, or a Replicate placement, which holds the whole tensor)."""
    sharded = node.get("D")
    if sharded is None:
        return None
    if len(sharded["placements"]) != 1:
        raise ValueError(f"{fqn} is sharded over a {len(sharded['placements'])}-D mesh; the disk tier writes "
                         "shards of a 1-D mesh over the whole job only")
    dim = sharded["placements"][0]
    if dim == "R":
        return None
    full = tuple(sharded["shape"])
    start, rows = shard_rows(full[dim], rank, world_size)
    expected = full[:dim] + (rows,) + full[dim + 1:]
    if shape != expected:
        raise ValueError(f"{fqn}: rank {rank}'s shard has shape {list(shape)}, {list(expected)} expected for "
                         f"Shard({dim}) of {list(full)} over {world_size} ranks")
    return full, tuple(start if d == dim else 0 for d in range(len(full)))


def shard_rows(length: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first row, number of rows) of rank's shard of `length` rows over world_size ranks, as torch.chunk cuts
    them (FSDP2's Shard layout): each ceil(length / world_size) rows, the last ones fewer or none."""
    size = -(-length // world_size)
    start = min(rank * size, length)
    return start, min(size, length - start)


def stable_shapes(meta: dict[str, Any]) -> dict[str, list[int]]:
    """Global fqn -> global shape of every stable tensor (parameters, optimizer state) of a parsed snapshot
    metadata; tied tensors under each of their names."""
    shapes: dict[str, list[int]] = {}
    for i, paths in tensor_paths(meta["skeleton"]).items():
        if meta["stable"][i]:
            sharded = paths[0][1].get("D")
            shape = sharded["shape"] if sharded is not None else meta["tensors"][i][1]
            for path, _ in paths:
                shapes[".".join(path)] = list(shape)
    return shapes
