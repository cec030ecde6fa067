"""WebSocket sessions that outlive Serve's proxy `request_timeout_s` and reconnects, through `serve run`.

Serve's proxy bounds a whole WebSocket connection by `http_options.request_timeout_s` (one ASGI call to it). The
operator here sets it to 8 s in a copy of the shipped config: `OpenPIClient` (which sends Serve's per-request
override, `x-request-timeout-seconds: 0`) steps one session for 25 s on one connection without a restart (other than
the model's own window), while a reference-style client without the header, on the same server, is cut at the bound
(the control: the bound is real). Then a dropped connection is reopened with the resume token and continues its
session, and a wrong echo restarts it, flagged.
"""

from __future__ import annotations

import threading
import time

import pytest
import yaml
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from deployments.requests import openpi as openpi_frames
from dreamzero_client.openpi_client import OpenPIClient
from dreamzero_client.wire import openpi
from tests.support.observations import openpi_droid_observation
from tests.support.serve_process import ROOT, ServeRun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROXY_TIMEOUT_S = 8
STEP_FOR_S = 25
CALL_TIMEOUT_S = 120
#: the tiny embedded model with the cheapest loop (what the cluster tests run)
ARGS = {
    "model_path": None,
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 16, "ttl_s": 600},
}
WS_PATH = "/v1/realtime/robot/openpi"


def _reference_client(url: str, stop: threading.Event, out: dict) -> None:
    """DreamZero's client as it is: no extra header, `endpoint: infer`, the bare array; counts until it is cut."""
    out["calls"], t0 = 0, time.monotonic()
    try:
        with ws_connect(url, open_timeout=30, max_size=None, compression=None) as ws:
            openpi.unpack_frame(ws.recv(timeout=30))
            while not stop.is_set():
                ws.send(openpi.pack_frame({**openpi_droid_observation(out["calls"], "ref"), "endpoint": "infer"}))
                reply, _ = openpi.unpack_frame(ws.recv(timeout=CALL_TIMEOUT_S))
                assert reply.shape == (24, 8)
                out["calls"] += 1
                stop.wait(2.0)
    except ConnectionClosed:
        out["cut_after_s"] = time.monotonic() - t0


def test_a_websocket_session_outlives_the_proxy_timeout_and_a_reconnect(tmp_path):
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["http_options"]["request_timeout_s"] = PROXY_TIMEOUT_S  # the operator's edit
    config = tmp_path / "with_proxy_timeout.yaml"
    config.write_text(yaml.safe_dump(cfg))
    with ServeRun(tmp_path, args=ARGS, config=config) as server:
        url = server.url.replace("http://", "ws://") + WS_PATH
        stop, ref = threading.Event(), {}
        control = threading.Thread(target=_reference_client, args=(url, stop, ref), daemon=True)
        control.start()
        with OpenPIClient(url, timeout_s=CALL_TIMEOUT_S, resume=True, max_reconnects=2) as client:
            assert set(openpi_frames.HANDSHAKE_KEYS) <= set(client.get_server_metadata())
            reports, t0 = [], time.monotonic()
            while time.monotonic() - t0 < STEP_FOR_S:
                reports.append(client.infer(openpi_droid_observation(len(reports), "arm"))["session"])
                time.sleep(0.5)
            assert time.monotonic() - t0 >= STEP_FOR_S > 3 * PROXY_TIMEOUT_S
            assert client.reconnects == 0, "the connection was cut"
            # the model's own window restarts a DROID session after 4 chunks (`window_full`); nothing else may
            reasons = {r["restart_reason"] for r in reports[1:]}
            assert reasons <= {None, "window_full"}, reports
            for prev, cur in zip(reports, reports[1:]):
                if not cur["restarted"]:
                    assert (cur["step"], cur["incarnation"]) == (prev["step"] + 1, prev["incarnation"]), reports
            stop.set()
            control.join(timeout=CALL_TIMEOUT_S)
            assert ref.get("cut_after_s") is not None and ref["calls"] >= 1, ref  # the bound is real without the header
            assert PROXY_TIMEOUT_S - 1 <= ref["cut_after_s"] <= PROXY_TIMEOUT_S + 10, ref

            # a dropped connection (here: closed under the client) right after a window restart, reopened with the
            # resume token: the same session continues
            while reports[-1]["step"] != 1:
                reports.append(client.infer(openpi_droid_observation(len(reports), "arm"))["session"])
            client._ws.close()
            resumed = client.infer(openpi_droid_observation(99, "arm"))["session"]
            assert client.reconnects == 1
            expected = (2, False, reports[-1]["incarnation"])
            assert (resumed["step"], resumed["restarted"], resumed["incarnation"]) == expected, resumed

            # a wrong echo restarts the session, flagged, as on HTTP
            wrong = {**openpi_droid_observation(100, "arm"), "expected_steps": [resumed["step"] + 5]}
            flagged = client.infer(wrong)["session"]
            assert flagged["restarted"] is True and flagged["restart_reason"] == "step_mismatch", flagged
