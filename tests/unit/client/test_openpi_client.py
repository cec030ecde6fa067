"""dreamzero_client.openpi_client against a small local fake OpenPI websockets server (127.0.0.1, stops itself)."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
from websockets.datastructures import Headers
from websockets.http11 import Response
from websockets.sync.server import serve

from dreamzero_client.errors import (
    AuthenticationError,
    PolicyServerError,
    ProtocolError,
    ReplyTimeout,
    ServerUnavailableError,
)
from dreamzero_client.openpi_client import OpenPIClient, build_uri
from dreamzero_client.wire import openpi
from tests.support.observations import openpi_droid_observation

ACTIONS = np.arange(24 * 8, dtype=np.float32).reshape(24, 8)
#: what DreamZero's server sends first (the six keys of openpi's PolicyServerConfig, then the extended ones)
HANDSHAKE = {
    "image_resolution": [180, 320], "needs_wrist_camera": True, "n_external_cameras": 2, "needs_stereo_camera": False,
    "needs_session_id": True, "action_space": "joint_position", "action_horizon": 24, "action_dim": 8,
}  # fmt: skip


class FakeOpenPIServer:
    """Sends the handshake, then answers each frame according to `mode` (changeable between calls).

    Modes: "array" (bare array, DreamZero's server), "dict" (openpi), "text" (openpi's traceback), "error" (vllm-omni
    error frame), "close_once" (close the socket on the next frame, then behave like "dict"), "silent" (never reply).
    """

    def __init__(self, mode: str = "dict", api_key: str | None = None):
        self.mode = mode
        self.api_key = api_key
        self.connections = 0
        self.received: list = []
        self.headers: list[Headers] = []
        self.paths: list[str] = []

        def process_request(conn, request):
            self.headers.append(request.headers)
            self.paths.append(request.path)
            if self.api_key and request.headers.get("Authorization") != f"Api-Key {self.api_key}":
                return Response(401, "Unauthorized", Headers([("Content-Length", "11")]), b"bad api key")
            return None

        def handler(ws):
            self.connections += 1
            extra = {"resume_token": "ab" * 16} if "handshake=extended" in ws.request.path else {}
            ws.send(openpi.pack_frame(dict(HANDSHAKE, connection=self.connections, **extra)))
            for raw in ws:
                msg, _ = openpi.unpack_frame(raw)
                self.received.append(msg)
                if msg.get("endpoint") == "reset":
                    if self.mode == "text":
                        ws.send("reset successful")
                    else:
                        ws.send(openpi.pack_frame({"status": "reset successful"}))
                    continue
                if self.mode == "close_once":
                    self.mode = "dict"
                    ws.close()
                    return
                if self.mode == "silent":
                    continue
                if self.mode == "array":
                    ws.send(openpi.pack_frame(ACTIONS))
                elif self.mode == "dict":
                    report = {"step": len(self.received), "incarnation": "inc-1"}
                    extra = {"server_ms": 3, "session": report}
                    ws.send(openpi.pack_frame({"actions": ACTIONS, **extra}))
                elif self.mode == "list":
                    ws.send(msgpack.packb(ACTIONS.tolist()))
                elif self.mode == "text":
                    ws.send("Traceback (most recent call last): boom")
                elif self.mode == "error":
                    ws.send(
                        openpi.pack_frame(
                            {"type": "error", "message": "Invalid request payload", "code": "invalid_request"}
                        )
                    )

        self._server = serve(handler, "127.0.0.1", 0, process_request=process_request, compression=None)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self):
        self._server.shutdown()
        self._thread.join(timeout=5)


@pytest.fixture
def server():
    s = FakeOpenPIServer()
    yield s
    s.stop()


def _obs(session_id: str | None = None):
    return openpi_droid_observation(session_id=session_id, prompt="put the marker in the cup")


def _client(server, **kw):
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("reconnect_backoff_s", 0.01)
    return OpenPIClient("127.0.0.1", server.port, **kw)


# 1. Handshake and replies -----------------------------------------------------------------------------------------


def test_handshake_and_dict_reply(server):
    with _client(server) as policy:
        meta = policy.get_server_metadata()
        assert meta["image_resolution"] == [180, 320] and meta["action_horizon"] == 24
        out = policy.infer(_obs(session_id="ep-1"))
    np.testing.assert_array_equal(out["actions"], ACTIONS)
    assert out["server_ms"] == 3
    sent = server.received[0]
    assert sent["session_id"] == "ep-1" and sent["observation/exterior_image_0_left"].shape == (180, 320, 3)


@pytest.mark.parametrize("mode", ["array", "list"])
def test_bare_array_reply_is_wrapped(server, mode):
    server.mode = mode
    with _client(server) as policy:
        out = policy.infer(_obs())
    assert set(out) == {"actions"} and out["actions"].shape == (24, 8)
    np.testing.assert_array_equal(out["actions"], ACTIONS)


def test_text_frame_raises_typed_error(server):
    server.mode = "text"
    with _client(server) as policy, pytest.raises(PolicyServerError, match="Traceback") as info:
        policy.infer(_obs())
    assert info.value.code == "text_frame"


def test_error_frame_raises_and_socket_stays_usable(server):
    server.mode = "error"
    with _client(server) as policy:
        with pytest.raises(PolicyServerError, match="Invalid request payload") as info:
            policy.infer(_obs())
        assert info.value.code == "invalid_request"
        server.mode = "dict"
        assert policy.infer(_obs())["actions"].shape == (24, 8)
        assert policy.reconnects == 0 and server.connections == 1


@pytest.mark.parametrize("mode", ["dict", "text"])
def test_reset_accepts_status_dict_and_text(server, mode):
    server.mode = mode
    with _client(server) as policy:
        assert policy.reset(session_id="ep-2") == {"status": "reset successful"}
    assert server.received[0] == {"endpoint": "reset", "session_id": "ep-2"}


# 2. Reconnects, timeouts, auth ------------------------------------------------------------------------------------


def test_reconnects_after_server_closes_and_rereads_handshake(server):
    with _client(server) as policy:
        assert policy.get_server_metadata()["connection"] == 1
        server.mode = "close_once"
        out = policy.infer(_obs())  # first send hits the closing socket; the client reconnects and resends
        assert out["actions"].shape == (24, 8)
        assert policy.reconnects == 1 and server.connections == 2
        assert policy.get_server_metadata()["connection"] == 2


def test_resume_reconnects_with_the_token_and_echoes_the_last_step(server):
    with _client(server, resume=True) as policy:
        assert policy.get_server_metadata()["resume_token"] == "ab" * 16
        policy.infer(_obs(session_id="arm"))
        server.mode = "close_once"
        policy.infer(_obs(session_id="arm"))  # the socket closes; the client reopens it with its token and resends
    assert server.paths[0] == "/?handshake=extended" and server.paths[1] == f"/?handshake=extended&resume={'ab' * 16}"
    first, lost, resent = server.received
    assert "expected_steps" not in first and first["response_format"] == "dict"
    assert lost["expected_steps"] == resent["expected_steps"] == [1] and resent["expected_incarnations"] == ["inc-1"]
    assert server.headers[0]["x-request-timeout-seconds"] == "0"  # Serve's proxy timeout never ends the socket


def test_a_plain_client_adds_no_query_and_no_echo(server):
    with _client(server) as policy:
        policy.infer(_obs())
        policy.infer(_obs())
    assert server.paths == ["/"] and "expected_steps" not in server.received[1]


def test_server_gone_raises_unavailable_after_bounded_reconnects():
    s = FakeOpenPIServer()
    policy = _client(s, max_reconnects=1, timeout_s=1.0)
    s.stop()
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailableError):
        policy.infer(_obs())
    assert time.monotonic() - t0 < 5.0
    policy.close()


def test_reply_timeout_drops_the_connection(server):
    server.mode = "silent"
    with _client(server, timeout_s=0.3) as policy:
        with pytest.raises(ReplyTimeout):
            policy.infer(_obs())
        server.mode = "dict"
        assert policy.infer(_obs())["actions"].shape == (24, 8)  # a fresh connection, not the late reply
        assert server.connections == 2


def test_api_key_header_and_rejection():
    s = FakeOpenPIServer(api_key="k1")
    try:
        with OpenPIClient("127.0.0.1", s.port, api_key="k1", timeout_s=5.0) as policy:
            assert policy.infer(_obs())["actions"].shape == (24, 8)
        assert s.headers[0]["Authorization"] == "Api-Key k1"
        with pytest.raises(AuthenticationError, match="bad api key"):
            OpenPIClient("127.0.0.1", s.port, api_key="wrong", timeout_s=5.0)
    finally:
        s.stop()


def test_connect_refused_is_bounded():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ServerUnavailableError, match="2 attempts"):
        OpenPIClient("127.0.0.1", port, timeout_s=1.0, max_reconnects=1, reconnect_backoff_s=0.01)


def test_non_protocol_reply_is_protocol_error(server):
    server.mode = "dict"
    with _client(server) as policy:
        policy._call = lambda msg: {"foo": 1}  # a server that answers something else entirely
        with pytest.raises(ProtocolError, match="actions"):
            policy.infer(_obs())


# 3. URIs -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,uri",
    [
        (("127.0.0.1", 8000), "ws://127.0.0.1:8000/"),
        (("localhost", None, "/v1/realtime/robot/openpi"), "ws://localhost/v1/realtime/robot/openpi"),
        (("ws://h:9/v1/realtime/robot/openpi",), "ws://h:9/v1/realtime/robot/openpi"),
        (("ws://h", 9), "ws://h:9/"),
        (("wss://h.example.com/x",), "wss://h.example.com/x"),
        (("::1", 8000), "ws://[::1]:8000/"),
    ],
)
def test_build_uri(args, uri):
    assert build_uri(*args) == uri


def test_build_uri_rejects_other_schemes():
    with pytest.raises(ValueError, match="ws://"):
        build_uri("ftp://h")


def test_loopback_bypasses_environment_proxy(server, monkeypatch):
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nobody listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with _client(server, max_reconnects=0) as policy:
        assert policy.infer(_obs())["actions"].shape == (24, 8)
