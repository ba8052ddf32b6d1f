"""DeadPool: keeps distributed PyTorch training alive through node failures.

A training script calls `init()`, wraps its model, registers its state and hands its step to
`Session.run`; `deadpool run` starts it on workers and spares. The runtime (and torch) is imported on
first use, so that the coordinator (coordinator/), which never imports torch, can import this package.
The launcher does import torch: it counts the GPUs (launcher/launch.py); the control-plane store it hosts
(protocol/store.py) does not.
"""

from __future__ import annotations

import importlib
from typing import Any

from deadpool.config import Fault, JobConfig
from deadpool.errors import ConfigError, DeadPoolError, ProtocolError, SwapAborted, WorkerFailure

_LAZY = {"DataParallel": "deadpool.runtime.comms", "Session": "deadpool.runtime.session",
         "init": "deadpool.runtime.session"}

__all__ = [
    "ConfigError", "DataParallel", "DeadPoolError", "Fault", "JobConfig", "ProtocolError",
    "Session", "SwapAborted", "WorkerFailure", "init",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deadpool' has no attribute {name!r}")
