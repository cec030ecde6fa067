"""The ingress's FastAPI app: routes, the one API-key dependency and the exception handlers.

Route code only raises: every error reaches a client through `serve_graph.errors_http` (the one table), via the
exception handlers installed here, in the request's codec. Routes: docs/wire-protocol.md.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, FastAPI, Header, Request, WebSocket
from starlette.responses import JSONResponse, Response

from deployments.auth import check_api_key
from dreamzero.errors import DreamZeroError
from dreamzero_client.wire import codec, routes
from serve_graph.errors_http import HANDLED_EXCEPTIONS, classify, reply_response

if TYPE_CHECKING:
    from deployments.ingress import IngressDeployment

#: liveness of the front door alone (openpi's check); /health also asks every deployment
HEALTHZ_PATH = "/healthz"


def error_flavour(request: Request) -> str:
    """Error bodies follow the request's codec when it has a known one (msgpack clients decode msgpack)."""
    try:
        return codec.flavour_for_content_type(request.headers.get("content-type"))
    except DreamZeroError:
        return codec.JSON


def build_fastapi_app(ingress: IngressDeployment) -> FastAPI:
    app = FastAPI(title="DreamZero policy server", docs_url=None, redoc_url=None, openapi_url=None)
    retry_after = ingress.cfg.http.retry_after_s

    async def require_api_key(authorization: str | None = Header(None)) -> None:
        check_api_key(ingress.api_key, authorization)

    async def error_reply(request: Request, exc: Exception) -> Response:
        reply = classify(exc, retry_after)
        if request.url.path == routes.GENERATIONS_PATH:
            ingress.count_request(reply.status, getattr(request.state, "form", "unknown"))
        return reply_response(reply, error_flavour(request))

    # Exception itself is answered by Starlette's outermost middleware, which re-raises after the reply so that
    # the server logs it: only a bug of the front door gets there; everything the table names is handled inside.
    for exc_class in (*HANDLED_EXCEPTIONS, Exception):
        app.add_exception_handler(exc_class, error_reply)

    protected = APIRouter(dependencies=[Depends(require_api_key)])

    @protected.post(routes.GENERATIONS_PATH)
    async def generations(request: Request) -> Response:
        content_type = request.headers.get("content-type")
        codec.flavour_for_content_type(content_type)  # 415 before reading the body
        body = await ingress.read_body(request)
        t0 = time.perf_counter()
        req = ingress.parse(body, content_type)
        request.state.form = req.form
        payload, reply_type = await ingress.answer(req, t0)
        ingress.count_request(200, req.form)
        return Response(payload, headers={"content-type": reply_type})

    @protected.get(routes.METADATA_PATH)
    async def metadata() -> Response:
        return JSONResponse(await ingress.metadata())

    @protected.get(routes.MODELS_PATH)
    async def models() -> Response:
        return JSONResponse(await ingress.models())

    app.include_router(protected)

    @app.get(routes.HEALTH_PATH)
    async def health() -> Response:
        return JSONResponse(await ingress.health())

    @app.get(HEALTHZ_PATH)
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.websocket(routes.OPENPI_WS_PATH)
    async def openpi_ws(websocket: WebSocket) -> None:
        await ingress.openpi.serve(websocket)

    @app.websocket("/")  # openpi-client connects to the server root
    async def openpi_ws_root(websocket: WebSocket) -> None:
        await ingress.openpi.serve(websocket)

    return app
