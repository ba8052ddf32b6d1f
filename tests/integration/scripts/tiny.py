"""The smallest DeadPool trainer, with the habits and mistakes of first ports, one flag each.

It never seeds torch and draws its data in its set-up (`torch.randn`), as tutorials do: a spare must draw
the same data as the rank it replaced. It logs a `replaying` event for every step it runs while
`session.replaying` is true. Usage: tiny.py --steps N [--mistake M] [--steps-of-rank1 N] [--log-loss]
[--spare-set-up-fails] [--counter-in-attribute] [--seed-before-init N] [--seed-after-init N]
[--rank1-dies-after-run]
"""

import argparse
import os
import signal
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import deadpool

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--mistake", choices=("outside_run", "register_ddp", "wrap_ddp", "nothing_trainable",
                                          "run_twice", "no_optimizer", "global_object"))
parser.add_argument("--steps-of-rank1", type=int, help="rank 1 runs this many steps instead")
parser.add_argument("--spare-set-up-fails", action="store_true", help="a called spare's set-up raises EOFError")
parser.add_argument("--log-loss", action="store_true",
                    help="return nothing; session.log the loss instead, on odd steps only (even steps: no loss)")
parser.add_argument("--seed-before-init", type=int, help="torch.manual_seed(N) before deadpool.init()")
parser.add_argument("--seed-after-init", type=int, help="torch.manual_seed(N) after deadpool.init()")
parser.add_argument("--rank1-dies-after-run", action="store_true",
                    help="rank 1 is SIGKILLed 1 s after session.run() returns; rank 0 logs `after_run` 2 s after it")
parser.add_argument("--counter-in-attribute", action="store_true",
                    help="the batch index lives in an attribute: not rolled back after a failure")
args = parser.parse_args()

if args.seed_before_init is not None:
    torch.manual_seed(args.seed_before_init)
session = deadpool.init()
if args.seed_after_init is not None:
    torch.manual_seed(args.seed_after_init)
if args.spare_set_up_fails and os.environ["DEADPOOL_ROLE"] == "spare":
    raise EOFError("Ran out of input")  # torch.load of the script's own checkpoint, cut short by the failure
inputs, targets = torch.randn(64, 4), torch.randn(64, 1)  # this rank's data, from torch's default generator
module = torch.nn.Linear(4, 1)
if args.mistake == "register_ddp":
    session.register(model=DistributedDataParallel(module))
if args.mistake == "nothing_trainable":  # the model never given to session.wrap
    model = module
else:
    model = session.wrap(DistributedDataParallel(module) if args.mistake == "wrap_ddp" else module)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.mistake != "no_optimizer":
    session.register(optimizer=optimizer)
if args.mistake == "outside_run":
    model(inputs)  # the kept `while True:` loop of a port, before session.run


class Position:
    def __init__(self) -> None:
        self.batch = 0


position = Position()


def train_step(step: int) -> torch.Tensor | None:
    if session.replaying:
        session.log("replaying", step=step)
    if args.counter_in_attribute:
        position.batch += 1
    i = (position.batch if args.counter_in_attribute else step) * 8 % 64
    loss = (model(inputs[i:i + 8]) - targets[i:i + 8]).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if args.log_loss:
        if step % 2 == 1:
            session.log("train", step=step, loss=loss.item())
        return None
    return loss


def train_step_rebinding_an_object(step: int) -> torch.Tensor | None:
    global position
    position = Position()  # a global of a type DeadPool cannot snapshot, rebound every step
    return train_step(step)


steps = args.steps_of_rank1 if args.steps_of_rank1 and session.rank == 1 else args.steps
session.run(train_step_rebinding_an_object if args.mistake == "global_object" else train_step, steps=steps)
if args.mistake == "run_twice":
    session.run(train_step, steps=steps + 2)
if args.rank1_dies_after_run:  # the script's own code after training: a final evaluation, a save
    time.sleep(1.0 if session.rank == 1 else 2.0)
    if session.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    session.log("after_run", rank=session.rank)
