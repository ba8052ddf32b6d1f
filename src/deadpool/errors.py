"""The small error taxonomy every DeadPool failure is reported with."""


class DeadPoolError(Exception):
    """Base class: anything DeadPool raises on purpose."""


class ConfigError(DeadPoolError, ValueError):
    """The user's configuration or input is invalid; nothing was started."""


class UsageError(ConfigError):
    """The script used DeadPool's API in a way DeadPool cannot honour (the model used outside session.run(),
    torch's DDP handed to it, run() called twice): the script's mistake, so a spare would meet it again. It
    stops the job as a script error, its message naming what to change."""


class WorkerFailure(DeadPoolError):
    """A worker process died or its collective failed, and the job could not continue."""


class PeerFailure(WorkerFailure):
    """Some rank of this generation failed (it died or hung, or the coordinator aborted the generation),
    seen where DeadPool itself communicates: this process unwinds the step and recovers. The only error
    a survivor recovers from on sight; runtime/failures.py decides about every other error."""


class CollectiveAborted(PeerFailure):
    """A collective was abandoned because the coordinator aborted its generation (or it timed out)."""


class GenerationAborted(PeerFailure):
    """The coordinator replaced this generation: unwind the step and recover."""


class ProtocolError(DeadPoolError):
    """A message broke the protocol: wrong token, stale generation, bad header."""


class ChecksumMismatch(ProtocolError):
    """A replica arrived with bytes that do not match its checksum; it is dropped, the stream goes on."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step


class SwapAborted(DeadPoolError):
    """A recovery did not finish within its deadline, or no spare was left to take over."""


class ControlPlaneError(DeadPoolError, RuntimeError):
    """The coordinator's store could not be reached, timed out, or answered outside the protocol."""


class AuthenticationError(ControlPlaneError):
    """A peer of the control plane did not prove that it holds the job's secret, or broke a frame's MAC."""


class StoreTimeout(ControlPlaneError):
    """A key awaited in the coordinator's store did not appear in time."""


class CheckpointError(DeadPoolError):
    """A checkpoint on disk is incomplete or damaged, or cannot be restored into this job."""


class InjectedError(Exception):
    """Raised by an `error` fault: stands for a bug in the training script (so not a DeadPoolError)."""
