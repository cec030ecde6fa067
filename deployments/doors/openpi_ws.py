"""The OpenPI WebSocket door: handshake, frames -> raw-form requests through the graph runner -> reply frames.

One `OpenPISocketServer` per ingress replica serves every connection (mounted on the HTTP door's app). Sessions are
per connection (their ids are namespaced by a connection id), camera frames are buffered per session, and the door
remembers each session's last step and incarnation and sends them back with the next request, as an HTTP client
does, so stale state left on a replica is never reused silently. A client that asked for the extended handshake gets
its connection id as a resume token: a later connection presenting it continues the same sessions (their state stays
on the replica, evicted by the session TTL, instead of being dropped at close). Protocol: docs/wire-protocol.md,
"OpenPI WebSocket".

The key presented at the handshake names the connection's tenant; every session of the connection runs as that
tenant's (the graph runner scopes its ids), so a resume token only ever reaches the sessions of the tenant that
used it: another tenant presenting it gets sessions of its own.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from deployments.auth import ConnectionSlots, caller_of, tenant_from_header
from deployments.config.settings import IngressSettings
from deployments.doors import Door, register_door
from deployments.error_replies import ws_error_frame
from deployments.graph_runner import GraphRunner
from deployments.preprocess import openpi_key_map
from deployments.requests import openpi as frames
from deployments.requests.generations import GenerationRequest
from deployments.requests.limits import decode_in_worker, request_limits
from deployments.requests.openpi import OpenPIRequest, parse_openpi_request
from deployments.routing import ws_session_id
from deployments.tenants import DEFAULT_TENANT, UNAUTHENTICATED, TenantKeys
from dreamzero.errors import InvalidObservation, InvalidRequest, PayloadTooLarge, QuotaExceeded, Unauthorized
from dreamzero_client.wire import codec, openpi, routes

log = logging.getLogger("dreamzero.serve.openpi")

#: frames the model sees per camera after a session's first call (clients send one frame every 8 control steps)
WS_STACK_FRAMES = 4
#: close codes (RFC 6455; 1013: try again later)
WS_NORMAL, WS_POLICY_VIOLATION, WS_TOO_BIG, WS_TRY_LATER = 1000, 1008, 1009, 1013
#: open WebSockets per replica when the settings leave `http.ws_max_total` unset (the args settle it: half the slots)
DEFAULT_WS_MAX_TOTAL = 32
#: a resume token is a connection id: 32 hex digits (uuid4), not guessable
_TOKEN = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class ConnectionOptions:
    """What a client asked for in the URL's query string (all opt-in; docs/wire-protocol.md 7)."""

    extended_handshake: bool = False
    default_dict: bool = False
    resume_token: str | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> ConnectionOptions:
        """Raises InvalidObservation naming the bad parameter."""
        handshake = query.get(openpi.QUERY_HANDSHAKE, "plain")
        if handshake not in frames.HANDSHAKE_FORMATS:
            raise InvalidObservation(
                f"query parameter 'handshake' must be one of {list(frames.HANDSHAKE_FORMATS)}, got {handshake[:64]!r}",
                field=openpi.QUERY_HANDSHAKE,
            )
        fmt = query.get(openpi.QUERY_RESPONSE_FORMAT, "array")
        if fmt not in openpi.RESPONSE_FORMATS:
            raise InvalidObservation(
                f"query parameter 'response_format' must be one of {list(openpi.RESPONSE_FORMATS)}, got {fmt[:64]!r}",
                field=openpi.QUERY_RESPONSE_FORMAT,
            )
        token = query.get(openpi.QUERY_RESUME)
        if token is not None and not _TOKEN.match(token):
            raise InvalidObservation(
                "query parameter 'resume' must be the resume_token of an earlier connection's extended handshake",
                field=openpi.QUERY_RESUME,
            )
        return cls(handshake == "extended", fmt == "dict", token)


@dataclass
class WsSession:
    """One OpenPI session of one connection: its namespaced id, frame buffers and the state it last continued."""

    session_id: str  # as the client named it
    model_id: str  # namespaced by connection
    buffers: dict[str, deque] = field(default_factory=dict)
    last_step: int | None = None
    last_incarnation: str | None = None
    reset_next: bool = True  # the first infer of a session starts it fresh (not on a resumed connection)

    def restart(self) -> None:
        self.buffers.clear()
        self.reset_next, self.last_step, self.last_incarnation = True, None, None


