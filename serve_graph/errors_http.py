"""The one table that maps exceptions to HTTP replies and OpenPI WebSocket error frames.

Client mistakes become a 4xx that names the field; capacity problems and lost replicas become a retryable 503 with
`Retry-After`; everything else becomes a 500 with a fixed message. No traceback ever reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from ray import exceptions as ray_exc
from ray.serve import exceptions as serve_exc
from starlette.responses import JSONResponse

from dreamzero import errors

log = logging.getLogger("dreamzero.serve")

#: (exception class, HTTP status), first match wins: subclasses before their bases.
STATUS_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (errors.UnsupportedMediaType, 415),
    (errors.PayloadTooLarge, 413),
    (errors.InvalidObservation, 422),
    (errors.InvalidRequest, 400),
    (errors.Unauthorized, 401),
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

#: message for anything not in the table (the real exception is logged server-side only)
INTERNAL_MESSAGE = "Internal inference error"


@dataclass(frozen=True)
class ErrorReply:
    status: int
    code: str
    message: str
    field: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        # `detail` keeps FastAPI/sglang-style clients happy; `error` is the structured form.
        err = {"code": self.code, "message": self.message}
        if self.field is not None:
            err["field"] = self.field
        return {"error": err, "detail": self.message}

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
        retry = getattr(exc, "retry_after_s", None) if status == 503 else None
        return ErrorReply(status, exc.code, str(exc), getattr(exc, "field", None), retry)
    # a Ray-side retryable condition: say what happened without leaking internals
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        message = "the request did not finish in time; retry"
    elif isinstance(exc, serve_exc.BackPressureError):
        message = "the policy replica's queue is full; retry after the given delay"
    else:
        message = "a policy replica became unavailable (its sessions restart on the next call); retry"
    log.warning("retryable error answered as 503: %s", type(exc).__name__)
    return ErrorReply(503, "no_capacity", message, None, default_retry_after_s)


def http_error_response(exc: BaseException, default_retry_after_s: float = 1.0) -> JSONResponse:
    reply = classify(exc, default_retry_after_s)
    return JSONResponse(reply.body(), status_code=reply.status, headers=reply.headers())


def ws_error_frame(exc: BaseException) -> dict:
    """The vllm-omni style error frame; the socket stays open after it."""
    reply = classify(exc)
    frame = {"type": "error", "message": reply.message, "code": reply.code, "status": reply.status}
    if reply.field is not None:
        frame["field"] = reply.field
    return frame
