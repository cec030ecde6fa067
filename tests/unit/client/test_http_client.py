"""dreamzero_client.http_client against a local fake action server with scripted failures (127.0.0.1, stops itself:
tests/support/action_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from dreamzero_client.errors import (
    AuthenticationError,
    BadRequestError,
    ProtocolError,
    ReadyTimeout,
    ServerUnavailableError,
)
from dreamzero_client.http_client import ActionClient, is_loopback, parse_retry_after
from dreamzero_client.wire import replies
from tests.support.action_server import D, FakeActionServer, H, action_client, small_observation


@pytest.fixture
def server():
    s = FakeActionServer()
    yield s
    s.stop()


# 1. Happy path and session bookkeeping -----------------------------------------------------------------------------


def test_generate_tracks_steps_and_resets(server):
    with action_client(server, api_key="secret") as client:
        r1 = client.generate(small_observation(2), "pick", ["a", "b"], seed=7)
        assert r1.actions.shape == (2, H, D) and r1.actions.dtype == np.float32
        assert [s["restart_reason"] for s in r1.sessions] == ["new_session"] * 2 and r1.timings == {"denoise": 1.0}
        assert r1.form == "raw"
        client.generate(small_observation(2), "pick", ["a", "b"])
        client.reset_sessions("b")
        r3 = client.generate(small_observation(2), "pick", ["a", "b"])
        assert client.session_steps == {"a": 3, "b": 1}
        assert r3.sessions[1]["restart_reason"] == "reset_requested"
    first, second, third = server.decoded(0), server.decoded(1), server.decoded(2)
    assert first["parameters"]["seed"] == 7 and "expected_steps" not in first["parameters"]
    assert second["parameters"]["expected_steps"] == [1, 1]
    assert third["parameters"]["expected_steps"] == [2, None] and third["parameters"]["reset_mask"] == [False, True]
    assert server.posts()[0]["headers"]["Authorization"] == "Bearer secret"
    assert server.posts()[0]["headers"]["Content-Type"] == "application/msgpack"


def test_json_mode_sends_and_reads_json(server):
    with action_client(server, msgpack=False) as client:
        r = client.generate(small_observation(), ["pick"], "x", reset=True, negative_prompts="blurry")
    assert r.actions.shape == (1, H, D)
    post = server.posts()[0]
    assert post["headers"]["Content-Type"] == "application/json"
    body = json.loads(post["body"])
    assert body["parameters"]["reset_mask"] == [True] and body["parameters"]["negative_prompts"] == ["blurry"]
    assert body["runtime"]["output_format"] == "list"


def test_metadata_models_health(server):
    with action_client(server) as client:
        assert client.metadata()["action_horizon"] == H
        assert client.models()["data"][0]["id"] == "dreamzero"
        assert client.health() == {"status": "ok"}


def test_argument_errors_are_caught_before_sending(server):
    with action_client(server) as client:
        with pytest.raises(ValueError, match="2 prompts for 1"):
            client.generate(small_observation(), ["a", "b"], "x")
        with pytest.raises(ValueError, match="reset has 2"):
            client.generate(small_observation(), "a", "x", reset=[True, False])
    assert server.posts() == []
    with pytest.raises(ValueError, match="base_url"):
        ActionClient("127.0.0.1:8000")


# 2. Retries, backoff, Retry-After, no retry on 4xx ----------------------------------------------------------------


def test_retries_5xx_then_succeeds(server):
    err = replies.error_body("no_capacity", "queue full")
    server.script = [(503, {"Retry-After": "0"}, err), (502, {}, err), (500, {}, err), (504, {}, err)]
    with action_client(server) as client:
        r = client.generate(small_observation(), "pick", "x")
    assert r.actions.shape == (1, H, D) and len(server.posts()) == 5


def test_backoff_is_linear(server):
    server.script = [(500, {}, {"detail": "boom"})] * 3
    with action_client(server, backoff_s=0.1) as client:
        t0 = time.monotonic()
        client.generate(small_observation(), "pick", "x")
        elapsed = time.monotonic() - t0
    assert len(server.posts()) == 4
    assert 0.6 <= elapsed < 3.0  # 0.1 + 0.2 + 0.3


def test_retry_after_is_honoured(server):
    server.script = [(503, {"Retry-After": "1"}, replies.error_body("no_capacity", "full"))]
    with action_client(server, backoff_s=0.0) as client:
        t0 = time.monotonic()
        client.generate(small_observation(), "pick", "x")
        assert time.monotonic() - t0 >= 0.95


def test_retries_exhausted_raise_server_unavailable_with_message(server):
    server.script = [(503, {"Retry-After": "0"}, replies.error_body("not_ready", "model loading"))] * 10
    with action_client(server, max_retries=2) as client, pytest.raises(ServerUnavailableError) as info:
        client.generate(small_observation(), "pick", "x")
    assert info.value.attempts == 3 and info.value.status == 503 and info.value.server_message == "model loading"
    assert "model loading" in str(info.value) and len(server.posts()) == 3


@pytest.mark.parametrize("status", [400, 404, 413, 415, 422])
def test_4xx_is_not_retried_and_carries_server_message(server, status):
    body = replies.error_body("invalid_observation", "bad state shape", "input.observation.state")
    server.script = [(status, {}, body)]
    with action_client(server) as client, pytest.raises(BadRequestError) as info:
        client.generate(small_observation(), "pick", "x")
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
    with action_client(server) as client, pytest.raises(AuthenticationError, match="missing API key"):
        client.generate(small_observation(), "pick", "x")


def test_timeout_is_retried_then_reported(server):
    server.script = [("sleep", 0.6), ("sleep", 0.6)]
    with action_client(server, timeout_s=0.2, max_retries=1) as client, pytest.raises(ServerUnavailableError) as info:
        t0 = time.monotonic()
        client.generate(small_observation(), "pick", "x")
    assert "Timeout" in str(info.value) and time.monotonic() - t0 < 2.0 and info.value.status is None


def test_connection_refused_is_retried_then_reported():
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ActionClient(f"http://127.0.0.1:{port}", timeout_s=1.0, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(ServerUnavailableError, match="3 attempts.*Connect") as info:
            client.generate(small_observation(), "pick", "x")
    assert info.value.attempts == 3


def test_non_protocol_reply_is_protocol_error(server):
    server.script = [(200, {}, {"hello": "world"})]
    with action_client(server) as client, pytest.raises(ProtocolError, match="neither 'data' nor 'actions'"):
        client.generate(small_observation(), "pick", "x")


# 3. Readiness, proxies, helpers ------------------------------------------------------------------------------------


def test_wait_until_ready_polls_until_200(server):
    server.health_script = [503, 503]
    with action_client(server) as client:
        assert client.wait_until_ready(timeout_s=5.0, poll_interval_s=0.01) == {"status": "ok"}
    assert len([r for r in server.requests if r["path"] == "/health"]) == 3


def test_wait_until_ready_is_bounded(server):
    server.health_script = [503] * 1000
    with action_client(server) as client, pytest.raises(ReadyTimeout, match="not ready after 0.3") as info:
        t0 = time.monotonic()
        client.wait_until_ready(timeout_s=0.3, poll_interval_s=0.05)
    assert time.monotonic() - t0 < 1.5 and isinstance(info.value, TimeoutError)


def test_loopback_bypasses_environment_proxy(server, monkeypatch):
    # a proxy nobody listens on: a client that used it for 127.0.0.1 would fail to connect
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with action_client(server, max_retries=0) as client:
        assert client.generate(small_observation(), "pick", "x").actions.shape == (1, H, D)


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
