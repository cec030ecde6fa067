"""Errors of the wire protocol and of the clients.

Two families live here so that a robot needs this one light package:
- `DreamZeroError` and its subclasses are raised on purpose by whoever validates something (the protocol parser on
  either side, a config check, a robot backend); the server maps them to HTTP / WebSocket replies in one place.
  Messages name the field, what was expected and what was received.
- `ClientError` and its subclasses are what a client raises about the server's answer; each carries what the
  server said.
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


class MissingDependency(DreamZeroError, ImportError):
    """An optional extra (isaaclab, franky-control, pyrealsense2, ...) is not installed; says what to install."""

    code = "missing_dependency"


# Client side: what the server answered -----------------------------------------------------------------------------
# Typed exceptions raised by the clients; each carries what the server said.
#
# ClientError
# +-- ProtocolError            the reply does not follow the wire protocol (bad content type, missing fields)
# +-- ServerError              the server answered with an error (status, code, message, field)
# |   +-- BadRequestError      4xx: the request is wrong; never retried
# |   |   +-- AuthenticationError   401 / 403
# |   +-- QuotaExceededError   429: the caller's tenant is over a quota; `retry_after_s` says when to try again
# |   +-- PolicyServerError    an OpenPI error frame or text frame
# +-- ServerUnavailableError   retries exhausted: connection errors, timeouts, 5xx (last status/cause attached)
# |   +-- ReadyTimeout         `wait_until_ready` ran out of time
# |   +-- ReplyTimeout         no reply within the call's timeout (the connection is dropped, not reused)
# +-- SecureChannelError       TLS certificate not verified / TLS or CURVE handshake refused; never retried


class ClientError(Exception):
    """Base class of every error the clients raise on purpose."""


class ProtocolError(ClientError):
    """The server's reply cannot be read as the protocol says (content type, shape, missing keys)."""


class ServerError(ClientError):
    """The server answered with an error; `message` is its own text, `field` the offending field if it named one."""

    def __init__(
        self, message: str, status: int | None = None, code: str | None = None, field: str | None = None, body=None
    ):
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.body = body
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
        self.attempts = attempts
        self.status = status
        self.server_message = server_message
        super().__init__(message)


class ReadyTimeout(ServerUnavailableError, TimeoutError):
    """The server did not report ready within the bound given to `wait_until_ready`."""


class ReplyTimeout(ServerUnavailableError, TimeoutError):
    """No reply within the call's timeout."""


class SecureChannelError(ClientError, ConnectionError):
    """The encrypted channel could not be set up: the server's TLS certificate did not verify (unknown CA, another
    host name, expired), the TLS handshake failed, or the ZeroMQ CURVE handshake was refused. Never retried and never
    answered by falling back to plain text; `reason` is the cause as the TLS library or ZeroMQ reported it.

    A `ConnectionError` too, so a policy loop files it with the other unreachable-server failures."""

    def __init__(self, message: str, reason: str | None = None):
        self.reason = reason
        super().__init__(message)