def buffer_frames(session: WsSession, key: str, value: np.ndarray, first_call: bool) -> np.ndarray:
    """[H,W,3] or [T,H,W,3] -> the frames the model sees: 1 on a session's first call, else the last 4.

    A 4-frame stack is used as sent. Short histories repeat their oldest frame (as the reference server does).
    """
    frames = np.asarray(value)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[0] == 0:  # an empty stack would leave nothing to repeat below
        raise InvalidObservation(
            f"'{key}' must be (H, W, 3) or (T, H, W, 3) with T >= 1, got {list(frames.shape)}", key
        )
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


def to_generation_request(req: OpenPIRequest, session: WsSession, key_map: Mapping[str, str]) -> GenerationRequest:
    """OpenPI keys -> the embodiment's raw keys with a batch dim of 1 (cameras through the frame buffers), plus the
    session's continuity (the step and incarnation of its last reply: echoed by the client when it sends them, else
    what this socket saw) and real-time chunking options."""
    obs: dict[str, np.ndarray] = {}
    first_call = session.reset_next
    for key, value in req.observation.items():
        target = key_map.get(key)
        if target is None:
            continue  # e.g. observation/cartesian_position: sent by DROID clients, unused by the model
        if target.startswith("video."):
            obs[target] = buffer_frames(session, key, value, first_call)[None]
        else:
            obs[target] = np.asarray(value)[None]
    missing = [k for k, t in key_map.items() if t not in obs]
    if missing:
        raise InvalidObservation(f"'{missing[0]}' is required for infer (OpenPI keys: {list(key_map)})", missing[0])
    rows = req.rows
    rows = rows.replace(
        session_ids=[session.model_id],
        reset_mask=[first_call],
        expected_steps=None if first_call else [_echoed(rows.expected_steps, session.last_step)],
        expected_incarnations=None if first_call else [_echoed(rows.expected_incarnations, session.last_incarnation)],
    )
    return GenerationRequest(obs, rows, form="raw", routing_key=session.model_id, flavour=req.flavour)


def _echoed(client_rows: list | None, socket_value):
    """The client's echo of its one row when it sent one, else what this socket saw."""
    client_value = None if client_rows is None else client_rows[0]
    return socket_value if client_value is None else client_value


