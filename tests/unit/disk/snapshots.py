"""Real snapshots for the disk tests: state flattened and copied into slots the way the snapshot engine does."""

from __future__ import annotations

import json

import numpy as np
import torch
from tests.unit.disk.plain_model import Tiny

from deadpool.runtime.slots import Slot, checksum, make_meta
from deadpool.runtime.state import ALIGN, Flat, Layout, flatten


class Box:
    def __init__(self, state) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


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


def slot_tensors(slot: Slot) -> list[torch.Tensor]:
    meta = json.loads(slot.meta)
    return [slot.data[o:o + n].view(getattr(torch, d)).reshape(s).clone() for d, s, o, n in meta["tensors"]]
