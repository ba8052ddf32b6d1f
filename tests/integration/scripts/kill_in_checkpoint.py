"""Runs examples/gpt/train_ddp_deadpool.py, SIGKILLing the process that writes the first checkpoint
(rank 0) when half of the file is written, once per job (MARKER records that it happened).
Usage: kill_in_checkpoint.py MARKER [script args...]
"""

import io
import os
import runpy
import signal
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt" / "train_ddp_deadpool.py"
marker = sys.argv[1]
real_save = torch.save


def save(obj: object, f: object, *args: object, **kwargs: object) -> None:
    if str(f).endswith("ckpt.pt"):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return real_save(obj, f, *args, **kwargs)
        data = io.BytesIO()
        real_save(obj, data)
        with open(str(f), "wb") as out:
            out.write(data.getvalue()[: len(data.getvalue()) // 2])
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)


torch.save = save
sys.path.insert(0, str(EXAMPLE.parent))
sys.argv = [str(EXAMPLE), *sys.argv[2:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
