"""What a snapshot's capture costs the training thread: `state.flatten` of the registered state (the example
GPT, AdamW, a sampler, the RNGs), the clones of its mutable tensors and the layout, as
`SnapshotEngine.capture` does at every snapshot, in CPU time of the calling thread. `--cold` writes 64 MB
between captures, as a training step does, so the walk finds its objects out of cache (in a job of 4 ranks
on 2 cores a capture of the example took ~1.3x its warm time).

Two sides in one run, interleaved in rounds: the capture as shipped (Python's cyclic collector paused
during the walk) and with the collector left running, which is what a walk of many tensors set off (a
collection every 700 new containers, each scanning the process's young objects and, now and then, all of
them). Prints the median per capture and the collections seen, per model size.

    python scripts/bench_capture.py --layers 4 24 --rounds 5 [--cold]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from typing import Any, Callable

import torch

from deadpool.examples.gpt.model import GPT, GPTConfig
from deadpool.runtime import state
from deadpool.runtime.implicit import RNGState
from deadpool.runtime.state import Layout, flatten


class _Position:
    """A sampler's state, as the example registers one: a counter and torch's RNG."""

    def state_dict(self) -> dict[str, Any]:
        return {"position": 3, "rng": torch.get_rng_state()}

    def load_state_dict(self, _: dict[str, Any]) -> None:
        pass


def _tree(layers: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=layers, n_head=4, n_embd=256, dropout=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (8, 64))
    model(x, x)[1].backward()
    optimizer.step()  # the optimizer's state exists from here on, as in every snapshot but the first
    return {"model": model, "optimizer": optimizer, "data": _Position(), "rng": RNGState(torch.device("cpu"))}


def _capture(tree: dict[str, Any]) -> Layout:
    flat = flatten(tree)
    flat.tensors = [t if stable else t.clone() for t, stable in zip(flat.tensors, flat.stable)]
    return Layout.of(flat.tensors, lead=flat.stable)


def _timed(tree: dict[str, Any], captures: int, evict: torch.Tensor | None) -> tuple[float, int]:
    """CPU ms per capture, and the collections that ran meanwhile; `evict` is written before each capture."""
    before = sum(s["collections"] for s in gc.get_stats())
    spent = 0.0
    for _ in range(captures):
        if evict is not None:
            evict.add_(1)
        start = time.thread_time()
        _capture(tree)
        spent += time.thread_time() - start
    return 1000 * spent / captures, sum(s["collections"] for s in gc.get_stats()) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 24])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--captures", type=int, default=100, help="per round and side")
    parser.add_argument("--cold", action="store_true", help="write 64 MB before every capture")
    args = parser.parse_args()
    evict = torch.zeros(16 * 2**20) if args.cold else None
    shipped: Callable[[], Any] = state._collector_paused
    for layers in args.layers:
        tree = _tree(layers)
        tensors = len(flatten(tree).tensors)
        for _ in range(10):
            _capture(tree)
        sides: dict[str, list[tuple[float, int]]] = {"as shipped": [], "collector running": []}
        for _ in range(args.rounds):
            for side, pause in (("as shipped", shipped), ("collector running", contextlib.nullcontext)):
                state._collector_paused = pause  # type: ignore[assignment]
                sides[side].append(_timed(tree, args.captures, evict))
        state._collector_paused = shipped  # type: ignore[assignment]
        ms = {side: statistics.median(t for t, _ in runs) for side, runs in sides.items()}
        for side, runs in sides.items():
            print(f"{layers:3d} layers, {tensors:5d} tensors, {side:18s}: {ms[side]:7.3f} ms a capture (median of "
                  f"{args.rounds} rounds), {sum(c for _, c in runs) / (args.rounds * args.captures):.2f} "
                  "collections a capture")
        print(f"{'':30s}collector running / as shipped: x{ms['collector running'] / ms['as shipped']:.2f}")


if __name__ == "__main__":
    main()
