"""The example trainer with one process spinning in Python inside train_step (forward of one step).

A spin keeps the process alive and its heartbeat thread running (the GIL is handed over every few ms),
so only the progress reports can tell it is hung. Usage: spinning_train.py PROC STEP [example args...];
the process named PROC (e.g. w1) spins in the forward pass of STEP; whoever takes its rank over does not.
"""

import os
import runpy
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt" / "train.py"
proc, spin_step = sys.argv[1], int(sys.argv[2])
forwards = 0


def spin(module: torch.nn.Module, _args: object) -> None:
    global forwards
    if type(module).__name__ != "GPT":
        return
    forwards += 1  # the example runs one forward pass of the whole model per step
    if forwards == spin_step and os.environ["DEADPOOL_PROC"] == proc:
        while True:
            pass


torch.nn.modules.module.register_module_forward_pre_hook(spin)
sys.path.insert(0, str(EXAMPLE.parent))
sys.argv = [str(EXAMPLE), *sys.argv[3:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
