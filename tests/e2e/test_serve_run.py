"""`serve run serve_config.yaml` as a user runs it: a subprocess, /health within a bound, one real request, SIGTERM.

The shipped config is used as is, except the HTTP port (a free one) so parallel runs do not collide.
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
import yaml

from tests.graph.helpers import decode, raw_body

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
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


def test_serve_run_serves_the_shipped_config(tmp_path):
    port = _free_port()
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"].update({"host": "127.0.0.1", "port": port})
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ray_tmp = tempfile.mkdtemp(prefix="rayE2E", dir="/tmp")  # short path: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
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
