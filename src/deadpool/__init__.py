"""DeadPool: keeps distributed PyTorch training alive through node failures.

A training script calls `init()`, wraps its model, registers its state and hands its step to
`Session.run`; `deadpool run` starts it on workers and spares.
"""

from deadpool.config import Fault, JobConfig
from deadpool.errors import ConfigError, DeadPoolError, ProtocolError, SwapAborted, WorkerFailure
from deadpool.runtime.comms import DataParallel
from deadpool.runtime.session import Session, init

__all__ = [
    "ConfigError", "DataParallel", "DeadPoolError", "Fault", "JobConfig", "ProtocolError",
    "Session", "SwapAborted", "WorkerFailure", "init",
]
