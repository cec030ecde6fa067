"""The project's error hierarchy, as the model core and the server see it.

The errors that cross the wire (and the configuration / dependency errors a robot client also raises) live in the
light client package, `dreamzero_client.errors`, so that a robot installs them without torch or Ray; this module
re-exports them and adds what only the model core raises. `deployments/error_replies.py` maps every one of them to an
HTTP / WebSocket reply in one place.
"""

from __future__ import annotations

from dreamzero_client.errors import (
    CapacityError,
    ConfigError,
    DreamZeroError,
    InvalidObservation,
    InvalidRequest,
    MissingDependency,
    NotReady,
    PayloadTooLarge,
    QuotaExceeded,
    RequestTimeout,
    Unauthorized,
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
