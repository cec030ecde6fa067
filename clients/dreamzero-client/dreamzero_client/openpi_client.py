"""OpenPI-style WebSocket policy client: works with our `/v1/realtime/robot/openpi` endpoint (and the server root),
DreamZero's own server, vllm-omni and openpi's `WebsocketPolicyServer`.

    with OpenPIClient("127.0.0.1", 8000) as policy:
        policy.get_server_metadata()    # the handshake: image resolution, cameras, action space, ...
        policy.infer({"observation/exterior_image_0_left": img, ..., "prompt": "...", "session_id": "ep-3"})["actions"]
        policy.reset()

Frames are binary msgpack with openpi's `__ndarray__` marker (`dreamzero_client.wire.openpi`). Reconnects,
`resume=True` (sessions continued across reconnects) and TLS: docs/clients.md ("WebSocket: `OpenPIClient`").
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from dreamzero_client import tls
from dreamzero_client.errors import (
    AuthenticationError,
    InvalidRequest,
    PolicyServerError,
    ProtocolError,
    QuotaExceededError,
    ReplyTimeout,
    ServerUnavailableError,
)
from dreamzero_client.wire import generations, openpi

log = logging.getLogger("dreamzero.clients.openpi")

MAX_MESSAGE_BYTES = 64 * 2**20  # same limit as the server side
#: Serve's per-request override of its proxy's `request_timeout_s` (non-positive: no bound): a WebSocket is one
#: request to the proxy, so without it the proxy ends the whole connection at that age
SERVE_TIMEOUT_HEADER = "x-request-timeout-seconds"


def with_query(uri: str, **params: str) -> str:
    """`uri` with `params` added to (or replacing those of) its query string."""
    parts = urlsplit(uri)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.update(params)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))


def build_uri(host: str, port: int | None = None, path: str = "/") -> str:
    """``ws://host[:port]/path``; a full ``ws://``/``wss://`` URL in `host` keeps its own path (openpi's rule)."""
    if "://" in host:
        parts = urlsplit(host)
        scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
        if scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"host must be a hostname or a ws:// / wss:// URL, got {host!r}")
        netloc = parts.netloc
        if port is not None and parts.port is None:
            netloc = f"{netloc}:{int(port)}"
        return urlunsplit((scheme, netloc, parts.path or path or "/", parts.query, ""))
    if not host:
        raise ValueError("host must not be empty")
    if host.count(":") > 1 and not host.startswith("["):  # bare IPv6 address
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{int(port)}"
    path = path if path.startswith("/") else f"/{path}"
    return f"ws://{netloc}{path}"