@register_door
class OpenPISocketServer(Door):
    """Serves OpenPI connections over the graph runner."""

    name = "openpi_ws"
    hosted = True

    def __init__(self, runner: GraphRunner, settings: IngressSettings, keys: TenantKeys | None = None):
        super().__init__(runner)
        self.limits = settings.http
        self.keys = keys or TenantKeys.from_settings(settings.auth)
        self.model_name = settings.model_name
        self.key_map: dict[str, str] = openpi_key_map(runner.embodiment)
        self.open_connections = 0
        h = settings.http
        # one row per message; the frames of that row may come as nested lists, as the HTTP door allows
        self.decode_limits = request_limits(max_rows=1, max_bytes=h.ws_max_message_bytes)
        total = h.ws_max_total or DEFAULT_WS_MAX_TOTAL
        self.slots = ConnectionSlots("open WebSockets", h.ws_max_per_tenant, "ws_max_per_tenant", total, "ws_max_total")

    async def handshake(self, options: ConnectionOptions | None = None, token: str | None = None) -> dict:
        """The six reference keys; on `handshake=extended` also what else a client may want, and the resume token."""
        info = await self.runner.model_info()
        if options is None or not options.extended_handshake:
            return dict(info.openpi_handshake)
        return {
            **info.openpi_handshake,
            **info.openpi_extras,
            "embodiment": self.runner.embodiment.tag,
            "model": self.model_name,
            "config": info.config_name,
            "response_formats": list(openpi.RESPONSE_FORMATS),
            "resume_token": token,
        }

    async def drop_session(self, model_id: str, tenant: str = DEFAULT_TENANT) -> None:
        """Free a connection's session on its replica; a failure is only logged (the store evicts it anyway)."""
        try:
            await self.runner.drop_sessions(model_id, [model_id], tenant=tenant)
        except Exception as exc:  # noqa: BLE001 - the replica may be gone
            log.warning("could not drop session %s: %s", model_id, type(exc).__name__)

    async def serve(self, ws: WebSocket, reset_text: bool = False) -> None:
        """One connection: auth at the handshake, the config frame, then one reply per message until it ends.

        `reset_text`: answer reset with the text frame "reset successful" (DreamZero's server, at `/`) instead of
        msgpack ``{"status": "reset successful"}`` (vLLM-Omni's, at `/v1/realtime/robot/openpi`).
        """
        try:
            tenant = tenant_from_header(self.keys, ws.headers.get("authorization"))
        except Unauthorized:
            self.count(UNAUTHENTICATED, 401, Unauthorized.code, route=f"{self.name}/connect")
            await ws.close(code=WS_POLICY_VIOLATION, reason="missing or wrong API key")
            return
        await ws.accept()
        caller = caller_of(self.keys, tenant, ws.client.host if ws.client else None)
        try:
            self.slots.acquire(caller)
        except QuotaExceeded as err:  # the caller holds its share of the replica's slots already
            frame = openpi.pack_frame(ws_error_frame(err))
            self.count(tenant, 429, err.code, route=f"{self.name}/connect", sent=len(frame))
            await ws.send_bytes(frame)
            await ws.close(code=WS_TRY_LATER, reason=f"connection cap: http.{err.quota}")
            return
        try:
            await self._serve(ws, reset_text, tenant)
        finally:
            self.slots.release(caller)

    async def _serve(self, ws: WebSocket, reset_text: bool, tenant: str) -> None:
        try:
            options = ConnectionOptions.from_query(ws.query_params)
        except InvalidObservation as err:
            await ws.send_bytes(openpi.pack_frame(ws_error_frame(err)))
            await ws.close(code=WS_POLICY_VIOLATION, reason=str(err)[:120])
            return
        conn_id = options.resume_token or uuid.uuid4().hex
        resumable = options.extended_handshake or options.resume_token is not None
        session: WsSession | None = None
        self.open_connections += 1
        self.metrics.ws_connections.set(self.open_connections)
        loop = asyncio.get_running_loop()
        try:
            await ws.send_bytes(openpi.pack_frame(await self.handshake(options, conn_id)))
            last_valid = loop.time()  # only a valid message keeps the connection: junk frames do not
            while True:
                try:
                    left = self.limits.ws_idle_timeout_s - (loop.time() - last_valid)
                    if left <= 0:
                        raise asyncio.TimeoutError
                    message = await asyncio.wait_for(ws.receive(), left)
                except asyncio.TimeoutError:
                    await ws.close(code=WS_NORMAL, reason="idle timeout")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("bytes")
                if data is None:
                    data = message.get("text")
                if data is not None and len(data) > self.limits.ws_max_message_bytes:
                    err = PayloadTooLarge(f"message exceeds the limit of {self.limits.ws_max_message_bytes} bytes")
                    await ws.send_bytes(openpi.pack_frame(ws_error_frame(err)))
                    await ws.close(code=WS_TOO_BIG, reason="message too big")
                    return
                reply, session, valid = await self._message(data, conn_id, session, options, reset_text, tenant)
                if valid:
                    last_valid = loop.time()
                if isinstance(reply, str):
                    await ws.send_text(reply)
                else:
                    await ws.send_bytes(reply)
        except WebSocketDisconnect:
            pass
        finally:
            self.open_connections -= 1
            self.metrics.ws_connections.set(self.open_connections)
            if session is not None and not resumable:  # a resumable session waits for its client (or the TTL)
                await self.drop_session(session.model_id, tenant)
            if ws.application_state == WebSocketState.CONNECTED and ws.client_state == WebSocketState.CONNECTED:
                try:
                    await ws.close(code=WS_NORMAL)
                except Exception:  # noqa: BLE001 - the peer may already be gone
                    pass

    async def message(
        self,
        data: bytes | str | None,
        conn_id: str,
        session: WsSession | None,
        options: ConnectionOptions | None = None,
        reset_text: bool = False,
        tenant: str = DEFAULT_TENANT,
    ) -> tuple[bytes | str, WsSession | None]:
        """Handle one frame of a `tenant`'s connection -> (reply frame: bytes, or the reset text; the connection's
        session); errors become an error frame (the socket stays open)."""
        reply, session, _ = await self._message(data, conn_id, session, options, reset_text, tenant)
        return reply, session

    def _decode(self, data: bytes | str, default_dict: bool) -> OpenPIRequest:
        """A frame -> its request, within the door's decode limits (on a decoding thread when the frame is large)."""
        if isinstance(data, str):
            raise InvalidRequest("text frames are not part of the protocol; send binary msgpack frames")
        msg, flavour = codec.decode_msgpack(data, self.decode_limits)
        return parse_openpi_request(msg, flavour, default_dict)

    async def _message(
        self,
        data: bytes | str | None,
        conn_id: str,
        session: WsSession | None,
        options: ConnectionOptions | None = None,
        reset_text: bool = False,
        tenant: str = DEFAULT_TENANT,
    ) -> tuple[bytes | str, WsSession | None, bool]:
        """`message`, and whether the frame was valid (an error frame's does not keep the connection alive); each
        reply counted once (`Door.count`)."""
        state = {"endpoint": "unknown"}
        reply, session, valid, status, code = await self._answer(
            data, conn_id, session, options, reset_text, tenant, state
        )
        route = f"{self.name}/{state['endpoint']}"
        self.count(tenant, status, code, route=route, received=len(data or b""), sent=len(reply))
        return reply, session, valid

    async def _answer(
        self,
        data: bytes | str | None,
        conn_id: str,
        session: WsSession | None,
        options: ConnectionOptions | None,
        reset_text: bool,
        tenant: str,
        state: dict,
    ) -> tuple[bytes | str, WsSession | None, bool, int, str | None]:
        """-> (reply frame, the connection's session, whether the frame was valid, status, error code)."""
        options = options or ConnectionOptions()
        flavour = codec.OPENPI
        received_at = time.time()  # the row's deadline and the reply's server_ms count from here
        try:
            if data is None:
                raise InvalidRequest("empty frame; send a binary msgpack map")
            req = await decode_in_worker(len(data), self._decode, data, options.default_dict)
            req.rows.received_at = received_at
            flavour, state["endpoint"] = req.flavour, req.endpoint
            if session is None or session.session_id != req.session_id:
                if session is not None:
                    await self.drop_session(session.model_id, tenant)  # a new session id restarts: free the old state
                session = WsSession(req.session_id, ws_session_id(conn_id, req.session_id))
                if options.resume_token is not None:
                    session.reset_next = False  # continue what the earlier connection left on the replica
            if req.endpoint == "reset":
                session.restart()
                if reset_text:
                    return frames.RESET_TEXT, session, True, 200, None
                return openpi.pack_frame(frames.OPENPI_RESET_REPLY, flavour), session, True, 200, None
            request = to_generation_request(req, session, self.key_map)
            reply = await self.run(request, tenant)
            report = reply.sessions[0]
            session.last_step, session.last_incarnation, session.reset_next = report.step, report.incarnation, False
            echo = self.echo(reply, request)[0]  # counted always; sent in the dict form's session report
            extra = None
            as_dict = req.reply_as_dict or req.rows.return_video  # the frames need the dict form
            if as_dict:
                extra = {
                    "session": {**report.to_dict(), **echo},
                    "timings": reply.timings_ms,
                    "served_by": reply.replica,
                }
                if reply.video is not None:
                    extra["video"] = reply.video[0]  # uint8 [T, H, W, 3]
            frame = openpi.pack_frame(frames.infer_reply(reply.actions[0], as_dict, extra), flavour)
            return frame, session, True, 200, None
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error frame
            frame = ws_error_frame(exc)
            # a well-formed request the server could not answer (busy, over a quota) still shows a live client
            valid = frame["status"] >= 429
            return openpi.pack_frame(frame, flavour), session, valid, frame["status"], frame.get("code")

    def mount(self, app: FastAPI) -> None:
        """The OpenPI paths on the ingress's app: the vLLM-Omni path and the server root."""

        @app.websocket(routes.OPENPI_WS_PATH)
        async def openpi_ws(ws: WebSocket) -> None:
            await self.serve(ws)

        @app.websocket("/")  # openpi-client and DreamZero's own client connect to the server root
        async def openpi_ws_root(ws: WebSocket) -> None:
            await self.serve(ws, reset_text=True)  # DreamZero's server answers reset with text there
