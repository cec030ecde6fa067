"""A ZeroMQ client for the RLDX-1 front door (docs/zmq.md): the same REQ socket and messages as RLDX-1's
`PolicyClient`, with a bounded wait for every reply.

    client = ZmqPolicyClient("robot-host", 5555, api_token="...")
    client.ping()
    action, info = client.get_action(observation, {"session_ids": ["arm-0"]})
    client.reset({"session_ids": ["arm-0"]})

Needs the `zmq` extra (`pip install dreamzero-client[zmq]`).
"""

from __future__ import annotations

from typing import Any

from dreamzero_client.errors import AuthenticationError, BadRequestError, ReplyTimeout, ServerError
from dreamzero_client.wire import rldx


def _server_error(reply: dict) -> ServerError:
    """`{"error", "code", "status", "field"}` -> the client error class HTTP clients raise for the same status."""
    status = reply.get("status") if isinstance(reply.get("status"), int) else None
    cls = ServerError
    if status in (401, 403):
        cls = AuthenticationError
    elif status is not None and 400 <= status < 500:
        cls = BadRequestError
    return cls(str(reply["error"]), status, reply.get("code"), reply.get("field"), reply)


class ZmqPolicyClient:
    def __init__(
        self, host: str = "localhost", port: int = 5555, timeout_s: float = 30.0, api_token: str | None = None
    ):
        import zmq  # optional dependency: the `zmq` extra

        self._zmq = zmq
        self.endpoint = f"tcp://{host}:{port}"
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.api_token = api_token
        self.context = zmq.Context()
        self.socket = None
        self._connect()

    def _connect(self) -> None:
        zmq = self._zmq
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = self.context.socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        self.socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self.socket.connect(self.endpoint)

    def call(self, endpoint: str, data: dict | None = None) -> Any:
        request: dict[str, Any] = {"endpoint": endpoint}
        if data is not None:
            request["data"] = data
        if self.api_token:
            request["api_token"] = self.api_token
        try:
            self.socket.send(rldx.pack(request))
            reply = rldx.unpack(self.socket.recv())
        except self._zmq.Again:
            self._connect()  # a REQ socket that missed its reply cannot send again
            raise ReplyTimeout(f"no reply from {self.endpoint} within {self.timeout_ms} ms", attempts=1) from None
        if isinstance(reply, dict) and "error" in reply:
            raise _server_error(reply)
        return reply

    def ping(self) -> bool:
        try:
            return self.call("ping").get("status") == "ok"
        except ReplyTimeout:
            return False

    def get_action(self, observation: dict, options: dict | None = None) -> tuple[dict, dict]:
        action, info = self.call("get_action", {"observation": observation, "options": options})
        return action, info

    def reset(self, options: dict | None = None) -> dict:
        return self.call("reset", {"options": options})

    def get_modality_config(self) -> dict:
        return self.call("get_modality_config")

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None
        self.context.term()

    def __enter__(self) -> ZmqPolicyClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
