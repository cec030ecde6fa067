"""The one table that maps exceptions to HTTP replies and OpenPI WebSocket error frames.

Client mistakes become a 4xx that names the field; a tenant over one of its quotas a 429 (with `Retry-After` when
waiting helps); capacity problems and lost replicas become a retryable 503 with `Retry-After`; everything else
becomes a 500 with a fixed message. No traceback ever reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from ray import exceptions as ray_exc
from ray.serve import exceptions as serve_exc
from starlette.responses import Response

from deployments.requests import openpi
from dreamzero import errors
from dreamzero_client.wire import codec, replies

log = logging.getLogger("dreamzero.serve")

#: (exception class, HTTP status), first match wins: subclasses before their bases.
STATUS_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (errors.UnsupportedMediaType, 415),
    (errors.PayloadTooLarge, 413),
    (errors.RequestTimeout, 408),
    (errors.InvalidObservation, 422),
    (errors.InvalidRequest, 400),
    (errors.Unauthorized, 401),
    (errors.QuotaExceeded, 429),
    (errors.CapacityError, 503),
    (errors.NotReady, 503),
    # Ray-side conditions a client should retry: queue full, replica gone or restarting, graph timeout.
    (serve_exc.BackPressureError, 503),
    (serve_exc.DeploymentUnavailableError, 503),
    (serve_exc.ReplicaUnavailableError, 503),
    (ray_exc.RayActorError, 503),
    (serve_exc.RequestCancelledError, 503),
    (TimeoutError, 503),
    (asyncio.TimeoutError, 503),
)

#: what the HTTP app's exception handlers catch: every class the table names, and Ray's wrapper of replica errors
#: (a RayTaskError of an unknown cause is a 500 by the table)
HANDLED_EXCEPTIONS: tuple[type[BaseException], ...] = (
    errors.DreamZeroError,
    ray_exc.RayError,
    *dict.fromkeys(cls for cls, _ in STATUS_TABLE),
)

#: message for anything not in the table (the real exception is logged server-side only)
INTERNAL_MESSAGE = "Internal inference error"
#: longest message and field name a reply carries: a message may quote what the request sent (a shape list of
#: millions of items), and a small bad request must get a small reply
MAX_MESSAGE_CHARS = 1024
MAX_FIELD_CHARS = 256


def clip(text: str | None, limit: int) -> str | None:
    """`text` cut to `limit` characters, saying how much was cut."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[: limit - 40]}... ({len(text) - limit + 40} more characters)"


@dataclass(frozen=True)
class ErrorReply:
    status: int
    code: str
    message: str
    field: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        return replies.error_body(self.code, self.message, self.field)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


def unwrap(exc: BaseException) -> BaseException:
    """Ray re-raises replica exceptions wrapped in RayTaskError; the original (with `.field`) is its `.cause`."""
    seen = 0
    while isinstance(exc, ray_exc.RayTaskError) and getattr(exc, "cause", None) is not None and seen < 5:
        exc = exc.cause
        seen += 1
    return exc


def classify(exc: BaseException, default_retry_after_s: float = 1.0) -> ErrorReply:
    """Map any exception to the reply a client sees."""
    exc = unwrap(exc)
    status = next((code for cls, code in STATUS_TABLE if isinstance(exc, cls)), 500)
    if status == 500:
        log.error("internal error answered as 500", exc_info=exc)
        return ErrorReply(500, "internal_error", INTERNAL_MESSAGE)
    if isinstance(exc, errors.DreamZeroError):
        retry = getattr(exc, "retry_after_s", None) if status in (429, 503) else None
        message, field = clip(str(exc), MAX_MESSAGE_CHARS), clip(getattr(exc, "field", None), MAX_FIELD_CHARS)
        return ErrorReply(status, exc.code, message, field, retry)
    # a Ray-side retryable condition: say what happened without leaking internals
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        message = "the request did not finish in time; retry"
    elif isinstance(exc, serve_exc.BackPressureError):
        message = "the policy replica's queue is full; retry after the given delay"
    else:
        message = "a policy replica became unavailable (its sessions restart on the next call); retry"
    log.warning("retryable error answered as 503: %s", type(exc).__name__)
    return ErrorReply(503, "no_capacity", message, None, default_retry_after_s)


def reply_response(reply: ErrorReply, flavour: str = codec.JSON) -> Response:
    """The HTTP reply, its body in the codec `flavour` (the request's, when it had a known one)."""
    payload, content_type = codec.encode_body(reply.body(), flavour)
    return Response(payload, status_code=reply.status, headers={"content-type": content_type, **reply.headers()})


def ws_error_frame(exc: BaseException) -> dict:
    """The vllm-omni style error frame; the socket stays open after it. A retryable one (429, 503) also says when to
    retry (`retry_after_s`, as the ZeroMQ door's error reply does)."""
    reply = classify(exc)
    frame = {**openpi.error_frame(reply.message, reply.code, reply.field), "status": reply.status}
    if reply.retry_after_s is not None:
        frame["retry_after_s"] = reply.retry_after_s
    return frame
