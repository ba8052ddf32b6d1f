"""A DeadPool script whose learning rate depends on a counter DeadPool does not know about: an attribute
of the script's own object, neither registered nor rebound in the step function. A spare that takes a
rank starts it at 0 while the survivors' counters are ahead, so the replicas' weights part ways at the
first step after a recovery, which the divergence check must catch. Usage: unregistered_counter.py --steps N
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "gpt"))
from data import BatchSampler, CharTokenizer, load_text, make_batch  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

import deadpool  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
args = parser.parse_args()


class Schedule:
    def __init__(self) -> None:
        self.calls = 0


torch.manual_seed(0)
session = deadpool.init()
text = load_text()
tokenizer = CharTokenizer(text)
tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
model = session.wrap(GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
sampler = BatchSampler(num_tokens=len(tokens), block_size=32, batch_size=4, rank=session.rank,
                       world_size=session.world_size, seed=0)
session.register(optimizer=optimizer, data=sampler)
schedule = Schedule()


def train_step(step: int) -> torch.Tensor:
    schedule.calls += 1
    for group in optimizer.param_groups:
        group["lr"] = 1e-3 / schedule.calls
    x, y = make_batch(tokens, sampler.next_batch(), 32)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


session.run(train_step, steps=args.steps)
