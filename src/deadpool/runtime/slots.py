"""Host-memory slots: one preallocated byte buffer holds one snapshot of one rank, with its checksum."""

from __future__ import annotations

import functools
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from deadpool.runtime.arena import Arena, shared_buffer
from deadpool.runtime.digest import Digest, Hasher, new_hasher
from deadpool.runtime.slices import held
from deadpool.runtime.state import Layout


def held_ranges(meta: bytes | dict, nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges of a slot of `nbytes` that its snapshot holds (slices.held): all of them, unless
    the snapshot holds one data-parallel piece of the replicated state."""
    if isinstance(meta, bytes):
        return list(_held_of(meta, nbytes))
    piece = meta.get("slice")
    return held(meta.get("lead", 0), nbytes, None if piece is None else (piece[0], piece[1]))


@functools.lru_cache(maxsize=16)
def _held_of(meta: bytes, nbytes: int) -> tuple[tuple[int, int], ...]:
    """held_ranges of a snapshot's metadata bytes, parsed once: a copy, its hash, each send and each receive
    of the same snapshot's layout ask again (tens of kB of JSON for a real model)."""
    return tuple(held_ranges(json.loads(meta), nbytes))


def checksum(meta: bytes, data: torch.Tensor, ranges: Sequence[tuple[int, int]] | None = None,
             hasher: Hasher | None = None) -> int:
    """The hash (digest.py; `hasher`: another one, as a checkpoint names it) of the bytes the snapshot holds
    (`ranges`, else held_ranges of its metadata), then the metadata: what a snapshot is sealed with, one
    pass over bytes already in a slot, on the process's hash threads where it has them."""
    digest = Digest(hasher=hasher or new_hasher(parallel=True))
    raw = data.numpy().data
    for start, end in held_ranges(meta, data.numel()) if ranges is None else ranges:
        digest.update(raw[start:end])
    return digest.finish(meta)[1]


def host_buffer(nbytes: int, pinned: bool, shared: bool = False) -> tuple[torch.Tensor, Arena | None]:
    """Exactly `nbytes` of host memory, one arena for a whole slot (tensors live in it as views), and where
    holders on this machine can map it when `shared` (arena.py; None: private memory).

    Pinned (page-locked, so device-to-host copies run asynchronously on the side stream) by registering
    the arena with CUDA in place, not through `pin_memory=True`: torch's caching host allocator rounds
    every request up to a power of two, up to twice the slot's size, and keeps freed blocks cached. A
    shared arena that CUDA refuses to register is given up for a private one (whose holders are then
    streamed the bytes); a private one it refuses is an error."""
    if shared and nbytes:
        buffer, arena = shared_buffer(nbytes)
        if not pinned or _pin(buffer) == 0:
            return buffer, arena
        del buffer, arena  # refused: the memory goes with its last reference
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and nbytes:
        error = _pin(buffer)
        if error:
            raise RuntimeError(f"could not pin a {nbytes}-byte snapshot slot in host memory (cudaError {error})")
    return buffer, None


PIN_TIMEOUT_S = 60.0  # registering GBs of host memory takes well under a second


def _pin(buffer: torch.Tensor) -> int:
    """Registers `buffer` with CUDA until it is freed; the cudaError code (0: pinned). Registered from a
    thread of its own: a refusal also sets CUDA's last error, which is per thread and which torch does not
    let Python clear, and on the engine's thread a later launch would raise it."""
    cudart, device = torch.cuda.cudart(), torch.cuda.current_device()
    codes: list[int] = []

    def register() -> None:
        torch.cuda.set_device(device)  # a new thread's current device is GPU 0: register on the rank's own
        codes.append(int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)))

    thread = threading.Thread(target=register, name="deadpool-pin", daemon=True)
    thread.start()
    thread.join(PIN_TIMEOUT_S)
    if not codes:
        raise RuntimeError(f"could not pin a {buffer.numel()}-byte snapshot slot: CUDA's registration "
                           + ("failed (see the thread's traceback)" if not thread.is_alive() else
                              f"did not return within {PIN_TIMEOUT_S:.0f} s"))
    if codes[0] == 0:
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return codes[0]


