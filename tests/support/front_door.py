"""What `serve run` of the shipped config must answer behind either front door (Serve's Python proxy, HAProxy): the
HTTP route in msgpack, a malformed body, an OpenPI WebSocket episode and the 16 MiB WebSocket message cap."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import websockets
from websockets.sync.client import connect as ws_connect

from dreamzero_client.openpi_client import OpenPIClient
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import decode, raw_body
from tests.support.serve_process import ServeRun

JSON = {"content-type": "application/json"}
REQUEST_TIMEOUT_S = 300


def check_front_door(server: ServeRun, sid: str) -> None:
    """The HTTP route in msgpack, a malformed body, an OpenPI WebSocket episode and the 16 MiB message cap."""
    port, base = server.port, server.url
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        resp = client.post(
            base + "/v1/actions/generations",
            content=raw_body([f"{sid}-robot"]),
            headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
        )
        assert resp.status_code == 200, resp.content[:500]
        out = decode(resp.content)
        assert np.asarray(out["data"][0]["action"]["values"]).shape == (1, 24, 8)
        assert out["sessions"][0]["restart_reason"] == "new_session"
        bad = client.post(base + "/v1/actions/generations", content=b"{not json", headers=JSON)
        assert bad.status_code == 400 and "traceback" not in bad.text.lower(), bad.text[:300]
    ws_url = f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi"
    with OpenPIClient(ws_url, timeout_s=REQUEST_TIMEOUT_S, response_format="dict") as ws:
        assert ws.get_server_metadata()["needs_session_id"] is True
        steps = [ws.infer(openpi_droid_observation(i, f"{sid}-ws"))["session"]["step"] for i in range(2)]
        assert steps == [1, 2]
    # either front door caps a WebSocket message at 16 MiB (uvicorn's default), under the shipped 64 MiB limit
    with ws_connect(f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi", max_size=None, open_timeout=30) as raw_ws:
        raw_ws.recv(timeout=30)
        raw_ws.send(b"\0" * (17 << 20))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            raw_ws.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
