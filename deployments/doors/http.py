"""The HTTP door: `POST /v1/actions/generations` and the info routes, as a FastAPI app over the graph runner.

Route code only raises: every error reaches a client through `deployments.error_replies` (the one table), via the
exception handlers installed here, in the request's codec. Routes: docs/wire-protocol.md. The OpenPI WebSocket door
is mounted on the same app (Serve gives an application one ASGI ingress), at its path and at `/`. The API-key
dependency names the caller's tenant (`deployments.auth`), and the route runs the request as that tenant's.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from starlette.responses import JSONResponse, Response

from deployments.auth import ConnectionSlots, caller_of, tenant_from_header
from deployments.config.settings import IngressSettings
from deployments.doors import Door, register_door
from deployments.error_replies import HANDLED_EXCEPTIONS, classify, reply_response
from deployments.graph_runner import GraphRunner
from deployments.requests.generations import GenerationRequest, parse_generation_request
from deployments.requests.limits import decode_in_worker, request_limits
from deployments.requests.replies import build_response
from deployments.tenants import DEFAULT_TENANT, TenantKeys
from dreamzero.errors import DreamZeroError, PayloadTooLarge, RequestTimeout
from dreamzero_client.wire import codec, generations, routes

#: liveness of the front door alone (openpi's check); /health also asks every deployment
HEALTHZ_PATH = "/healthz"
#: a body still arriving after this long counts against its caller's `http.body_reads_per_tenant`
SLOW_BODY_S = 1.0


def error_flavour(request: Request) -> str:
    """Error bodies follow the request's codec when it has a known one (msgpack clients decode msgpack)."""
    try:
        return codec.flavour_for_content_type(request.headers.get("content-type"))
    except DreamZeroError:
        return codec.JSON