@dataclass(eq=False)  # slots are told apart by identity (a list of them is searched for the one being written)
class Slot:
    """A byte buffer and what it currently holds; `step` is None while it is empty or being written.

    `trusted`: the checksum was computed from these bytes by this process as it wrote them (its own
    snapshot), or checked when they arrived for a recovery; such a slot is not checked again. A replica
    that sits at a holder is checked before it is used (`intact`).

    `arena`: the buffer is this process's shared memory, which holders on this machine map (arena.py);
    `mapped`: the buffer is another process's arena, mapped here, and never written by this process."""

    pinned: bool = False
    buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    arena: Arena | None = None
    mapped: bool = False
    step: int | None = None
    meta: bytes = b""
    nbytes: int = 0
    digest: int = 0  # the checksum it was sealed with (digest.py), a signed int64
    trusted: bool = False
    ranges: list[tuple[int, int]] | None = field(default=None, repr=False)  # held(), once worked out

    def reserve(self, nbytes: int, pin: bool = False, share: bool = False) -> torch.Tensor:
        """Marks the slot empty and returns its first `nbytes` bytes. A new arena of exactly `nbytes` is
        made only when the buffer is too small, not pinned when `pin` asks for it, not shared when `share`
        asks for it (unless CUDA refused to pin it shared: host_buffer), or mapped from another process: a
        snapshot's size settles after the first optimizer step (which creates the optimizer's state), so
        each slot is pinned (or shared) once."""
        self.step, self.ranges = None, None
        unshared = share and not self.arena and not (pin and self.pinned)  # pinned, not shared: CUDA refused
        if self.mapped or self.buffer.numel() < nbytes or (pin and not self.pinned) or unshared:
            self.buffer, self.arena = torch.empty(0, dtype=torch.uint8), None  # the old arena goes first
            (self.buffer, self.arena), self.pinned, self.mapped = host_buffer(nbytes, pin, share), pin, False
        self.nbytes = nbytes
        return self.buffer[:nbytes]

    def adopt(self, mapped: torch.Tensor, nbytes: int) -> None:
        """A holder's slot becomes a view of its sender's arena (arena.map_arena), empty until sealed."""
        self.buffer, self.nbytes, self.arena, self.mapped, self.pinned = mapped, nbytes, None, True, False
        self.step, self.ranges = None, None

    @property
    def data(self) -> torch.Tensor:
        return self.buffer[: self.nbytes]

    def seal(self, step: int, meta: bytes, digest: int, trusted: bool = False,
             ranges: list[tuple[int, int]] | None = None) -> None:
        """`ranges`: held_ranges of `meta`, where the caller knows them (else worked out when asked)."""
        self.meta, self.digest, self.step, self.trusted, self.ranges = meta, digest, step, trusted, ranges

    def held(self) -> list[tuple[int, int]]:
        """The byte ranges this slot's snapshot holds (held_ranges), parsed from its metadata at most once."""
        if self.ranges is None:
            self.ranges = held_ranges(self.meta, self.nbytes)
        return self.ranges

    def intact(self) -> bool:
        """Recomputes the checksum: a slot whose bytes changed since it was sealed is never restored from."""
        return self.step is not None and checksum(self.meta, self.data) == self.digest

    def usable(self) -> bool:
        """Holds a step that may be restored: trusted, or checked now (and trusted from then on; a mapped
        slot, which its sender may rewrite while it lives, at every call). A recovery pays for checking
        only what crossed a network or sat at a holder, not a rank's own slots."""
        if self.mapped:
            return self.intact()
        if self.step is not None and not self.trusted:
            self.trusted = self.intact()
        return self.step is not None and self.trusted

    def tensors(self, device: torch.device) -> tuple[dict, list[torch.Tensor], list[bool]]:
        """The tensors in this slot, with the skeleton to rebuild the state from. Those that lived on the GPU
        go straight from the slot to `device` (asynchronous from a pinned arena; one copy); the rest are
        private copies in host memory, which nothing else owns."""
        meta = json.loads(self.meta)
        layout = Layout.from_json(meta["tensors"], self.nbytes)
        to_device = device.type == "cuda"
        out = []
        for (dtype, shape, offset, n), on_gpu in zip(layout.specs, meta["cuda"]):
            view = self.buffer[offset: offset + n].view(getattr(torch, dtype)).reshape(shape)
            out.append(view.to(device, non_blocking=True) if on_gpu and to_device else view.clone())
        if to_device:
            torch.cuda.current_stream(device).synchronize()
        return meta["skeleton"], out, meta["numpy"]


