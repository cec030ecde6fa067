"""`serve run serve_config.yaml` as a user runs it: a subprocess, /health within a bound, real requests, SIGTERM.

The shipped config is used as is, except the HTTP port (a free one) so parallel runs do not collide. Both front doors
are covered: Serve's Python proxy (the default) and HAProxy (`RAY_SERVE_ENABLE_HA_PROXY=1` in the environment of
`serve run`, docs/serving.md "Front door"): the HTTP route in msgpack, a malformed body, an OpenPI WebSocket
episode and the 16 MiB WebSocket message cap must behave the same behind either.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
import yaml
from websockets.sync.client import connect as ws_connect

from dreamzero_client.openpi_client import OpenPIClient
from tests.graph.helpers import decode, openpi_droid_observation, raw_body

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
JSON = {"content-type": "application/json"}
HEALTH_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_using(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (our private RAY_TMPDIR): the Ray processes we started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    with httpx.Client(timeout=5, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"serve run exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
    pytest.fail(f"/health not 200 within {HEALTH_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("front_door", ["serve-proxy", "haproxy"])
def test_serve_run_serves_the_shipped_config(tmp_path, front_door):
    port = _free_port()
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"].update({"host": "127.0.0.1", "port": port})
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ray_tmp = tempfile.mkdtemp(prefix="rayE2E", dir="/tmp")  # short path: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    if front_door == "haproxy":
        # HAProxy's config and admin socket default to fixed paths under /tmp: private ones, so runs cannot collide
        env |= {
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{ray_tmp}/haproxy/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{ray_tmp}/haproxy/admin.sock",
        }
    log = tmp_path / "serve_run.log"
    serve_bin = Path(sys.executable).with_name("serve")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(serve_bin), "run", str(config_path)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log)
        if front_door == "haproxy":  # really behind HAProxy: its process runs with our private config
            argv0 = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in _pids_using(ray_tmp)]
            assert any(a.endswith(b"haproxy") for a in argv0), argv0
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            resp = client.post(
                base + "/v1/actions/generations",
                content=raw_body(["e2e-robot"]),
                headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
            )
            assert resp.status_code == 200, resp.content[:500]
            out = decode(resp.content)
            assert np.asarray(out["data"][0]["action"]["values"]).shape == (1, 24, 8)
            assert out["sessions"][0]["restart_reason"] == "new_session"
            bad = client.post(base + "/v1/actions/generations", content=b"{not json", headers=JSON)
            assert bad.status_code == 400 and "traceback" not in bad.text.lower(), bad.text[:300]
        with OpenPIClient(f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi", timeout_s=REQUEST_TIMEOUT_S) as ws:
            assert ws.get_server_metadata()["needs_session_id"] is True
            steps = [ws.infer(openpi_droid_observation(i, "e2e-ws"))["session"]["step"] for i in range(2)]
            assert steps == [1, 2]
        # either front door caps a WebSocket message at 16 MiB (uvicorn's default), under the shipped 64 MiB limit
        with ws_connect(f"ws://127.0.0.1:{port}/v1/realtime/robot/openpi", max_size=None, open_timeout=30) as raw_ws:
            raw_ws.recv(timeout=30)
            raw_ws.send(b"\0" * (17 << 20))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                raw_ws.recv(timeout=60)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        proc.send_signal(signal.SIGTERM)  # a backgrounded `serve run` ignores SIGINT
        assert proc.wait(timeout=90) is not None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _pids_using(ray_tmp) and time.monotonic() < deadline:  # Ray's own processes exit after the driver
            time.sleep(1.0)
        for pid in _pids_using(ray_tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