@register_door
class HttpDoor(Door):
    """The generations route and the info routes, without the ASGI app (the graph tests drive `generate`)."""

    name = "http"
    hosted = True  # `build_fastapi_app` serves its routes: the ingress's own app, which mounts the others

    def __init__(self, runner: GraphRunner, settings: IngressSettings, keys: TenantKeys | None = None):
        super().__init__(runner)
        self.settings = settings
        self.keys = keys or TenantKeys.from_settings(settings.auth)
        h = settings.http
        # what a body may hold decoded: the widest legal request of this server (rows), within the body limit
        self.decode_limits = request_limits(max_rows=runner.max_rows, max_bytes=h.max_body_bytes)
        self.body_reads = ConnectionSlots("request bodies arriving", h.body_reads_per_tenant, "body_reads_per_tenant")

    # 1. POST /v1/actions/generations ------------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (before it is all in memory), with 408 when it
        has not all arrived within `http.body_timeout_s` or arrives slower than `http.body_min_bytes_per_s` after
        `http.body_grace_s` (the door's bounds: Serve's proxy timeout is off, since it would also end every WebSocket
        connection at that age), and with 429 when it is still arriving after `SLOW_BODY_S` while the caller has
        `http.body_reads_per_tenant` other slow ones (a usual body arrives well within it and is never counted)."""
        limit = self.settings.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
        tenant = getattr(getattr(request, "state", None), "tenant", DEFAULT_TENANT)
        client = getattr(request, "client", None)
        caller = caller_of(self.keys, tenant, client.host if client else None)
        counted: list[str] = []  # the caller, once the body is slow and holds one of its slots
        try:
            return await self._read_chunks(request, limit, caller, counted)
        finally:
            for c in counted:
                self.body_reads.release(c)

    async def _read_chunks(self, request: Request, limit: int, caller: str, counted: list[str]) -> bytes:
        h = self.settings.http
        bound = min(h.body_timeout_s, h.request_timeout_s)
        knob = "body_timeout_s" if h.body_timeout_s <= h.request_timeout_s else "request_timeout_s"
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        pending: asyncio.Future | None = None  # the next chunk; kept across waits (cancelling it would end the stream)
        try:
            while True:
                # the next chunk must come before the body would fall below the minimum rate, and before the bound
                by_rate = max(h.body_grace_s, size / h.body_min_bytes_per_s) if h.body_min_bytes_per_s else bound
                due = min(bound, by_rate) if counted else min(bound, by_rate, SLOW_BODY_S)
                pending = pending or asyncio.ensure_future(stream.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=max(0.0, due - (loop.time() - start)))
                if done:
                    try:
                        chunk = pending.result()
                    except StopAsyncIteration:
                        return b"".join(chunks)
                    pending = None
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
                    continue
                elapsed = loop.time() - start
                if not counted and elapsed < min(bound, by_rate):  # slow from now on: it holds one of the caller's
                    self.body_reads.acquire(caller)
                    counted.append(caller)
                    continue
                if elapsed >= bound:
                    message = f"the request body did not arrive within {bound:g} s (http.{knob})"
                else:
                    message = (
                        f"the request body arrives slower than {h.body_min_bytes_per_s} bytes/s "
                        f"(http.body_min_bytes_per_s): {size} bytes in {elapsed:.1f} s"
                    )
                raise RequestTimeout(message)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def parse(self, body: bytes, content_type: str | None) -> GenerationRequest:
        """Decode and validate a body within the door's decode limits; raises the error that names the bad field."""
        obj, flavour = codec.decode_body(body, content_type, limits=self.decode_limits)
        return parse_generation_request(obj, flavour, max_batch=self.runner.max_rows)

    async def parse_async(self, body: bytes, content_type: str | None) -> GenerationRequest:
        """`parse`, on a decoding thread when the body is large: the event loop keeps serving other callers and
        /healthz meanwhile."""
        return await decode_in_worker(len(body), self.parse, body, content_type)

    async def answer(self, req: GenerationRequest, t0: float, tenant: str = DEFAULT_TENANT) -> tuple[bytes, str]:
        """Run a parsed request of `tenant` (decoding started at `t0`) -> (reply body in the request's codec, content
        type)."""
        t_decode = (time.perf_counter() - t0) * 1000.0
        reply = await self.run(req, tenant)
        timings = {"decode": t_decode, **reply.timings_ms}
        timings["ingress_total"] = (time.perf_counter() - t0) * 1000.0
        self.metrics.observe_stages({k: timings[k] for k in ("decode", "ingress_total")})  # the graph's: the runner
        echo = self.echo(reply, req)
        resp = build_response(req, reply.actions, reply.sessions, timings, video=reply.video, echo=echo)
        resp["served_by"] = reply.replica
        resp["batch_requests"] = reply.batch_requests
        return codec.encode_body(resp, req.flavour)

    async def generate(self, body: bytes, content_type: str | None) -> tuple[bytes, str]:
        """`parse` + `answer` in one call."""
        t0 = time.perf_counter()
        return await self.answer(await self.parse_async(body, content_type), t0)

    def count_generation(self, request: Request, status: int, code: str | None = None, sent: int = 0) -> None:
        """One answered (or refused) generations request, with what the route noted on `request.state`."""
        state = request.state
        tenant, form = getattr(state, "tenant", None), getattr(state, "form", "unknown")
        received = getattr(state, "received", 0)
        self.count(tenant, status, code, route=routes.GENERATIONS_PATH, form=form, received=received, sent=sent)

    # 2. Health, metadata, models ----------------------------------------------------------------------------------
    async def health(self) -> dict:
        """Ready when one replica of every deployment answers; raises NotReady otherwise."""
        return {"status": "ok", "deployments": await self.runner.health()}

    async def metadata(self) -> dict:
        info = await self.runner.model_info()
        return {
            "object": "action.metadata",
            "policy_family": "dreamzero",
            "model": self.settings.model_name,
            "config": info.config_name,
            "embodiment": self.settings.graph.embodiment.tag,
            "action_horizon": info.action_horizon,
            "action_dim": info.action_dim,
            "padded_action_dim": info.padded_action_dim,
            "max_state_dim": info.max_state_dim,
            "forms": list(generations.FORMS),
            "defaults": {
                "seed": info.default_seed,
                "response_format": "envelope",
                "output_format": "numpy",
                "num_inference_steps": info.num_inference_steps,
            },
            "openpi": info.openpi_handshake,  # the WebSocket handshake; `?handshake=extended` adds the rest
        }

    async def models(self) -> dict:
        info = await self.runner.model_info()
        entry = {
            "id": self.settings.model_name,
            "object": "model",
            "owned_by": "dreamzero",
            "config": info.config_name,
            "embodiment": self.settings.graph.embodiment.tag,
            "action_horizon": info.action_horizon,
            # what one Policy replica settled at start (batching.max_batch_rows / sessions.max_bytes, auto or as set)
            "max_batch_rows": info.max_batch_rows,
            "session_budget_bytes": (info.memory or {}).get("budget_bytes"),
            "device": (info.memory or {}).get("device"),
        }
        if (info.memory or {}).get("topology"):  # policy.cfg_parallel: 2: the ranks of one replica and their branch
            entry["topology"] = info.memory["topology"]
        if (info.memory or {}).get("plan"):  # the memory plan the replica loaded by (dreamzero.planner; on a GPU)
            entry["plan"] = info.memory["plan"]
        return {"object": "list", "data": [entry]}


