"""Tests for deadpool/runtime/implicit.py's StepVariables: which variables of a step function are script
state (the names it rebinds with nonlocal or global), and their round trip through a snapshot."""

import torch

from deadpool.runtime.implicit import StepVariables
from deadpool.runtime.state import flatten, load_into, unflatten

counter = 0
untouched = 5


def make_step():
    batch, best, config = torch.zeros(2), 1e9, {"lr": 0.1}

    def train_step(step: int) -> None:
        nonlocal batch, best
        global counter
        batch = batch + step  # a prefetched batch
        best = min(best, float(step) + config["lr"] + untouched)  # config and untouched are only read
        counter += 1

    return train_step


def test_only_rebound_names_are_script_state():
    variables = StepVariables(make_step())
    assert variables.names() == ["batch", "best", "counter"]


def test_a_snapshot_of_the_variables_restores_them():
    global counter
    counter = 0
    step = make_step()
    variables = StepVariables(step)
    step(1)
    flat = flatten({"variables": variables})
    saved = unflatten(flat.skeleton, [t.clone() for t in flat.tensors], flat.numpy)
    step(2)
    step(3)
    assert counter == 3
    load_into({"variables": variables}, saved)
    assert counter == 1 and variables.state_dict()["best"] == 1.1 + untouched
    assert torch.equal(variables.state_dict()["batch"], torch.ones(2))
    step(2)  # the replay continues from the restored values
    assert torch.equal(variables.state_dict()["batch"], torch.full((2,), 3.0))


def test_a_variable_not_assigned_yet_is_left_out():
    def outer():
        if False:
            later = 0

        def train_step(step: int) -> None:
            nonlocal later
            later = step

        return train_step

    assert StepVariables(outer()).state_dict() == {}
