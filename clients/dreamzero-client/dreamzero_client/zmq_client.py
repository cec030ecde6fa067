"""A ZeroMQ client for the RLDX-1 front door (docs/zmq.md): the same REQ socket and messages as RLDX-1's
`PolicyClient`, with a bounded wait for every reply.

    client = ZmqPolicyClient("robot-host", 5555, api_token="...")
    client.ping()
    action, info = client.get_action(observation, {"session_ids": ["arm-0"]})
    client.reset({"session_ids": ["arm-0"]})

    # a door with CURVE (docs/zmq.md, "Encryption: CURVE"): the server's public key, and this robot's own key pair
    # when the server lets in only the keys it lists
    client = ZmqPolicyClient("robot-host", 5555, server_key="keys/server.key", client_key_file="keys/robot.key_secret")

A socket monitor watches the handshake: a server that refuses this client's CURVE key, or speaks another security
mechanism, or closes every handshake, raises `SecureChannelError` at once instead of a silent wait. Needs `zmq`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from dreamzero_client import zmq_keys
from dreamzero_client.errors import (
    AuthenticationError,
    BadRequestError,
    ConfigError,
    MissingDependency,
    QuotaExceededError,
    ReplyTimeout,
    SecureChannelError,
    ServerError,
)
from dreamzero_client.wire import generations, rldx

#: handshakes closed in a row (~0.1 s apart; a CURVE server that resets a plain client, or cannot read its hello)
CLOSED_HANDSHAKES = 10


def _server_error(reply: dict) -> ServerError:
    """`{"error", "code", "status", "field"}` -> the client error class HTTP clients raise for the same status."""
    status = reply.get("status") if isinstance(reply.get("status"), int) else None
    if status == 429:  # the token's tenant is over a quota; `retry_after_s` as the server said
        wait = reply.get("retry_after_s") if isinstance(reply.get("retry_after_s"), (int, float)) else None
        return QuotaExceededError(str(reply["error"]), status, reply.get("code"), reply.get("field"), reply, wait)
    cls = (
        AuthenticationError if status in (401, 403) else BadRequestError if 400 <= (status or 0) < 500 else ServerError
    )
    return cls(str(reply["error"]), status, reply.get("code"), reply.get("field"), reply)


class ZmqPolicyClient:
    """`server_key`: the server's CURVE public key (Z85 text, or the path of its `.key` certificate); None: plain TCP.
    `client_key_file`: this client's `.key_secret` certificate, for a server that lets in only listed keys (default:
    a fresh key pair per client)."""

    def __init__(
        self,
        host: str = "localhost",
        port: int = 5555,
        timeout_s: float = 30.0,
        api_token: str | None = None,
        server_key: str | bytes | os.PathLike | None = None,
        client_key_file: str | os.PathLike | None = None,
    ):
        try:
            import zmq  # optional dependency: the `zmq` extra
        except ImportError as exc:  # name the extra, not just the module
            raise MissingDependency(
                f"ZmqPolicyClient needs pyzmq ({exc}): pip install 'dreamzero-client[zmq]'"
            ) from exc

        self._zmq = zmq
        self.endpoint = f"tcp://{host}:{port}"
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.api_token = api_token
        self._curve: tuple[bytes, bytes, bytes] | None = None  # (server public, own public, own secret)
        if server_key is not None:
            public, secret = (
                zmq_keys.read_secret_key(client_key_file, "client_key_file")
                if client_key_file is not None
                else zmq.curve_keypair()
            )
            self._curve = (zmq_keys.read_public_key(server_key, "server_key"), public, secret)
        elif client_key_file is not None:
            raise ConfigError("client_key_file: CURVE needs the server's public key too (server_key)")
        self.context = zmq.Context()
        self.socket = self.monitor = None
        self._connect()

    def _connect(self) -> None:
        zmq = self._zmq
        self._close_socket()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        self.socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        if self._curve is not None:
            self.socket.curve_serverkey, self.socket.curve_publickey, self.socket.curve_secretkey = self._curve
        handshake = (
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self.monitor = self.socket.get_monitor_socket(handshake)
        self._handshake_ok, self._closed = False, 0
        self.socket.connect(self.endpoint)

    def _close_socket(self) -> None:
        if self.socket is not None:
            self.socket.disable_monitor()
            self.socket.close(linger=0)
            self.socket = None
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None

    def call(self, endpoint: str, data: dict | None = None) -> Any:
        request: dict[str, Any] = {"endpoint": endpoint}
        if data is not None:
            request["data"] = data
        if self.api_token:
            request["api_token"] = self.api_token
        try:
            self.socket.send(rldx.pack(request))
        except self._zmq.Again:
            self._connect()  # a REQ socket that missed its reply cannot send again
            raise ReplyTimeout(f"could not send to {self.endpoint} within {self.timeout_ms} ms", attempts=1) from None
        reply = rldx.unpack(self._receive())
        if isinstance(reply, dict) and "error" in reply:
            raise _server_error(reply)
        return reply

    def _receive(self) -> bytes:
        """The reply, watching the handshake meanwhile; a refused one fails at once, silence after `timeout_s`."""
        zmq = self._zmq
        deadline = time.monotonic() + self.timeout_ms / 1000
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            ready = dict(poller.poll(left_ms))
            if self.monitor in ready and (refused := self._handshake_failure()) is not None:
                self._connect()
                raise refused
            if self.socket in ready:
                return self.socket.recv()
        refused = self._closed_error() if self._closed and not self._handshake_ok else None
        self._connect()  # a REQ socket that missed its reply cannot send again
        if refused is not None:
            raise refused
        raise ReplyTimeout(f"no reply from {self.endpoint} within {self.timeout_ms} ms", attempts=1)

    def _handshake_failure(self) -> SecureChannelError | None:
        """Read the monitor's events; the SecureChannelError of a refused handshake, if one was reported."""
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_ok = True
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._closed += 1
                if self._closed >= CLOSED_HANDSHAKES and not self._handshake_ok:
                    return self._closed_error()
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return SecureChannelError(
                    f"ZeroMQ CURVE: {self.endpoint} refused this client's key (ZAP status {value}): the server "
                    "lets in only the public keys in its zmq.curve.client_keys",
                    f"ZAP status {value}",
                )
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    need = "does not use CURVE" if self._curve is not None else "requires CURVE: pass server_key"
                    return SecureChannelError(
                        f"ZeroMQ: the security handshake with {self.endpoint} failed: the server {need}",
                        "mechanism mismatch",
                    )
                return SecureChannelError(
                    f"ZeroMQ: the security handshake with {self.endpoint} failed (protocol error {value:#x})",
                    f"protocol error {value:#x}",
                )
        return None

    def _closed_error(self) -> SecureChannelError:
        why = ("is server_key the server's public key, and does the server use CURVE?", "does the server require CURVE"
               " (pass server_key), and is it a ZeroMQ server?")[self._curve is None]  # fmt: skip
        n = f"{self._closed} in a row, none completed"
        return SecureChannelError(f"ZeroMQ: {self.endpoint} closed every handshake ({n}): {why}", "handshake closed")

    def ping(self) -> bool:
        try:
            return self.call("ping").get("status") == "ok"
        except ReplyTimeout:
            return False

    def get_action(
        self, observation: dict, options: dict | None = None, *, traffic_class=None, deadline_ms=None, observed_at=None
    ) -> tuple[dict, dict]:
        """The fleet's fields (docs/fleet.md) go into `options` when given."""
        if fleet := generations.fleet_fields(traffic_class, deadline_ms, observed_at):
            options = {**(options or {}), **fleet}
        action, info = self.call("get_action", {"observation": observation, "options": options})
        return action, info

    def reset(self, options: dict | None = None) -> dict:
        return self.call("reset", {"options": options})

    def get_modality_config(self) -> dict:
        return self.call("get_modality_config")

    def close(self) -> None:
        self._close_socket()
        self.context.term()

    def __enter__(self) -> ZmqPolicyClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
