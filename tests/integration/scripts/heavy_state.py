"""A trainer whose state is large and whose step is tiny: a snapshot (copy, hash, send to the spare) takes far
longer than a step, so a snapshot every step keeps training waiting for a free slot.
Usage: heavy_state.py --steps N [--mb M]"""

import argparse

import torch

import deadpool

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--mb", type=int, default=64, help="MB of state beside the model, snapshotted every time")
args = parser.parse_args()


class Ballast:
    """State that a snapshot copies whole every time (a big embedding table, say), never read by the step."""

    def __init__(self, nbytes: int) -> None:
        self.table = torch.ones(nbytes // 4)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"table": self.table}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.table.copy_(state["table"])


session = deadpool.init()
model = session.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
session.register(optimizer=optimizer, ballast=Ballast(args.mb * 2**20))
inputs = torch.ones(8, 4)


def train_step(step: int) -> torch.Tensor:
    loss = model(inputs).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


session.run(train_step, steps=args.steps)
