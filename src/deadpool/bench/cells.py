"""What `deadpool bench overhead` runs (overhead.py): the model size presets, the variants, the lists its
command line names, and the host memory a cell needs (it warns before a cell that may not fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deadpool.errors import ConfigError


@dataclass(frozen=True)
class Size:
    """A model size preset: the example's shape arguments and the batch that keeps a step bearable on 2 cores."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    batch_size: int  # sequences of 64 characters per rank per step

    def script_args(self) -> tuple[str, ...]:
        return ("--n-layer", str(self.n_layer), "--n-embd", str(self.n_embd), "--n-head", str(self.n_head),
                "--batch-size", str(self.batch_size))


# Batches shrink as models grow, so that a step of the 50M preset (one sequence per rank) takes 1-2 s with
# 4 ranks on 2 cores; a smaller batch makes a step cheaper but not its snapshot or checkpoint, so the
# ratios of the bigger presets are the less flattering ones.
SIZES = {size.name: size for size in (
    Size("1M", n_layer=4, n_embd=144, n_head=4, batch_size=8),
    Size("3M", n_layer=4, n_embd=256, n_head=4, batch_size=8),  # the example's defaults
    Size("10M", n_layer=6, n_embd=384, n_head=6, batch_size=4),
    Size("50M", n_layer=6, n_embd=832, n_head=8, batch_size=1),
)}


@dataclass(frozen=True)
class Variant:
    """One way of running a cell; its ratio is to its system's run without snapshots or checkpoints."""

    name: str
    system: str  # "deadpool" or "torchrun-dcp"
    snapshot_every: int | str | None = None  # DeadPool's --snapshot-every
    save: str | None = None  # DCP: None (no checkpoint), "sync" or "async"
    slices: bool = True  # DeadPool's --slices

    @property
    def baseline(self) -> str:
        return "deadpool-off" if self.system == "deadpool" else "dcp-off"


VARIANTS = {v.name: v for v in (
    Variant("deadpool-off", "deadpool", snapshot_every=0),
    Variant("deadpool-every-1", "deadpool", snapshot_every=1),
    Variant("deadpool-every-1-whole", "deadpool", snapshot_every=1, slices=False),
    Variant("deadpool-every-5", "deadpool", snapshot_every=5),
    Variant("deadpool-auto", "deadpool", snapshot_every="auto"),
    Variant("dcp-off", "torchrun-dcp"),
    Variant("dcp-sync", "torchrun-dcp", save="sync"),
    Variant("dcp-async", "torchrun-dcp", save="async"),
)}


def _names(text: str, known: dict[str, Any], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(f"{flag} {text!r}: expected a comma-separated list of {', '.join(known)}")
    return list(dict.fromkeys(names))


def parse_sizes(text: str) -> list[Size]:
    return [SIZES[n] for n in _names(text, SIZES, "--sizes")]


def parse_variants(text: str) -> list[Variant]:
    """The named variants plus the baselines their ratios need."""
    chosen = [VARIANTS[n] for n in _names(text, VARIANTS, "--variants")]
    needed = {v.baseline for v in chosen} | {v.name for v in chosen}
    return [v for v in VARIANTS.values() if v.name in needed]


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise ConfigError(f"--ranks {text!r}: expected a comma-separated list of positive numbers, e.g. 2,4")
    return list(dict.fromkeys(ranks))


def parameter_counts(sizes: list[Size]) -> dict[str, int]:
    """The real parameter count of each preset: the example's model on its default text, built on the
    meta device (no memory)."""
    import torch

    from deadpool.examples.gpt import data, model
    vocab = data.CharTokenizer(data.load_text(None)).vocab_size
    counts = {}
    for size in sizes:
        with torch.device("meta"):
            gpt = model.GPT(model.GPTConfig(vocab_size=vocab, n_layer=size.n_layer, n_head=size.n_head,
                                            n_embd=size.n_embd))
        counts[size.name] = gpt.num_parameters()
    return counts


PROCESS_BYTES = 300 * 2**20  # a worker's or spare's own memory besides the training state (torch, the text)


def deadpool_memory(params: int, ranks: int, spares: int) -> int:
    """Host memory of a DeadPool run with snapshots, roughly (fp32, AdamW): per rank the live parameters,
    gradients and two moments (16 B per parameter) and two snapshot slots (2 x 12 B); the spares, on the
    same machine, map those slots (runtime/arena.py) instead of holding copies. 50M x 4 ranks + 1 spare:
    14.3 GB estimated and 14.5 GB measured (PSS) when the spare held copies (2.4 GB of them)."""
    snapshot = 12 * params
    return ranks * (16 * params + 2 * snapshot) + (ranks + spares) * PROCESS_BYTES


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")
