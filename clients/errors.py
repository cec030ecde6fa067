"""Typed exceptions raised by the clients; each carries what the server said.

ClientError
+-- ProtocolError            the reply does not follow the wire protocol (bad content type, missing fields)
+-- ServerError              the server answered with an error (status, code, message, field)
|   +-- BadRequestError      4xx: the request is wrong; never retried
|   |   +-- AuthenticationError   401 / 403
|   +-- PolicyServerError    an OpenPI error frame or text frame
+-- ServerUnavailableError   retries exhausted: connection errors, timeouts, 5xx (last status/cause attached)
    +-- ReadyTimeout         `wait_until_ready` ran out of time
    +-- ReplyTimeout         no reply within the call's timeout (the connection is dropped, not reused)
"""

from __future__ import annotations


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
