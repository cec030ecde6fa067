"""Errors of the wire protocol and of the clients (table in docs/clients.md).

- `DreamZeroError`: raised on purpose by whoever validates something (a parser on either side, a config check, a
  robot backend), naming the field; the server maps it to a reply (its own refusals are in `dreamzero.errors`).
- `ClientError`: what a client raises about the server's answer, carrying what the server said.
"""

from __future__ import annotations


class DreamZeroError(Exception):
    """Base class of every error this project raises on purpose."""

    #: machine-readable code carried in error replies
    code: str = "internal_error"


class ConfigError(DreamZeroError, ValueError):
    """A configuration value (preset, config.json, serve args) is invalid; the message says how to fix it."""

    code = "invalid_config"


class InvalidRequest(DreamZeroError, ValueError):
    """The request body is malformed (cannot be decoded, wrong structure). HTTP 400."""

    code = "invalid_request"


class InvalidObservation(InvalidRequest):
    """An observation/parameter field (`field`, e.g. ``input.observation.state.joint_position``) has a wrong key,
    shape, dtype or value. HTTP 422."""

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


class MissingDependency(DreamZeroError, ImportError):
    """An optional extra (isaaclab, franky-control, pyrealsense2, ...) is not installed; says what to install."""

    code = "missing_dependency"


# Client side: what the server answered -----------------------------------------------------------------------------


class ClientError(Exception):
    """Base class of every error the clients raise on purpose."""


class ProtocolError(ClientError):
    """The server's reply cannot be read as the protocol says (content type, shape, missing keys)."""


class ServerError(ClientError):
    """The server answered with an error; `message` is its own text, `field` the offending field if it named one."""

    def __init__(
        self, message: str, status: int | None = None, code: str | None = None, field: str | None = None, body=None
    ):
        self.status, self.code, self.message, self.field, self.body = status, code, message, field, body
        parts = [f"HTTP {status}" if status is not None else None, code, f"field {field!r}" if field else None]
        prefix = ", ".join(p for p in parts if p)
        super().__init__(f"[{prefix}] {message}" if prefix else message)


class BadRequestError(ServerError):
    """A 4xx reply (400, 404, 413, 415, 422, ...): fix the request, retrying will not help."""


class AuthenticationError(BadRequestError):
    """401/403: missing or wrong API key."""


class QuotaExceededError(ServerError):
    """429: this key's tenant is over one of its quotas (docs/serving.md, "Tenants and TLS"). Not retried by the
    clients: `retry_after_s` (the server's `Retry-After`, None when waiting cannot help) says when the same call
    may pass, and the robot loop decides whether to wait."""

    def __init__(self, message: str, status: int | None = 429, code: str | None = None, field: str | None = None,
                 body=None, retry_after_s: float | None = None):  # fmt: skip
        super().__init__(message, status, code, field, body)
        self.retry_after_s = retry_after_s


class PolicyServerError(ServerError):
    """An OpenPI server sent an error frame (``{"type": "error", ...}``) or a text frame (e.g. a traceback)."""


class ServerUnavailableError(ClientError):
    """The server could not answer after every retry (connection refused, timeouts, 500/502/503/504)."""

    def __init__(self, message: str, attempts: int = 0, status: int | None = None, server_message: str | None = None):
        self.attempts, self.status, self.server_message = attempts, status, server_message
        super().__init__(message)


class ReadyTimeout(ServerUnavailableError, TimeoutError):
    """The server did not report ready within the bound given to `wait_until_ready`."""


class ReplyTimeout(ServerUnavailableError, TimeoutError):
    """No reply within the call's timeout."""


class SecureChannelError(ClientError, ConnectionError):
    """The server's TLS certificate did not verify, or the TLS or CURVE handshake failed. Never retried, never
    answered in plain text; `reason` as the TLS library or ZeroMQ said. A `ConnectionError` too, for policy loops."""

    def __init__(self, message: str, reason: str | None = None):
        self.reason = reason
        super().__init__(message)
