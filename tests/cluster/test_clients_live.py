"""Our own clients (clients/dreamzero-client/dreamzero_client/http_client.py, .../openpi_client.py) against
the live graph on a real Ray cluster.

A DROID episode of several chunks with a session reset, retries observed against injected 503s (a loopback proxy in
front of the live server answers the first requests with 503 + Retry-After, then forwards), typed errors on 4xx.
"""

from __future__ import annotations

import http.server
import threading

import httpx
import numpy as np
import pytest

from dreamzero_client.errors import AuthenticationError, BadRequestError
from dreamzero_client.http_client import ActionClient
from dreamzero_client.openpi_client import OpenPIClient
from tests.support.cluster import API_KEY
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import droid_raw_observation

pytestmark = pytest.mark.cluster

PROMPT = "put the marker in the cup"


class FlakyProxy:
    """Loopback reverse proxy: the first `failures` POSTs get 503 + Retry-After, the rest are forwarded upstream."""

    def __init__(self, upstream: str, failures: int):
        self.upstream, self.failures, self.injected, self.forwarded = upstream, failures, 0, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0) or 0))
                if method == "POST" and proxy.injected < proxy.failures:
                    proxy.injected += 1
                    self.send_response(503)
                    self.send_header("Retry-After", "0.2")
                    self.send_header("content-type", "application/json")
                    payload = b'{"detail": "injected: no capacity", "code": "no_capacity"}'
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                with httpx.Client(timeout=120, trust_env=False) as client:
                    resp = client.request(method, proxy.upstream + self.path, content=body, headers=headers)
                proxy.forwarded += 1
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def _step_obs(t: int, seed: int) -> dict:
    return droid_raw_observation(1, t, seed=seed)


def test_http_client_droid_episode_with_reset_and_injected_503s(front_door):
    with (
        FlakyProxy(front_door, failures=2) as proxy,
        ActionClient(proxy.url, api_key=API_KEY, timeout_s=120, max_retries=4, backoff_s=0.1) as client,
    ):
        client.wait_until_ready(timeout_s=60)
        sid = "live-http-episode"
        steps, reasons = [], []
        for chunk in range(3):  # first chunk: 1 frame; then 4-frame stacks continue the session
            res = client.generate(_step_obs(1 if chunk == 0 else 4, chunk), PROMPT, sid, seed=1140)
            assert res.actions.shape == (1, 24, 8) and res.actions.dtype == np.float32
            assert np.isfinite(res.actions).all()
            assert set(np.unique(res.actions[..., 7])) <= {0.0, 1.0}  # DROID gripper binarised
            steps.append(res.sessions[0]["step"])
            reasons.append(res.sessions[0]["restart_reason"])
        assert proxy.injected == 2, "the first call must have met both injected 503s and retried past them"
        assert steps == [1, 2, 3] and reasons == ["new_session", None, None]

        client.reset_sessions(sid)  # the next call carries reset_mask for this session
        res = client.generate(_step_obs(4, 9), PROMPT, sid)
        assert res.sessions[0]["restarted"] and res.sessions[0]["restart_reason"] == "reset_requested"
        assert res.sessions[0]["step"] == 1


def test_http_client_typed_errors_on_4xx(front_door):
    with ActionClient(front_door, api_key=API_KEY, timeout_s=60, max_retries=3, backoff_s=0.1) as client:
        bad = _step_obs(1, 0)
        bad["state.joint_position"] = np.zeros((1, 6), np.float32)  # DROID needs 7 joints
        with pytest.raises(BadRequestError) as info:
            client.generate(bad, PROMPT, "live-bad-shape")
        assert info.value.status == 422 and info.value.field and "joint_position" in info.value.field
        assert "7" in str(info.value)
    with ActionClient(front_door, api_key="wrong-key", timeout_s=30, max_retries=3) as client:
        with pytest.raises(AuthenticationError) as info:
            client.generate(_step_obs(1, 0), PROMPT, "live-bad-key")
        assert info.value.status == 401


def test_openpi_client_episode_with_reset(front_door):
    port = front_door.rsplit(":", 1)[1]
    url = f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi"
    with OpenPIClient(url, api_key=API_KEY, timeout_s=120, response_format="dict") as client:
        meta = client.get_server_metadata()
        assert meta["image_resolution"] == [180, 320] and meta["needs_session_id"] is True
        assert meta["action_space"] == "joint_position"
        sessions = []
        for i in range(3):
            reply = client.infer(openpi_droid_observation(i, "ep-1", PROMPT))
            assert reply["actions"].shape == (24, 8) and np.isfinite(reply["actions"]).all()
            sessions.append(reply["session"])
        assert [s["step"] for s in sessions] == [1, 2, 3]
        assert sessions[0]["restart_reason"] == "new_session" and sessions[1]["restarted"] is False
        assert client.reset()["status"]
        after = client.infer(openpi_droid_observation(7, "ep-1", PROMPT))["session"]
        assert after["restarted"] and after["step"] == 1