def build_fastapi_app(door: HttpDoor, *others: Door) -> FastAPI:
    """The ASGI app: the HTTP door's routes and the exception handlers, then each other hosted door's routes
    (`mount`: the OpenPI WebSocket door, any registered door the ingress hosts)."""
    app = FastAPI(title="DreamZero policy server", docs_url=None, redoc_url=None, openapi_url=None)
    retry_after = door.settings.http.retry_after_s

    async def require_api_key(request: Request, authorization: str | None = Header(None)) -> None:
        request.state.tenant = tenant_from_header(door.keys, authorization)

    async def error_reply(request: Request, exc: Exception) -> Response:
        reply = classify(exc, retry_after)
        response = reply_response(reply, error_flavour(request))
        if request.url.path == routes.GENERATIONS_PATH:
            door.count_generation(request, reply.status, reply.code, len(response.body))
        return response

    # Exception itself is answered by Starlette's outermost middleware, which re-raises after the reply so that
    # the server logs it: only a bug of the front door gets there; everything the table names is handled inside.
    for exc_class in (*HANDLED_EXCEPTIONS, Exception):
        app.add_exception_handler(exc_class, error_reply)

    protected = APIRouter(dependencies=[Depends(require_api_key)])

    @protected.post(routes.GENERATIONS_PATH)
    async def generations_route(request: Request) -> Response:
        content_type = request.headers.get("content-type")
        codec.flavour_for_content_type(content_type)  # 415 before reading the body
        received_at = time.time()  # the rows' deadlines and the reply's server_ms count from here
        body = await door.read_body(request)
        request.state.received = len(body)
        t0 = time.perf_counter()
        req = await door.parse_async(body, content_type)
        req.rows.received_at = received_at
        request.state.form = req.form  # the error handler counts the request under its form
        payload, reply_type = await door.answer(req, t0, request.state.tenant)
        door.count_generation(request, 200, sent=len(payload))
        return Response(payload, headers={"content-type": reply_type})

    @protected.get(routes.METADATA_PATH)
    async def metadata() -> Response:
        return JSONResponse(await door.metadata())

    @protected.get(routes.MODELS_PATH)
    async def models() -> Response:
        return JSONResponse(await door.models())

    app.include_router(protected)

    @app.get(routes.HEALTH_PATH)
    async def health() -> Response:
        return JSONResponse(await door.health())

    @app.get(HEALTHZ_PATH)
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    for other in others:
        other.mount(app)
    return app
