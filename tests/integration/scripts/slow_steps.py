"""The example trainer with every forward pass of the GPT slowed by SECONDS (a sleep: the numbers are
untouched), so that a test can act while the job runs. Usage: slow_steps.py SECONDS [--until FILE] [example
args...]; with --until, the pauses stop once FILE exists (the test has acted: the rest may run at full speed).
Like many scripts, it prints a banner before deadpool.init(): an idle spare prints it too.
"""

import os
import runpy
import sys
import time
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt" / "train.py"
pause, args = float(sys.argv[1]), sys.argv[2:]
until = Path(args[1]) if args[:1] == ["--until"] else None
print(f"slow_steps: every forward pass of the GPT paused {pause:g} s ({os.environ.get('DEADPOOL_PROC')})", flush=True)


def slow(module: torch.nn.Module, _args: object) -> None:
    if type(module).__name__ == "GPT" and not (until and until.exists()):
        time.sleep(pause)


torch.nn.modules.module.register_module_forward_pre_hook(slow)
sys.path.insert(0, str(EXAMPLE.parent))
sys.argv = [str(EXAMPLE), *(args[2:] if until else args)]
runpy.run_path(str(EXAMPLE), run_name="__main__")
