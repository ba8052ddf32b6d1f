"""Checks that a replayed step is fed what it was fed the first time (the script's state was rolled back).

The divergence check compares the ranks' weights with each other; it cannot see state that makes every
rank replay a step on other inputs than before the failure (a data position kept in an attribute, an
iterator or a generator DeadPool does not snapshot), which gives equal weights on all ranks and a run
that is no longer the one without the failure. So every step's forward inputs of the wrapped model are
hashed as they go by (xxh64 over their bytes), and a survivor that replays a step compares them with the
first run's. A spare, which never ran those steps, has nothing to compare and checks nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from deadpool.errors import DeadPoolError

KEPT_INTERVALS = 4  # a restore goes back to the newest committed snapshot: normally an interval or two


class ReplayMismatch(DeadPoolError):
    """A replayed step was fed other inputs than the first time: script state was not rolled back."""


class InputFingerprints:
    """One digest of the wrapped model's forward inputs per step, for the steps a restore may replay."""

    def __init__(self) -> None:
        self.first: dict[int, int] = {}  # step -> digest of its first run
        self._hash = xxhash.xxh64()

    def saw(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A forward pre-hook's view of the inputs: their tensors' shapes, dtypes and bytes (a GPU tensor
        is copied to the host for it; the inputs are the batch, small next to the model)."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                host = value.detach().cpu().contiguous()
                self._hash.update(f"{tuple(host.shape)}{host.dtype}".encode())
                self._hash.update(host.reshape(-1).view(torch.uint8).numpy().data)

    def end_step(self, step: int, replaying: bool, rank: int, every: int) -> None:
        """Records the step's digest the first time it runs; compares a replay's with it (ReplayMismatch)."""
        digest, self._hash = self._hash.intdigest(), xxhash.xxh64()
        first = self.first.get(step)
        if not replaying or first is None:
            self.first[step] = digest
            oldest = step - KEPT_INTERVALS * max(every, 1)
            for old in [s for s in self.first if s < oldest]:
                del self.first[old]
        elif digest != first:
            raise ReplayMismatch(
                f"step {step} replayed on rank {rank} after a failure was fed other inputs than the first time "
                f"(input fingerprint {digest:016x}, first {first:016x}): state that decides what the model is "
                "fed was not rolled back with the snapshot. Likely causes: a counter or data position kept in an "
                "attribute of your own object, an iterator (a DataLoader's, a generator) or a random generator "
                "of your own. Register it with session.register (anything with state_dict/load_state_dict), or "
                "keep it in a variable the step function rebinds with global/nonlocal")

    def drop_partial(self) -> None:
        """A failed step's inputs are not a step's: start its digest afresh."""
        self._hash = xxhash.xxh64()
