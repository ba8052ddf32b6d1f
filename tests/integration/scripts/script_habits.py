"""A DeadPool script with the habits of real ones, each checked as it runs.

- it reads its identity from torchrun's variables and from torch.distributed's default group, and asserts
  they agree with the session's, in every generation;
- it never seeds Python's or NumPy's RNGs, yet draws from both in every step (scaled into the loss, and logged);
- it all-reduces a metric and waits at a barrier on the default group in every step;
- it runs until session.stop() (no --steps: session.run(steps=None)), and rank 0 alone calls stop() at a step
  that depends on the data (all ranks must stop there too);
- after run() it uses the default group once more and destroys it, as scripts do after DDP.

Usage: script_habits.py [--steps N] [--stop-after S]
"""

import argparse
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "gpt"))
from data import BatchSampler, CharTokenizer, load_text, make_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

import deadpool  # noqa: E402

LAST = 100  # without --steps, a stop that never comes fails the run here instead of training on

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=None)
parser.add_argument("--stop-after", type=int, default=6)
args = parser.parse_args()

torch.manual_seed(0)
session = deadpool.init()


def check_identity() -> None:
    env = (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]),
           int(os.environ["LOCAL_WORLD_SIZE"]))
    assert env == (session.rank, session.rank, session.world_size, session.world_size), env
    assert (dist.get_rank(), dist.get_world_size()) == (session.rank, session.world_size)


check_identity()
text = load_text()
tokenizer = CharTokenizer(text)
tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
model = session.wrap(GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
sampler = BatchSampler(num_tokens=len(tokens), block_size=32, batch_size=4, rank=session.rank,
                       world_size=session.world_size, seed=0)
session.register(optimizer=optimizer, data=sampler)


def train_step(step: int) -> torch.Tensor:
    check_identity()
    if step > LAST:
        raise RuntimeError(f"session.stop() was never called by step {LAST}")
    x, y = make_batch(tokens, sampler.next_batch(), 32)
    drawn, drawn_np = random.random(), float(np.random.rand())  # unseeded generators: DeadPool seeds them
    session.log("drawn", step=step, python=drawn, numpy=drawn_np)
    noise = drawn * drawn_np
    _, loss = model(x, y)
    (loss * (1.0 + 1e-3 * noise)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metric = torch.tensor([float(x[:, 0].sum())])
    dist.all_reduce(metric)
    dist.barrier()
    session.log("metric", step=step, value=metric.item())
    if session.rank == 0 and step >= args.stop_after and int(metric.item()) % 3 == 0:
        session.stop()
    return loss


session.run(train_step, steps=args.steps)
dist.barrier()
dist.destroy_process_group()
print(f"rank {session.rank} destroyed the default group after step {session.step}", flush=True)
