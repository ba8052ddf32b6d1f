"""Training data for the GPT example: text, character tokenizer and resumable per-rank sampler."""

from pathlib import Path

import torch

# Shorter texts cannot fill enough batches to make training meaningful.
MIN_TEXT_CHARS = 10_000


def load_text(path: str | None = None) -> str:
    """Return the training text: the file at `path`, or by default the Python
    documentation topics that ship with CPython, so every machine has real
    English text without a download."""
    if path is None:
        from pydoc_data.topics import topics  # imported here: the module is large

        text = "\n\n".join(topics[key] for key in sorted(topics))  # sorted: same text everywhere
    else:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"text file not found: {path}")
        text = file.read_text(encoding="utf-8")
    if len(text) < MIN_TEXT_CHARS:
        raise ValueError(f"text has {len(text)} characters, need at least {MIN_TEXT_CHARS}")
    return text


class CharTokenizer:
    """Maps each distinct character of a text to an integer id and back."""

    def __init__(self, text: str) -> None:
        self.vocab: list[str] = sorted(set(text))  # sorted: ids do not depend on text order
        self.vocab_size: int = len(self.vocab)
        self._id_of: dict[str, int] = {ch: i for i, ch in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        unknown = set(text) - self._id_of.keys()
        if unknown:
            raise ValueError(f"characters not in vocabulary: {sorted(unknown)!r}")
        return [self._id_of[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


class BatchSampler:
    """The data position of one rank in data-parallel training, saved and restored
    through `state_dict` so a restarted job continues with exactly the next samples.

    The token stream is cut into non-overlapping samples: sample i starts at token
    i * block_size and covers block_size + 1 tokens (inputs plus shifted targets).
    Each epoch visits a seeded permutation of all sample ids. A global step takes the
    next batch_size * world_size ids of the permutation, and rank r takes the r-th
    contiguous run of batch_size ids, so ranks never see the same sample in a step.
    When fewer than batch_size * world_size ids remain in an epoch, they are
    dropped and the next epoch begins, so every step has full batches on all ranks.
    """

    def __init__(
        self,
        *,
        num_tokens: int,
        block_size: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        if block_size <= 0 or batch_size <= 0 or world_size <= 0:
            raise ValueError("block_size, batch_size and world_size must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        # Each sample needs one token beyond its window for the last target.
        self.num_samples = (num_tokens - 1) // block_size
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        if self.num_samples < batch_size * world_size:
            raise ValueError(
                f"{self.num_samples} samples cannot fill one global batch of "
                f"{batch_size} x {world_size}"
            )
        self.epoch = 0
        self.cursor = 0  # index into this epoch's permutation of the next unused id
        self._perm = torch.empty(0, dtype=torch.long)  # cached permutation of _perm_epoch
        self._perm_epoch = -1

    def _permutation(self) -> torch.Tensor:
        """The current epoch's order of sample ids, identical on every rank and every restart."""
        if self._perm_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm = torch.randperm(self.num_samples, generator=generator)
            self._perm_epoch = self.epoch
        return self._perm

    def next_batch(self) -> list[int]:
        """This rank's sample ids for the next global step; advances the position."""
        global_batch = self.batch_size * self.world_size
        if self.cursor + global_batch > self.num_samples:  # drop the remainder, start a new epoch
            self.epoch += 1
            self.cursor = 0
        start = self.cursor + self.rank * self.batch_size
        ids = self._permutation()[start : start + self.batch_size].tolist()
        self.cursor += global_batch
        return ids

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position from `state_dict`. Any cursor within the epoch is accepted,
        so a job may resume with a different world size from the same position."""
        if set(state) != {"epoch", "cursor"}:
            raise ValueError(f"expected keys 'epoch' and 'cursor', got {list(state)}")
        epoch, cursor = state["epoch"], state["cursor"]
        for name, value in (("epoch", epoch), ("cursor", cursor)):
            if type(value) is not int:  # rejects bool and tensors as well as floats
                raise ValueError(f"{name} must be an int, got {type(value).__name__}")
        if epoch < 0 or not 0 <= cursor <= self.num_samples:
            raise ValueError(
                f"invalid position epoch={epoch}, cursor={cursor} for {self.num_samples} samples"
            )
        self.epoch = epoch
        self.cursor = cursor


CPU = torch.device("cpu")


def make_batch(
    tokens: torch.Tensor, sample_ids: list[int], block_size: int, device: torch.device = CPU
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the given samples out of the 1-D token stream as inputs x and next-token targets y, on the
    model's device (on a GPU through pinned memory, so the copy does not stall the host)."""
    starts = [i * block_size for i in sample_ids]
    x = torch.stack([tokens[s : s + block_size] for s in starts]).long()  # (B, T)
    y = torch.stack([tokens[s + 1 : s + 1 + block_size] for s in starts]).long()  # (B, T), shifted by one
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