def make_meta(step: int, skeleton: object, layout: Layout, numpy_flags: list[bool], cuda_flags: list[bool],
              stable: list[bool], replicated: bool, piece: tuple[int, int] | None = None) -> bytes:
    """What a slot's bytes are: the skeleton and each tensor's place. `stable` marks parameters and optimizer
    state; `replicated`: those are identical on every data-parallel rank (the disk tier writes them once).
    `lead`: where the stable tensors end; `piece`: the bytes of them this slot holds (slices.py; None: all).

    The bytes are json.dumps of {"step", "skeleton", "tensors", "numpy", "cuda", "stable", "replicated",
    "nbytes", "lead"[, "slice"]}, in that order; all but the step and the skeleton are the same for every
    snapshot of one layout, so that part is encoded once (tens of kB for a real model)."""
    varying = json.dumps({"step": step, "skeleton": skeleton})
    fixed = _fixed_meta(layout, tuple(numpy_flags), tuple(cuda_flags), tuple(stable), replicated)
    sliced = "" if piece is None else ", " + json.dumps({"slice": list(piece)})[1:-1]
    return f"{varying[:-1]}, {fixed}{sliced}}}".encode()


@functools.lru_cache(maxsize=8)
def _fixed_meta(layout: Layout, numpy_flags: tuple[bool, ...], cuda_flags: tuple[bool, ...],
                stable: tuple[bool, ...], replicated: bool) -> str:
    """make_meta's fields after the skeleton, as JSON members without their braces."""
    return json.dumps({"tensors": layout.to_json(), "numpy": list(numpy_flags), "cuda": list(cuda_flags),
                       "stable": list(stable), "replicated": replicated, "nbytes": layout.nbytes,
                       "lead": layout.lead_nbytes})[1:-1]


def free_slot(slots: list[Slot], committed: int | None, abandoned: list[int]) -> Slot | None:
    """A slot a rank's next snapshot may overwrite, or None: an empty one, one older than the newest
    committed step, or one holding a step some rank skipped (it can never be committed). A durable
    step that may still be committed is kept, and so is the newest committed step."""
    free = [s for s in slots if s.step is None or (committed is not None and s.step < committed)
            or s.step in abandoned]
    return min(free, key=lambda s: -1 if s.step is None else s.step) if free else None


def pick_slot(slots: list[Slot], replaced: int | None, committed: Callable[[], int | None]) -> Slot:
    """The slot a holder receives a replica into, never the one holding the newest committed step: the one
    holding `replaced`, the step the sender's own slot held before (free_slot let the sender overwrite it
    only because it can never be the newest committed step again), else an empty one, else (a holder whose
    slots do not mirror its sender's: placed anew, or a resent snapshot) the one not holding the newest
    committed step, which `committed()` asks the store for. The sender only sends a snapshot once its own
    rule let it write it, so the other slot is no longer needed."""
    for slot in slots:
        if replaced is not None and slot.step == replaced:
            return slot
    for slot in slots:
        if slot.step is None:
            return slot
    newest = committed()
    return min((s for s in slots if s.step != newest), key=lambda s: s.step or 0)
