"""A tiny DeadPool script whose rank 1 SIGKILLs itself at step 5 (tests/integration/test_standalone.py)."""

import os
import signal

import torch

import deadpool

session = deadpool.init()
model = session.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
session.register(optimizer=optimizer)


def train_step(step: int) -> None:
    if step == 5 and session.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


session.run(train_step, steps=20)
