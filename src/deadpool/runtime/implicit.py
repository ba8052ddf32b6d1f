"""The state DeadPool snapshots without being asked: the RNGs, and the variables the step function rebinds."""

from __future__ import annotations

import dis
import random
from typing import Any, Callable

import numpy as np
import torch


class RNGState:
    """Every random number generator a step may draw from: Python, NumPy, torch and this rank's GPU.

    The GPU's generator is saved and restored by *this process's* device, not by index: a spare that
    takes over a rank may run on another GPU than the one the snapshot was taken on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


class StepVariables:
    """The variables a step function rebinds that outlive the call (the names it declares `nonlocal` or
    `global` and assigns): the script's own state, such as an iteration counter, the best metric or a
    prefetched batch. They are snapshotted and restored with the registered objects, so that a port
    needs no restructuring to be correct."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        stored = [(i.opname, i.argval) for i in dis.get_instructions(fn) if i.opname in ("STORE_DEREF", "STORE_GLOBAL")]
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        self.cells = {name: cells[name] for op, name in sorted(set(stored)) if op == "STORE_DEREF" and name in cells}
        self.globals = sorted({name for op, name in stored if op == "STORE_GLOBAL"})
        self.namespace = fn.__globals__

    def names(self) -> list[str]:
        return [*self.cells, *self.globals]

    def state_dict(self) -> dict[str, Any]:
        state = {}
        for name, cell in self.cells.items():
            try:
                state[name] = cell.cell_contents
            except ValueError:  # not assigned yet
                pass
        state.update({name: self.namespace[name] for name in self.globals if name in self.namespace})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            current = self.cells[name].cell_contents if name in self.cells else self.namespace.get(name)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                value = value.to(current.device)  # restored from host memory onto the device it lived on
            if name in self.cells:
                self.cells[name].cell_contents = value
            else:
                self.namespace[name] = value
