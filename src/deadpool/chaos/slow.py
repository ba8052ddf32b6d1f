"""The example trainer with each forward pass of its GPT slowed by a sleep, so that the chaos runner has the time
to act on a running job (stop a holder, cut a link); the numbers are untouched, so the run still ends bit for bit
equal to the unslowed failure-free one. Usage: python -m deadpool.chaos.slow SECONDS [example args...]
"""

import runpy
import sys
import time

import torch

from deadpool.examples import GPT_DIR

EXAMPLE = GPT_DIR / "train.py"


def main() -> None:
    pause = float(sys.argv[1])

    def slow(module: torch.nn.Module, _args: object) -> None:
        if type(module).__name__ == "GPT":
            time.sleep(pause)

    torch.nn.modules.module.register_module_forward_pre_hook(slow)
    sys.path.insert(0, str(GPT_DIR))  # the example imports its model and data modules by their bare names
    sys.argv = [str(EXAMPLE), *sys.argv[2:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
