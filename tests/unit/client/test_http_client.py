"""dreamzero_client.http_client against a local fake action server with scripted failures (127.0.0.1, stops itself)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from dreamzero_client.errors import (
    AuthenticationError,
    BadRequestError,
    DreamZeroError,
    ProtocolError,
    ReadyTimeout,
    ServerUnavailableError,
)
from dreamzero_client.http_client import ActionClient, is_loopback, parse_retry_after
from dreamzero_client.wire import codec, replies, routes

H, D = 4, 8


def _read_body(obj: dict) -> dict:
    """What the fake server needs of a request body, read the way a client writes it (`build_request_body`): no server
    parser, so these tests run with the robot's client package alone. A body it cannot read is the client's bug."""
    inp, params, runtime = obj["input"], obj.get("parameters", {}), obj.get("runtime", {})
    b = len(params["session_ids"])
    observation = inp["observation"]
    return {
        "session_ids": params["session_ids"],
        "reset_mask": params.get("reset_mask") or [False] * b,
        "expected_steps": params.get("expected_steps"),
        "form": inp.get("form") or ("normalised" if "images" in observation else "raw"),
        "response_format": runtime.get("response_format", "envelope"),
        "output_format": runtime.get("output_format", "numpy"),
    }


def _reply(req: dict, actions: np.ndarray, sessions: list[dict], timings: dict) -> dict:
    """A 200 reply as the server writes it (docs/wire-protocol.md): the sglang envelope or the raw form."""
    values = actions if req["output_format"] == "numpy" else actions.tolist()
    extras = {"sessions": sessions, "timings": timings, "form": req["form"]}
    if req["response_format"] == "raw":
        params = {"session_ids": req["session_ids"], "reset_mask": req["reset_mask"]}
        return {"request_id": "req-1", "actions": values, "parameters": params, **extras}
    b, h, d = actions.shape
    action = {"type": "continuous", "dtype": "float32", "shape": [b, h, d], "values": values}
    return {"id": "gen-1", "object": "action.generation", "created": 0, "model": "dreamzero", **extras,
            "data": [{"index": 0, "input_index": 0, "candidate_index": 0, "action": action}]}  # fmt: skip


class FakeActionServer:
    """A tiny sglang-like action server: the real codec, per-session steps, and a script of failures.

    `script` holds replies to hand out before behaving normally: (status, headers, body_dict) or ("sleep", seconds).
    `check(decoded_body, flavour)`, when set, runs first and may raise a `DreamZeroError` (a 422 naming its field).
    """

    def __init__(self, check=None):
        self.check = check
        self.script: list = []
        self.requests: list[dict] = []
        self.steps: dict[str, int] = {}
        self.health_script: list[int] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, status, body, headers=None, flavour=codec.JSON):
                data, ctype = codec.encode_body(body, flavour)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append({"path": self.path, "headers": dict(self.headers)})
                if self.path == routes.HEALTH_PATH:
                    status = fake.health_script.pop(0) if fake.health_script else 200
                    self._send(status, {"status": "ok" if status == 200 else "loading"})
                elif self.path == routes.METADATA_PATH:
                    self._send(200, {"policy": "dreamzero", "action_horizon": H, "action_dim": D})
                elif self.path == routes.MODELS_PATH:
                    self._send(200, {"object": "list", "data": [{"id": "dreamzero"}]})
                else:
                    self._send(404, replies.error_body("not_found", f"no route {self.path}"))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if fake.script:
                    step = fake.script.pop(0)
                    if step[0] == "sleep":
                        time.sleep(step[1])
                    else:
                        status, headers, reply = step
                        return self._send(status, reply, headers)
                try:
                    obj, flavour = codec.decode_body(body, self.headers.get("Content-Type"))
                    if fake.check is not None:
                        fake.check(obj, flavour)
                except DreamZeroError as e:
                    return self._send(422, replies.error_body(e.code, str(e), getattr(e, "field", None)))
                req = _read_body(obj)
                b = len(req["session_ids"])
                reports = [fake._advance(req, i) for i in range(b)]
                actions = np.arange(b * H * D, dtype=np.float32).reshape(b, H, D)
                self._send(200, _reply(req, actions, reports, {"denoise": 1.0}), flavour=flavour)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def _advance(self, req: dict, i: int) -> dict:
        sid = req["session_ids"][i]
        expected = req["expected_steps"][i] if req["expected_steps"] else None
        reason = None
        if sid not in self.steps:
            reason = "new_session"
        elif req["reset_mask"][i]:
            reason = "reset_requested"
        elif expected is not None and expected != self.steps[sid]:
            reason = "step_mismatch"
        self.steps[sid] = 1 if reason else self.steps[sid] + 1
        restarted = reason is not None
        return {"session_id": sid, "step": self.steps[sid], "restarted": restarted, "restart_reason": reason,
                "frame_position": 2, "incarnation": None}  # fmt: skip

    def posts(self) -> list[dict]:
        return [r for r in self.requests if "body" in r]

    def decoded(self, i: int) -> dict:
        r = self.posts()[i]
        return codec.decode_body(r["body"], r["headers"]["Content-Type"])[0]

    def stop(self):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def server():
    s = FakeActionServer()
    yield s
    s.stop()


def _obs(b=1):
    return {
        "video.exterior_image_1_left": np.zeros((b, 1, 4, 4, 3), np.uint8),
        "state.joint_position": np.ones((b, 1, 7)),
    }


def _client(server, **kw):
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("backoff_s", 0.01)
    return ActionClient(server.url, **kw)


# 1. Happy path and session bookkeeping -----------------------------------------------------------------------------


def test_generate_tracks_steps_and_resets(server):
    with _client(server, api_key="secret") as client:
        r1 = client.generate(_obs(2), "pick", ["a", "b"], seed=7)
        assert r1.actions.shape == (2, H, D) and r1.actions.dtype == np.float32
        assert [s["restart_reason"] for s in r1.sessions] == ["new_session"] * 2 and r1.timings == {"denoise": 1.0}
        assert r1.form == "raw"
        client.generate(_obs(2), "pick", ["a", "b"])
        client.reset_sessions("b")
        r3 = client.generate(_obs(2), "pick", ["a", "b"])
        assert client.session_steps == {"a": 3, "b": 1}
        assert r3.sessions[1]["restart_reason"] == "reset_requested"
    first, second, third = server.decoded(0), server.decoded(1), server.decoded(2)
    assert first["parameters"]["seed"] == 7 and "expected_steps" not in first["parameters"]
    assert second["parameters"]["expected_steps"] == [1, 1]
    assert third["parameters"]["expected_steps"] == [2, None] and third["parameters"]["reset_mask"] == [False, True]
    assert server.posts()[0]["headers"]["Authorization"] == "Bearer secret"
    assert server.posts()[0]["headers"]["Content-Type"] == "application/msgpack"


def test_json_mode_sends_and_reads_json(server):
    with _client(server, msgpack=False) as client:
        r = client.generate(_obs(), ["pick"], "x", reset=True, negative_prompts="blurry")
    assert r.actions.shape == (1, H, D)
    post = server.posts()[0]
    assert post["headers"]["Content-Type"] == "application/json"
    body = json.loads(post["body"])
    assert body["parameters"]["reset_mask"] == [True] and body["parameters"]["negative_prompts"] == ["blurry"]
    assert body["runtime"]["output_format"] == "list"


def test_metadata_models_health(server):
    with _client(server) as client:
        assert client.metadata()["action_horizon"] == H
        assert client.models()["data"][0]["id"] == "dreamzero"
        assert client.health() == {"status": "ok"}


def test_argument_errors_are_caught_before_sending(server):
    with _client(server) as client:
        with pytest.raises(ValueError, match="2 prompts for 1"):
            client.generate(_obs(), ["a", "b"], "x")
        with pytest.raises(ValueError, match="reset has 2"):
            client.generate(_obs(), "a", "x", reset=[True, False])
    assert server.posts() == []
    with pytest.raises(ValueError, match="base_url"):
        ActionClient("127.0.0.1:8000")


# 2. Retries, backoff, Retry-After, no retry on 4xx ----------------------------------------------------------------


def test_retries_5xx_then_succeeds(server):
    err = replies.error_body("no_capacity", "queue full")
    server.script = [(503, {"Retry-After": "0"}, err), (502, {}, err), (500, {}, err), (504, {}, err)]
    with _client(server) as client:
        r = client.generate(_obs(), "pick", "x")
    assert r.actions.shape == (1, H, D) and len(server.posts()) == 5


def test_backoff_is_linear(server):
    server.script = [(500, {}, {"detail": "boom"})] * 3
    with _client(server, backoff_s=0.1) as client:
        t0 = time.monotonic()
        client.generate(_obs(), "pick", "x")
        elapsed = time.monotonic() - t0
    assert len(server.posts()) == 4
    assert 0.6 <= elapsed < 3.0  # 0.1 + 0.2 + 0.3


def test_retry_after_is_honoured(server):
    server.script = [(503, {"Retry-After": "1"}, replies.error_body("no_capacity", "full"))]
    with _client(server, backoff_s=0.0) as client:
        t0 = time.monotonic()
        client.generate(_obs(), "pick", "x")
        assert time.monotonic() - t0 >= 0.95


def test_retries_exhausted_raise_server_unavailable_with_message(server):
    server.script = [(503, {"Retry-After": "0"}, replies.error_body("not_ready", "model loading"))] * 10
    with _client(server, max_retries=2) as client, pytest.raises(ServerUnavailableError) as info:
        client.generate(_obs(), "pick", "x")
    assert info.value.attempts == 3 and info.value.status == 503 and info.value.server_message == "model loading"
    assert "model loading" in str(info.value) and len(server.posts()) == 3


@pytest.mark.parametrize("status", [400, 404, 413, 415, 422])
def test_4xx_is_not_retried_and_carries_server_message(server, status):
    body = replies.error_body("invalid_observation", "bad state shape", "input.observation.state")
    server.script = [(status, {}, body)]
    with _client(server) as client, pytest.raises(BadRequestError) as info:
        client.generate(_obs(), "pick", "x")
    e = info.value
    assert (e.status, e.code, e.field, e.message) == (
        status,
        "invalid_observation",
        "input.observation.state",
        "bad state shape",
    )
    assert len(server.posts()) == 1 and client.session_steps == {}


def test_401_is_authentication_error(server):
    server.script = [(401, {}, replies.error_body("unauthorized", "missing API key"))]
    with _client(server) as client, pytest.raises(AuthenticationError, match="missing API key"):
        client.generate(_obs(), "pick", "x")


def test_timeout_is_retried_then_reported(server):
    server.script = [("sleep", 0.6), ("sleep", 0.6)]
    with _client(server, timeout_s=0.2, max_retries=1) as client, pytest.raises(ServerUnavailableError) as info:
        t0 = time.monotonic()
        client.generate(_obs(), "pick", "x")
    assert "Timeout" in str(info.value) and time.monotonic() - t0 < 2.0 and info.value.status is None


def test_connection_refused_is_retried_then_reported():
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ActionClient(f"http://127.0.0.1:{port}", timeout_s=1.0, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(ServerUnavailableError, match="3 attempts.*Connect") as info:
            client.generate(_obs(), "pick", "x")
    assert info.value.attempts == 3


def test_non_protocol_reply_is_protocol_error(server):
    server.script = [(200, {}, {"hello": "world"})]
    with _client(server) as client, pytest.raises(ProtocolError, match="neither 'data' nor 'actions'"):
        client.generate(_obs(), "pick", "x")


# 3. Readiness, proxies, helpers ------------------------------------------------------------------------------------


def test_wait_until_ready_polls_until_200(server):
    server.health_script = [503, 503]
    with _client(server) as client:
        assert client.wait_until_ready(timeout_s=5.0, poll_interval_s=0.01) == {"status": "ok"}
    assert len([r for r in server.requests if r["path"] == "/health"]) == 3


def test_wait_until_ready_is_bounded(server):
    server.health_script = [503] * 1000
    with _client(server) as client, pytest.raises(ReadyTimeout, match="not ready after 0.3") as info:
        t0 = time.monotonic()
        client.wait_until_ready(timeout_s=0.3, poll_interval_s=0.05)
    assert time.monotonic() - t0 < 1.5 and isinstance(info.value, TimeoutError)


def test_loopback_bypasses_environment_proxy(server, monkeypatch):
    # a proxy nobody listens on: a client that used it for 127.0.0.1 would fail to connect
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with _client(server, max_retries=0) as client:
        assert client.generate(_obs(), "pick", "x").actions.shape == (1, H, D)


def test_helpers():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


def test_clients_import_neither_torch_nor_ray():
    code = (
        "import sys, dreamzero_client.http_client, dreamzero_client.openpi_client, dreamzero_client.errors\n"
        "import dreamzero_client.wire.codec, dreamzero_client.wire.openpi, dreamzero_client.wire.replies\n"
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
