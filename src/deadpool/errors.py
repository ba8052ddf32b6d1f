"""The small error taxonomy every DeadPool failure is reported with."""


class DeadPoolError(Exception):
    """Base class: anything DeadPool raises on purpose."""


class ConfigError(DeadPoolError, ValueError):
    """The user's configuration or input is invalid; nothing was started."""


class WorkerFailure(DeadPoolError):
    """A worker process died or its collective failed, and the job could not continue."""


class ProtocolError(DeadPoolError):
    """A message broke the protocol: wrong token, stale generation, bad header."""


class SwapAborted(DeadPoolError):
    """A recovery did not finish within its deadline, or no spare was left to take over."""


class ControlPlaneError(DeadPoolError, RuntimeError):
    """The coordinator's store could not be reached, timed out, or answered outside the protocol."""


class AuthenticationError(ControlPlaneError):
    """A peer of the control plane did not prove that it holds the job's secret, or broke a frame's MAC."""


class StoreTimeout(ControlPlaneError):
    """A key awaited in the coordinator's store did not appear in time."""
