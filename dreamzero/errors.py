"""The project's error hierarchy.

Every layer raises these; `serve_graph/errors_http.py` maps them to HTTP/WebSocket replies in one place.
Messages are written for the person who sent the request: name the field, what was expected, what was received.
"""

from __future__ import annotations


class DreamZeroError(Exception):
    """Base class of every error this project raises on purpose."""

    #: machine-readable code carried in error replies
    code: str = "internal_error"


class ConfigError(DreamZeroError, ValueError):
    """A configuration value (preset, config.json, serve args) is invalid; the message says how to fix it."""

    code = "invalid_config"


class CheckpointError(DreamZeroError):
    """A checkpoint directory is missing files or holds missing / unexpected / misshaped tensors."""

    code = "invalid_checkpoint"


class InvalidRequest(DreamZeroError, ValueError):
    """The request body is malformed (cannot be decoded, wrong structure). HTTP 400."""

    code = "invalid_request"


class InvalidObservation(InvalidRequest):
    """An observation/parameter field has a wrong key, shape, dtype or value. HTTP 422.

    `field` names the offending field (e.g. ``input.observation.state.joint_position``).
    """

    code = "invalid_observation"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnsupportedMediaType(InvalidRequest):
    """Content type is neither JSON nor msgpack. HTTP 415."""

    code = "unsupported_media_type"


class PayloadTooLarge(InvalidRequest):
    """Body over the configured limit. HTTP 413."""

    code = "payload_too_large"


class Unauthorized(DreamZeroError):
    """Missing or wrong API key. HTTP 401."""

    code = "unauthorized"


class SessionMismatch(DreamZeroError):
    """A session's state cannot be continued as the client expects (reported, not fatal: the session restarts)."""

    code = "session_mismatch"


class CapacityError(DreamZeroError):
    """No capacity right now (queue full, every session slot busy). HTTP 503 with Retry-After."""

    code = "no_capacity"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(DreamZeroError):
    """The model or a deployment is still loading. HTTP 503."""

    code = "not_ready"

    def __init__(self, message: str, retry_after_s: float = 5.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MissingDependency(DreamZeroError, ImportError):
    """An optional extra (isaaclab, franky-control, pyrealsense2, ...) is not installed; says what to install."""

    code = "missing_dependency"
