"""TLS on every door of a real `serve run`: the shipped serve_config.yaml with Serve's own `ssl_certfile` /
`ssl_keyfile` under `http_options` (a certificate for localhost signed by a CA made at run time) and the ZeroMQ door
with `zmq.curve` (the server's secret key in an environment variable of `serve run`, one allowed robot key).

HTTPS and WSS round trips verify the certificate with the CA bundle; the TLS cases of the malformed-request corpus
are refused with their exact client error through the real proxy (no CA bundle, an address the certificate does not
name; the expired certificate is in tests/unit/client/test_tls.py, against the same uvicorn TLS setup: a proxy keeps
one certificate for its life), and plain HTTP on the TLS port gets no answer. Over ZeroMQ a CURVE client with the
allowed key round-trips, while a plain RLDX-1-shaped peer and an unknown key get no reply and the door serves on.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from dreamzero.zmq_keys_cli import make_key_pair
from dreamzero_client.errors import SecureChannelError, ServerUnavailableError
from dreamzero_client.http_client import ActionClient
from dreamzero_client.openpi_client import OpenPIClient
from dreamzero_client.zmq_client import ZmqPolicyClient
from dreamzero_client.zmq_keys import read_secret_key
from tests.support.host import free_port
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import droid_raw_observation
from tests.support.rldx import RldxShapedClient, droid_rldx_observation
from tests.support.serve_process import ServeRun
from tests.support.tls import make_pki

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUEST_TIMEOUT_S = 300
WS_PATH = "/v1/realtime/robot/openpi"
SILENCE_S = 2.0
UNTRUSTED = "unable to get local issuer certificate; pass the CA certificate that signed it (ca_bundle / --ca-bundle)"


def wait_for_zmq(client: ZmqPolicyClient, timeout_s: float = 180.0) -> None:
    """The door binds when its replica starts, which /health (the HTTP ingress) does not wait for."""
    deadline = time.monotonic() + timeout_s
    while not client.ping():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ZMQ door did not answer within {timeout_s} s")


def test_https_wss_and_curve_through_serve_run(tmp_path):
    pki = make_pki(tmp_path / "pki")
    keys = {name: make_key_pair(tmp_path / "keys", name) for name in ("server", "robot")}
    _, server_secret = read_secret_key(keys["server"][1], "server")
    robot_public, _ = read_secret_key(keys["robot"][1], "robot")
    zmq_port = free_port()
    curve = {"secret_key_env": "DZ_E2E_ZMQ_SECRET", "client_keys": [robot_public.decode()]}
    cert, key = pki.localhost
    with ServeRun(
        tmp_path,
        args={"zmq": {"port": zmq_port, "host": "127.0.0.1", "curve": curve}},
        env={"DZ_E2E_ZMQ_SECRET": server_secret.decode()},
        http_options={"ssl_certfile": str(cert), "ssl_keyfile": str(key)},
        ca_bundle=pki.ca,
    ) as server:
        port = server.port
        assert server.url == f"https://localhost:{port}"

        # 1. HTTPS and WSS round trips, verified with the CA bundle
        with ActionClient(server.url, ca_bundle=pki.ca, timeout_s=REQUEST_TIMEOUT_S) as http:
            # a session's first call sends one frame, every later one a 4-frame stack
            steps = [http.generate(droid_raw_observation(t=t), "pick", "tls").sessions[0]["step"] for t in (1, 4)]
            assert steps == [1, 2]
        ws_url = f"wss://localhost:{port}{WS_PATH}"
        with OpenPIClient(ws_url, ca_bundle=pki.ca, timeout_s=REQUEST_TIMEOUT_S, response_format="dict") as ws:
            assert ws.get_server_metadata()["needs_session_id"] is True
            replies = [ws.infer(openpi_droid_observation(i, "tls-ws")) for i in range(2)]
            assert [r["session"]["step"] for r in replies] == [1, 2]
            assert np.asarray(replies[1]["actions"]).shape == (24, 8)

        # 2. refused through the real proxy, each with its exact error, at once
        cases = {
            f"https://localhost:{port}": (None, UNTRUSTED),
            f"wss://localhost:{port}": (None, UNTRUSTED),
            f"https://127.0.0.1:{port}": (
                pki.ca,
                "IP address mismatch, certificate is not valid for '127.0.0.1'; connect by a name the certificate "
                "carries (its subjectAltName) or reissue it for this host",
            ),
        }
        for url, (bundle, said) in cases.items():
            t0 = time.monotonic()
            with pytest.raises(SecureChannelError) as refused:
                if url.startswith("https"):
                    ActionClient(url, ca_bundle=bundle, max_retries=3, backoff_s=30).health()
                else:
                    OpenPIClient(url + WS_PATH, ca_bundle=bundle, max_reconnects=3, reconnect_backoff_s=30)
            assert str(refused.value) == f"TLS: the certificate of {url} did not verify: {said}"
            assert time.monotonic() - t0 < 15
        # plain HTTP on the TLS port: no answer in clear, ever
        with pytest.raises(ServerUnavailableError):
            ActionClient(f"http://127.0.0.1:{port}", max_retries=0, timeout_s=10).health()

        # 3. the ZeroMQ door over CURVE
        robot = ZmqPolicyClient(
            "127.0.0.1", zmq_port, 120, server_key=keys["server"][0], client_key_file=keys["robot"][1]
        )
        try:
            wait_for_zmq(robot)
            action, info = robot.get_action(droid_rldx_observation(), {"session_ids": ["arm"]})
            assert action["action.joint_position"].shape == (1, 24, 7) and info["sessions"][0]["step"] == 1
            plain = RldxShapedClient(zmq_port, timeout_s=SILENCE_S)  # RLDX-1's own client, no CURVE
            try:
                plain.send("ping", requires_input=False)
                with pytest.raises(zmq.Again):
                    plain.receive()
            finally:
                plain.close()
            with ZmqPolicyClient("127.0.0.1", zmq_port, 30, server_key=keys["server"][0]) as stranger:  # unknown key
                with pytest.raises(SecureChannelError, match=r"refused this client's key \(ZAP status 400\)"):
                    stranger.ping()
            _, info = robot.get_action(droid_rldx_observation(), {"session_ids": ["arm"]})
            assert info["sessions"][0]["step"] == 2  # the door served on, the session continued
        finally:
            robot.close()