class OpenPIClient:
    """Synchronous OpenPI WebSocket client; connects (and reads the handshake) in the constructor, like openpi's."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        path: str = "/",
        api_key: str | None = None,
        timeout_s: float = 60.0,
        ping_interval_s: float | None = 20.0,
        max_reconnects: int = 3,
        reconnect_backoff_s: float = 0.5,
        resume: bool = False,
        response_format: str | None = None,
        ca_bundle: str | os.PathLike | None = None,
    ):
        """`resume`: continue sessions across reconnects; `response_format`: "dict" / "array" as the connection's
        default infer reply (both our server only). `ca_bundle`: PEM file of the CA(s) a wss:// server chains to."""
        if timeout_s <= 0 or max_reconnects < 0:
            raise ValueError("timeout_s must be > 0 and max_reconnects >= 0")
        if response_format not in (None, *openpi.RESPONSE_FORMATS):
            raise ValueError(f"response_format must be one of {openpi.RESPONSE_FORMATS} or None")
        self.uri = build_uri(host, port, path)
        scheme = urlsplit(self.uri).scheme
        tls.check_scheme(scheme, ca_bundle, "host")
        self._ssl = tls.client_context(ca_bundle) if scheme == "wss" else None
        if resume:
            self.uri = with_query(self.uri, **{openpi.QUERY_HANDSHAKE: "extended"})
        if response_format is not None:
            self.uri = with_query(self.uri, **{openpi.QUERY_RESPONSE_FORMAT: response_format})
        self.resume = bool(resume)
        self.resume_token: str | None = None
        self._continuity: dict[str, tuple[int, str | None]] = {}  # session id -> (step, incarnation) last seen
        self.timeout_s = float(timeout_s)
        self.ping_interval_s = ping_interval_s
        self.max_reconnects = int(max_reconnects)
        self.reconnect_backoff_s = float(reconnect_backoff_s)
        self._headers = {SERVE_TIMEOUT_HEADER: "0"}
        if api_key:
            self._headers["Authorization"] = f"Api-Key {api_key}"
        self._ws: ClientConnection | None = None
        self._metadata: dict = {}
        self.reconnects = 0  # connections reopened after the first
        self._connect_with_retries()

    def get_server_metadata(self) -> dict:
        """The handshake frame of the current connection (the policy server config)."""
        return dict(self._metadata)

    def infer(self, obs: dict, *, traffic_class: str | None = None, deadline_ms=None, observed_at=None) -> dict:
        """Send one observation; returns a dict that always holds "actions" (np.ndarray). The fleet's fields
        (docs/fleet.md) are sent only when given."""
        if not isinstance(obs, dict):
            raise TypeError(f"obs must be a dict, got {type(obs).__name__}")
        obs = {**obs, **generations.fleet_fields(traffic_class, deadline_ms, observed_at)}
        session_id = str(obs.get("session_id", openpi.OPENPI_DEFAULT_SESSION))
        if self.resume:
            obs = self._with_echo(obs, session_id)
        reply = self._call(obs)
        if self.resume and isinstance(reply, dict):
            self._remember(session_id, reply.get("session"))
        if isinstance(reply, str):
            raise PolicyServerError(reply.strip()[:4000] or "empty text frame", code="text_frame")
        if openpi.is_error_frame(reply):
            raise _error_from_frame(reply)
        if isinstance(reply, np.ndarray):
            return {"actions": reply}
        if isinstance(reply, dict) and "actions" in reply:
            out = dict(reply)
            out["actions"] = np.asarray(out["actions"])
            return out
        if isinstance(reply, list):
            return {"actions": np.asarray(reply)}
        raise ProtocolError(f"infer reply must be an array or a dict with 'actions', got {type(reply).__name__}")

    def reset(self, session_id: str | None = None) -> dict:
        """Ask the server to restart the connection's session(s); returns ``{"status": ...}``."""
        self._continuity.pop(session_id or openpi.OPENPI_DEFAULT_SESSION, None)
        msg: dict[str, Any] = {"endpoint": "reset"}
        if session_id is not None:
            msg["session_id"] = session_id
        reply = self._call(msg)
        if isinstance(reply, str):
            if "reset" in reply.lower() and "success" in reply.lower():  # DreamZero's server: "reset successful"
                return {"status": reply.strip()}
            raise PolicyServerError(reply.strip()[:4000] or "empty text frame", code="text_frame")
        if openpi.is_error_frame(reply):
            raise _error_from_frame(reply)
        if isinstance(reply, dict) and "status" in reply:
            return dict(reply)
        raise ProtocolError(f"reset reply must be {{'status': ...}} or a text frame, got {type(reply).__name__}")

    def close(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            finally:
                self._ws = None

    def __enter__(self) -> OpenPIClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _with_echo(self, obs: dict, session_id: str) -> dict:
        """The message with the session's last step and incarnation (unless the caller set them) and the dict form,
        which carries the session report the next echo comes from."""
        out = dict(obs)
        out.setdefault("response_format", "dict")
        last = self._continuity.get(session_id)
        if last is not None:
            out.setdefault("expected_steps", [last[0]])
            if last[1] is not None:
                out.setdefault("expected_incarnations", [last[1]])
        return out

    def _remember(self, session_id: str, report: Any) -> None:
        if isinstance(report, dict) and isinstance(report.get("step"), int):
            inc = report.get("incarnation")
            self._continuity[session_id] = (report["step"], inc if isinstance(inc, str) else None)

    def _connect_once(self) -> None:
        host = urlsplit(self.uri).hostname
        uri = self.uri
        if self.resume and self.resume_token:
            uri = with_query(uri, **{openpi.QUERY_RESUME: self.resume_token})
        ws = connect(
            uri,
            ssl=self._ssl,
            additional_headers=self._headers,
            open_timeout=self.timeout_s,
            ping_interval=self.ping_interval_s,
            ping_timeout=self.timeout_s if self.ping_interval_s else None,
            close_timeout=min(5.0, self.timeout_s),
            max_size=MAX_MESSAGE_BYTES,
            compression=None,  # frames are mostly images: deflate costs more than it saves (openpi does the same)
            proxy=None if tls.is_loopback(host) else True,
        )
        try:  # the handshake frame; anything else closes the connection
            first = ws.recv(timeout=self.timeout_s)
            if isinstance(first, str):
                raise PolicyServerError(f"server sent text instead of the handshake: {first[:2000]}", code="text_frame")
            try:
                metadata, _ = openpi.unpack_frame(first)
            except InvalidRequest as e:
                raise ProtocolError(f"unreadable handshake frame: {e}") from None
            if openpi.is_error_frame(metadata):
                raise _error_from_frame(metadata)
            if not isinstance(metadata, dict):
                raise ProtocolError(f"handshake must be a msgpack map, got {type(metadata).__name__}")
        except BaseException:
            ws.close()
            raise
        self._ws, self._metadata = ws, metadata
        token = metadata.get("resume_token")
        if self.resume and isinstance(token, str):
            self.resume_token = token

    def _connect_with_retries(self) -> None:
        last: Exception | None = None
        for attempt in range(self.max_reconnects + 1):
            try:
                self._connect_once()
                return
            except InvalidStatus as e:
                status = e.response.status_code
                if status in (401, 403):
                    raise AuthenticationError(_body_text(e), status, "unauthorized") from None
                last = e
            except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as e:
                parts = urlsplit(self.uri)
                secure = tls.secure_channel_error(e, f"{parts.scheme}://{parts.netloc}")
                if secure is not None:  # a certificate that does not verify: no reconnect can fix it
                    raise secure from e
                last = e
            if attempt < self.max_reconnects:
                delay = self.reconnect_backoff_s * (attempt + 1)
                log.warning("cannot connect to %s (%s); retry in %.1f s", self.uri, _describe(last), delay)
                time.sleep(delay)
        raise ServerUnavailableError(
            f"cannot connect to {self.uri} after {self.max_reconnects + 1} attempts: {_describe(last)}",
            attempts=self.max_reconnects + 1,
        )

    def _call(self, msg: dict) -> Any:
        """Send one frame and read one reply, reopening a closed connection; returns the decoded reply or text."""
        frame = openpi.pack_frame(msg)
        for attempt in range(self.max_reconnects + 1):
            if self._ws is None:
                self._connect_with_retries()
                self.reconnects += 1
            try:
                self._ws.send(frame)
                raw = self._ws.recv(timeout=self.timeout_s)
            except ConnectionClosed as e:
                self._ws = None
                if attempt == self.max_reconnects:
                    raise ServerUnavailableError(
                        f"connection to {self.uri} closed {attempt + 1} times: {_describe(e)}", attempts=attempt + 1
                    ) from None
                log.warning("connection to %s closed (%s); reconnecting", self.uri, _describe(e))
                continue
            except TimeoutError:
                # a late reply would be read as the answer to the next request: drop the connection instead
                self.close()
                raise ReplyTimeout(f"no reply from {self.uri} within {self.timeout_s:.1f} s", attempts=1) from None
            if isinstance(raw, str):
                return raw
            try:
                return openpi.unpack_frame(raw)[0]
            except InvalidRequest as e:
                raise ProtocolError(f"unreadable reply frame: {e}") from None
        raise AssertionError("unreachable")


def _error_from_frame(frame: dict) -> PolicyServerError | QuotaExceededError:
    message, status = str(frame.get("message", "error")), frame.get("status")
    code, fld = frame.get("code"), frame.get("field")
    if status == 429:  # the key's tenant is over a quota; `retry_after_s` as the server said
        wait = frame.get("retry_after_s")
        return QuotaExceededError(message, 429, code, fld, frame, wait if isinstance(wait, (int, float)) else None)
    return PolicyServerError(message, status=status, code=code, field=fld)


def _body_text(e: InvalidStatus) -> str:
    body = e.response.body or b""
    return body.decode("utf-8", "replace").strip()[:2000] or f"HTTP {e.response.status_code}"


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "unknown error"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
