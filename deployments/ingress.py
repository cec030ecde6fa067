"""Ingress deployment: HTTP + OpenPI WebSocket front door. Decodes, validates, authenticates, applies limits, picks the
routing key and drives Preprocess -> Policy -> Postprocess. It never loads the model.

Routes: POST /v1/actions/generations, GET /health, GET /healthz, GET /v1/actions/metadata, GET /v1/models,
WebSocket /v1/realtime/robot/openpi and / (openpi-client connects to the server root).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, WebSocket
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocketDisconnect, WebSocketState

from deployments.preprocess import load_embodiment, openpi_key_map
from dreamzero.errors import InvalidObservation, InvalidRequest, NotReady, PayloadTooLarge, Unauthorized
from dreamzero.types import ModelBatch
from dreamzero_client.wire import codec, generations, openpi, replies, routes
from serve_graph.config import parse_app_args
from serve_graph.errors_http import classify, http_error_response, ws_error_frame
from serve_graph.metrics import serving_metrics
from serve_graph.routing import sticky_call, ws_session_id

log = logging.getLogger("dreamzero.serve.ingress")

#: frames the model sees per camera after a session's first call (clients send one frame every 8 control steps)
WS_STACK_FRAMES = 4
#: close codes (RFC 6455)
WS_NORMAL, WS_POLICY_VIOLATION, WS_TOO_BIG = 1000, 1008, 1009


@dataclass
class GraphReply:
    actions: np.ndarray  # [B, H, D]: normalised + padded (normalised form) or robot actions (raw form)
    sessions: list  # SessionReport per row
    timings_ms: dict[str, float]
    replica: str
    batch_requests: int = 1  # requests merged into the model call that served this one


@dataclass
class _WsSession:
    """One OpenPI session of one connection: its namespaced id, frame buffers and the step it last saw."""

    session_id: str  # as the client named it
    model_id: str  # namespaced by connection
    buffers: dict[str, deque] = field(default_factory=dict)
    last_step: int | None = None
    last_incarnation: str | None = None
    reset_next: bool = True  # the first infer of a session starts it fresh


async def _bounded(awaitable: Any, timeout_s: float) -> Any:
    async def wait() -> Any:
        return await awaitable

    try:
        return await asyncio.wait_for(wait(), timeout_s)
    except asyncio.TimeoutError:
        cancel = getattr(awaitable, "cancel", None)
        if cancel is not None:
            cancel()
        raise


def _over_grpc(handle: Any) -> Any:
    """The handle with Serve's gRPC transport between replicas instead of Ray actor calls (`_by_reference=False`).

    Measured on the 2-core box: ~10 ms less dead time per batch cycle of 8 closed-loop clients (the model idle while
    responses leave and the next requests arrive). The option lives on the handle the controller built, so it is set
    here rather than by environment. Local testing mode's handles have no such option and are returned as they are.
    """
    try:
        return handle.options(_by_reference=False)
    except TypeError:
        return handle


class IngressDeployment:
    """Plain class; `build_app` wraps it with `serve.ingress()` (the ASGI app is built per replica)."""

    def __init__(self, preprocess: Any, policy: Any, postprocess: Any, args: dict):
        self.cfg = parse_app_args(args)
        self.preprocess, self.policy, self.postprocess = (_over_grpc(h) for h in (preprocess, policy, postprocess))
        self.embodiment = load_embodiment(self.cfg.embodiment, self.cfg.metadata_path, self.cfg.model_path)
        self.key_map = openpi_key_map(self.embodiment)
        self.api_key = self.cfg.resolved_api_key
        self.metrics = serving_metrics()
        self._policy_info: dict | None = None
        self._open_ws = 0

    # ------------------------------------------------------------------------------------------------------------
    # 1. The graph (shared by HTTP and WebSocket)
    # ------------------------------------------------------------------------------------------------------------
    async def run_graph(self, req: generations.GenerationRequest) -> GraphReply:
        timeout = self.cfg.http.request_timeout_s
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        ctx = None
        if req.form == "raw":
            batch, ctx = await _bounded(self.preprocess.run.remote(req), timeout)
            timings["preprocess"] = (time.perf_counter() - t0) * 1000.0
        else:
            batch = ModelBatch.from_normalised(req)
        t1 = time.perf_counter()
        out = await _bounded(sticky_call(self.policy, "generate", req.route_key, batch), timeout)
        timings["policy"] = (time.perf_counter() - t1) * 1000.0
        actions = out.result.actions
        if req.form == "raw":
            t2 = time.perf_counter()
            actions = await _bounded(self.postprocess.run.remote(actions, ctx), timeout)
            timings["postprocess"] = (time.perf_counter() - t2) * 1000.0
        timings["graph"] = (time.perf_counter() - t0) * 1000.0
        timings.update({f"model.{k}": float(v) for k, v in out.result.timings_ms.items()})
        actions = np.asarray(actions, dtype=np.float32)
        return GraphReply(actions, list(out.result.sessions), timings, out.replica, out.batch_requests)

    async def generate(self, body: bytes, content_type: str | None) -> tuple[int, dict[str, str], bytes]:
        """Decode, run and encode one generations request; returns (status, headers, body). Never raises."""
        t0 = time.perf_counter()
        flavour = codec.JSON
        form = "unknown"
        try:
            flavour = codec.flavour_for_content_type(content_type)  # errors too answer in the client's codec
            obj, flavour = codec.decode_body(body, content_type)
            req = generations.parse_generation_request(obj, flavour, max_batch=self.cfg.sessions.max_sessions)
            form = req.form
            t_decode = (time.perf_counter() - t0) * 1000.0
            reply = await self.run_graph(req)
            timings = {"decode": t_decode, **reply.timings_ms}
            timings["ingress_total"] = (time.perf_counter() - t0) * 1000.0
            resp = replies.build_response(req, reply.actions, reply.sessions, timings)
            resp["served_by"] = reply.replica
            resp["batch_requests"] = reply.batch_requests
            payload, ctype = codec.encode_body(resp, req.flavour)
            self.metrics.observe_stages(timings)
            status, headers = 200, {"content-type": ctype}
        except Exception as exc:  # noqa: BLE001 - every failure becomes a mapped reply, never a traceback
            reply_err = classify(exc, self.cfg.http.retry_after_s)
            # error bodies follow the request's codec when it could be read (msgpack clients decode msgpack)
            payload, ctype = codec.encode_body(reply_err.body(), flavour)
            status, headers = reply_err.status, {"content-type": ctype, **reply_err.headers()}
        self.metrics.requests.inc(1, tags={"route": routes.GENERATIONS_PATH, "status": str(status), "form": form})
        return status, headers, payload

    async def health(self) -> dict:
        """Ready when one replica of every deployment answers; raises NotReady otherwise."""
        states = {}
        for name, handle in (
            ("preprocess", self.preprocess),
            ("policy", self.policy),
            ("postprocess", self.postprocess),
        ):
            try:
                states[name] = bool(await _bounded(handle.ready.remote(), 5.0))
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                raise NotReady(f"deployment {name} cannot serve yet ({type(exc).__name__})") from None
            if not states[name]:
                raise NotReady(f"deployment {name} is not ready")
        return {"status": "ok", "deployments": states}

    async def policy_info(self) -> dict:
        if self._policy_info is None:
            self._policy_info = await _bounded(self.policy.info.remote(), 30.0)
        return self._policy_info

    async def metadata(self) -> dict:
        info = await self.policy_info()
        emb = self.embodiment
        return {
            "object": "action.metadata",
            "policy_family": "dreamzero",
            "model": self.cfg.model_name,
            "config": info["config_name"],
            "embodiment": self.cfg.embodiment,
            "action_horizon": info["action_horizon"],
            "action_dim": int(getattr(emb, "action_dim", info["max_action_dim"])),
            "padded_action_dim": info["max_action_dim"],
            "max_state_dim": info["max_state_dim"],
            "forms": list(generations.FORMS),
            "defaults": {
                "seed": info["default_seed"],
                "response_format": "envelope",
                "output_format": "numpy",
                "num_inference_steps": info["num_inference_steps"],
            },
            "openpi": await self.handshake(),
        }

    async def handshake(self) -> dict:
        info = await self.policy_info()
        cfg = dict(self.embodiment.openpi_server_config())
        cfg.setdefault("action_horizon", info["action_horizon"])
        cfg.setdefault("action_dim", int(getattr(self.embodiment, "action_dim", info["max_action_dim"])))
        return openpi.handshake_config(**cfg)

    # ------------------------------------------------------------------------------------------------------------
    # 2. Auth and limits
    # ------------------------------------------------------------------------------------------------------------
    def check_auth(self, authorization: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() not in ("bearer", "api-key") or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise Unauthorized("missing or wrong API key; send 'Authorization: Bearer <key>' or 'Api-Key <key>'")

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (before it is all in memory)."""
        limit = self.cfg.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    # ------------------------------------------------------------------------------------------------------------
    # 3. OpenPI WebSocket
    # ------------------------------------------------------------------------------------------------------------
    async def serve_websocket(self, ws: WebSocket) -> None:
        try:
            self.check_auth(ws.headers.get("authorization"))
        except Unauthorized:
            await ws.close(code=WS_POLICY_VIOLATION, reason="missing or wrong API key")
            return
        await ws.accept()
        conn_id = uuid.uuid4().hex[:12]
        session: _WsSession | None = None
        self._open_ws += 1
        self.metrics.ws_connections.set(self._open_ws)
        try:
            await ws.send_bytes(openpi.pack_frame(await self.handshake()))
            while True:
                try:
                    message = await asyncio.wait_for(ws.receive(), self.cfg.http.ws_idle_timeout_s)
                except asyncio.TimeoutError:
                    await ws.close(code=WS_NORMAL, reason="idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("bytes")
                if data is None:
                    data = message.get("text")
                if data is not None and len(data) > self.cfg.http.ws_max_message_bytes:
                    err = PayloadTooLarge(f"message exceeds the limit of {self.cfg.http.ws_max_message_bytes} bytes")
                    await ws.send_bytes(openpi.pack_frame(ws_error_frame(err)))
                    await ws.close(code=WS_TOO_BIG, reason="message too big")
                    return
                reply, session = await self._ws_message(data, conn_id, session)
                await ws.send_bytes(reply)
        except WebSocketDisconnect:
            pass
        finally:
            self._open_ws -= 1
            self.metrics.ws_connections.set(self._open_ws)
            if session is not None:
                await self._drop_ws_session(session)
            if ws.application_state == WebSocketState.CONNECTED and ws.client_state == WebSocketState.CONNECTED:
                try:
                    await ws.close(code=WS_NORMAL)
                except Exception:  # noqa: BLE001 - the peer may already be gone
                    pass

    async def _ws_message(
        self, data: bytes | str | None, conn_id: str, session: _WsSession | None
    ) -> tuple[bytes, _WsSession | None]:
        """Handle one frame; errors become an error frame and the socket stays open."""
        flavour = codec.OPENPI
        try:
            if data is None:
                raise InvalidRequest("empty frame; send a binary msgpack map")
            msg, flavour = openpi.unpack_frame(data)
            req = openpi.parse_openpi_request(msg, flavour)
            if session is None or session.session_id != req.session_id:
                if session is not None:
                    await self._drop_ws_session(session)  # a new session id restarts: free the old state
                session = _WsSession(req.session_id, ws_session_id(conn_id, req.session_id))
            if req.endpoint == "reset":
                session.buffers.clear()
                session.reset_next, session.last_step, session.last_incarnation = True, None, None
                return openpi.pack_frame(openpi.OPENPI_RESET_REPLY, flavour), session
            gen = self._openpi_to_request(req, session)
            reply = await self.run_graph(gen)
            report = reply.sessions[0]
            session.last_step, session.last_incarnation, session.reset_next = report.step, report.incarnation, False
            extra = {"session": report.to_dict(), "timings": reply.timings_ms} if req.reply_as_dict else None
            return openpi.pack_frame(openpi.infer_reply(reply.actions[0], req.reply_as_dict, extra), flavour), session
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error frame
            return openpi.pack_frame(ws_error_frame(exc), flavour), session

    def _openpi_to_request(self, req: openpi.OpenPIRequest, session: _WsSession) -> generations.GenerationRequest:
        """OpenPI keys -> the embodiment's raw keys with a batch dim of 1; cameras go through the frame buffers."""
        obs: dict[str, np.ndarray] = {}
        first_call = session.reset_next
        for key, value in req.observation.items():
            target = self.key_map.get(key)
            if target is None:
                continue  # e.g. observation/cartesian_position: sent by DROID clients, unused by the model
            if target.startswith("video."):
                obs[target] = self._buffer_frames(session, key, value, first_call)[None]
            else:
                obs[target] = np.asarray(value)[None]
        missing = [k for k, t in self.key_map.items() if t not in obs]
        if missing:
            raise InvalidObservation(
                f"'{missing[0]}' is required for infer (OpenPI keys: {list(self.key_map)})", missing[0]
            )
        return generations.GenerationRequest(
            prompts=[req.prompt or ""],
            observation=obs,
            session_ids=[session.model_id],
            form="raw",
            reset_mask=[first_call],
            seeds=None if req.seed is None else [req.seed],
            expected_steps=None if first_call else [session.last_step],
            expected_incarnations=None if first_call else [session.last_incarnation],
            routing_key=session.model_id,
            flavour=req.flavour,
        )

    @staticmethod
    def _buffer_frames(session: _WsSession, key: str, value: np.ndarray, first_call: bool) -> np.ndarray:
        """[H,W,3] or [T,H,W,3] -> the frames the model sees: 1 on a session's first call, else the last 4.

        A 4-frame stack is used as sent. Short histories repeat their oldest frame (as the reference server does).
        """
        frames = np.asarray(value)
        if frames.ndim == 3:
            frames = frames[None]
        if frames.ndim != 4:
            raise InvalidObservation(f"'{key}' must be (H, W, 3) or (T, H, W, 3), got {list(frames.shape)}", key)
        buf = session.buffers.get(key)
        if buf is None or (buf and buf[-1].shape != frames.shape[1:]):
            buf = session.buffers[key] = deque(maxlen=WS_STACK_FRAMES)
        buf.extend(frames)
        if frames.shape[0] == WS_STACK_FRAMES:
            return frames
        if first_call:
            return frames[-1:]
        history = list(buf)
        history = [history[0]] * (WS_STACK_FRAMES - len(history)) + history
        return np.stack(history)

    async def _drop_ws_session(self, session: _WsSession) -> None:
        try:
            await _bounded(sticky_call(self.policy, "drop_sessions", session.model_id, [session.model_id]), 10.0)
        except Exception as exc:  # noqa: BLE001 - the replica may be gone; its store evicts the session anyway
            log.warning("could not drop session %s: %s", session.model_id, type(exc).__name__)

    # ------------------------------------------------------------------------------------------------------------
    # 4. The ASGI app (Serve calls this once per replica, after __init__)
    # ------------------------------------------------------------------------------------------------------------
    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self)


