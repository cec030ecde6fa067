"""The project's error hierarchy, as the model core and the server see it.

The errors that cross the wire (and the configuration / dependency errors a robot client also raises) live in the
light client package, `dreamzero_client.errors`, so that a robot installs them without torch or Ray; this module
re-exports them and adds what only the model core and the server raise (capacity, quota, readiness, auth).
`deployments/error_replies.py` maps every one of them to an HTTP / WebSocket reply in one place.
"""

from __future__ import annotations

from dreamzero_client.errors import (
    ConfigError,
    DreamZeroError,
    InvalidObservation,
    InvalidRequest,
    MissingDependency,
    PayloadTooLarge,
    UnsupportedMediaType,
)

__all__ = [
    "CapacityError",
    "CheckpointError",
    "ConfigError",
    "DreamZeroError",
    "InvalidObservation",
    "InvalidRequest",
    "MissingDependency",
    "NotReady",
    "PayloadTooLarge",
    "QuotaExceeded",
    "RequestTimeout",
    "Unauthorized",
    "UnsupportedMediaType",
]


class CheckpointError(DreamZeroError):
    """A checkpoint directory is missing files or holds missing / unexpected / misshaped tensors."""

    code = "invalid_checkpoint"


class RequestTimeout(InvalidRequest):
    """The request body did not arrive within the server's bound. HTTP 408."""

    code = "request_timeout"


class Unauthorized(DreamZeroError):
    """Missing or wrong API key. HTTP 401."""

    code = "unauthorized"


class CapacityError(DreamZeroError):
    """No capacity right now (queue full, every session slot busy). HTTP 503 with Retry-After."""

    code = "no_capacity"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(DreamZeroError):
    """The caller's tenant is over one of its quotas (requests per second, rows per request, live sessions).
    HTTP 429 with `Retry-After` when waiting helps (`retry_after_s`; None for a request too large for the quota).

    `quota` names which one: `requests_per_s`, `max_rows_per_request`, `max_sessions_per_replica`, `max_sessions`.
    """

    code = "quota_exceeded"

    def __init__(self, message: str, quota: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.quota = quota
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # raised in a Policy replica, read in the door: pickled with its quota and hint
        return type(self), (str(self), self.quota, self.retry_after_s)


class NotReady(DreamZeroError):
    """The model or a deployment is still loading. HTTP 503."""

    code = "not_ready"

    def __init__(self, message: str, retry_after_s: float = 5.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s
