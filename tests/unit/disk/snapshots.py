"""Real snapshots for the disk tests: state flattened and copied into slots the way the snapshot engine does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from tests.box import Box
from tests.unit.disk.plain_model import Tiny

from deadpool.runtime.slices import cuts
from deadpool.runtime.slots import Slot, checksum, held_ranges, make_meta
from deadpool.runtime.state import ALIGN, Flat, Layout, flatten


def seal(flat: Flat, step: int, replicated: bool) -> Slot:
    """Copies `flat` into a fresh slot with stable tensors first and zero padding (snapshot.py's _copy), and
    seals it with its checksum. The arena starts as garbage, as torch.empty may."""
    layout = Layout.of(flat.tensors, lead=flat.stable)
    slot = Slot()
    buffer = slot.reserve(layout.nbytes)
    buffer.fill_(0xAB)
    for tensor, (_, _, offset, n) in zip(flat.tensors, layout.specs):
        if n:
            buffer[offset:offset + n].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        if n % ALIGN:
            buffer[offset + n: offset - (-n // ALIGN) * ALIGN].zero_()
    meta = make_meta(step, flat.skeleton, layout, flat.numpy, flat.cuda, flat.stable, replicated)
    slot.seal(step, meta, checksum(meta, slot.data), trusted=True)
    return slot


def trained(seed: int = 0, steps: int = 1) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randint(0, 11, (6,))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def replicated_slots(step: int = 7, world: int = 2) -> list[Slot]:
    """Data-parallel ranks: identical model and optimizer (stable, replicated), each with its own RNG
    states, data position and a buffer of its own (private)."""
    slots = []
    for rank in range(world):
        model, optimizer = trained()
        model.bn.running_mean.add_(rank)  # buffers may differ between ranks; they are not stable
        torch.manual_seed(100 + rank)
        rng = Box({"torch": torch.get_rng_state(), "numpy": np.random.RandomState(rank).get_state(),
                   "position": 1000 * rank + step, "seen": torch.arange(rank + 3)})
        slots.append(seal(flatten({"model": model, "optimizer": optimizer, "rng": rng}), step, True))
    return slots


def sharded_slots(step: int = 3, world: int = 3) -> tuple[list[Slot], dict[str, torch.Tensor]]:
    """FSDP-like ranks (a hand-made skeleton with "D" nodes, Shard(0) on a mesh of the whole job, torch.chunk
    layout), and the global tensors they are shards of. `few` has 2 rows: rank 2 holds none of it."""
    torch.manual_seed(5)
    full = {"w": torch.randn(7, 4), "b": torch.randn(5), "few": torch.randn(2, 4), "r": torch.randn(3)}
    slots = []
    for rank in range(world):
        local = {k: (t if k == "r" else t.chunk(world)[rank] if rank < len(t.chunk(world))
                     else t[t.shape[0]:]).clone() for k, t in full.items()}
        flat = flatten({"model": Box(local), "rng": Box({"torch": torch.full((5,), rank, dtype=torch.uint8)})})
        for name, node in flat.skeleton["d"][0][1]["d"]:
            node["D"] = {"placements": ["R" if name == "r" else 0], "shape": list(full[name].shape), "stride": []}
            flat.stable[node["T"]] = True
        slots.append(seal(flat, step, False))
    return slots, full


def data_parallel_tree(rank: int, step: int) -> dict:
    """One data-parallel rank's state: the same model, Adam state and extra parameters (a 1-row, an empty and
    a 50-row one) on every rank; its own buffers, RNG states and data position."""
    model, optimizer = trained()
    model.bn.running_mean.add_(rank)
    torch.manual_seed(1)
    extra = Box({"row": torch.nn.Parameter(torch.randn(1, 40)), "none": torch.nn.Parameter(torch.empty(0, 3)),
                 "big": torch.nn.Parameter(torch.randn(50, 6))})
    torch.manual_seed(100 + rank)
    rng = Box({"torch": torch.get_rng_state(), "numpy": np.random.RandomState(rank).get_state(),
               "position": 1000 * rank + step, "seen": torch.arange(rank + 3)})
    return {"model": model, "optimizer": optimizer, "extra": extra, "rng": rng}


def slice_of(flat: Flat, step: int, rank: int, world: int) -> tuple[Slot, Slot]:
    """(rank's sliced slot, the whole slot it is a slice of). The sliced slot holds the whole slot's bytes
    in its piece of the replicated state (slices.cuts) and its private state; every other byte is garbage."""
    whole = seal(flat, step, True)
    layout = Layout.of(flat.tensors, lead=flat.stable)
    piece = cuts(layout, world)[rank:rank + 2]
    slot = Slot()
    buffer = slot.reserve(layout.nbytes)
    buffer.random_(0, 256, generator=torch.Generator().manual_seed(rank))
    meta = make_meta(step, flat.skeleton, layout, flat.numpy, flat.cuda, flat.stable, True, (piece[0], piece[1]))
    for start, end in held_ranges(meta, layout.nbytes):
        buffer[start:end] = whole.data[start:end]
    slot.seal(step, meta, checksum(meta, slot.data), trusted=True)
    return slot, whole


def sliced_slots(step: int = 7, world: int = 3) -> tuple[list[Slot], list[Slot], list[dict]]:
    """`world` data-parallel ranks' sliced slots, the whole slots they are slices of, and their state trees."""
    trees = [data_parallel_tree(rank, step) for rank in range(world)]
    pairs = [slice_of(flatten(tree), step, rank, world) for rank, tree in enumerate(trees)]
    return [p[0] for p in pairs], [p[1] for p in pairs], trees


def slot_tensors(slot: Slot) -> list[torch.Tensor]:
    meta = json.loads(slot.meta)
    return [slot.data[o:o + n].view(getattr(torch, d)).reshape(s).clone() for d, s, o, n in meta["tensors"]]


def plain_load(path: Path, out: Path) -> None:
    """Runs plain_load.py on checkpoint `path` in a process that cannot import deadpool (no PYTHONPATH): what
    torch's own tools make of it lands in `out` (model.pt)."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "plain_load.py"), str(path), str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