def build_fastapi_app(ingress: IngressDeployment) -> FastAPI:
    app = FastAPI(title="DreamZero policy server", docs_url=None, redoc_url=None, openapi_url=None)
    retry_after = ingress.cfg.http.retry_after_s

    @app.post(routes.GENERATIONS_PATH)
    async def generations(request: Request) -> Response:
        try:
            ingress.check_auth(request.headers.get("authorization"))
            codec.flavour_for_content_type(request.headers.get("content-type"))  # 415 before reading the body
            body = await ingress.read_body(request)
        except Exception as exc:  # noqa: BLE001
            ingress.metrics.requests.inc(
                1, tags={"route": routes.GENERATIONS_PATH, "status": str(classify(exc).status), "form": "unknown"}
            )
            return http_error_response(exc, retry_after)
        status, headers, payload = await ingress.generate(body, request.headers.get("content-type"))
        return Response(payload, status_code=status, headers=headers)

    @app.get(routes.HEALTH_PATH)
    async def health() -> Response:
        try:
            return JSONResponse(await ingress.health())
        except Exception as exc:  # noqa: BLE001
            return http_error_response(exc, retry_after)

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})  # liveness of the front door (openpi's check)

    @app.get(routes.METADATA_PATH)
    async def metadata(request: Request) -> Response:
        try:
            ingress.check_auth(request.headers.get("authorization"))
            return JSONResponse(await ingress.metadata())
        except Exception as exc:  # noqa: BLE001
            return http_error_response(exc, retry_after)

    @app.get(routes.MODELS_PATH)
    async def models(request: Request) -> Response:
        try:
            ingress.check_auth(request.headers.get("authorization"))
            info = await ingress.policy_info()
        except Exception as exc:  # noqa: BLE001
            return http_error_response(exc, retry_after)
        entry = {
            "id": ingress.cfg.model_name,
            "object": "model",
            "owned_by": "dreamzero",
            "config": info["config_name"],
            "embodiment": ingress.cfg.embodiment,
            "action_horizon": info["action_horizon"],
        }
        return JSONResponse({"object": "list", "data": [entry]})

    @app.websocket(routes.OPENPI_WS_PATH)
    async def openpi_ws(websocket: WebSocket) -> None:
        await ingress.serve_websocket(websocket)

    @app.websocket("/")
    async def openpi_ws_root(websocket: WebSocket) -> None:
        await ingress.serve_websocket(websocket)

    return app
