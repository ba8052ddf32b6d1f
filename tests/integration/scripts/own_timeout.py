"""A tiny trainer whose own code raises TimeoutError("socket timed out") on rank 1 at step 3 (its data source
timing out, say): the words of a network failure, but an error of the script's. Usage: own_timeout.py --steps N
"""

import argparse

import torch

import deadpool

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
args = parser.parse_args()

session = deadpool.init()
model = session.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
session.register(optimizer=optimizer)


def train_step(step: int) -> float:
    if session.rank == 1 and step == 3:
        raise TimeoutError("socket timed out")
    loss = model(torch.ones(2, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


session.run(train_step, steps=args.steps)
