"""`serve run serve_config.yaml` behind HAProxy (`RAY_SERVE_ENABLE_HA_PROXY=1` in the environment of `serve run`,
docs/serving.md "Front door"): its own server (HAProxy is chosen when Ray starts), the same answers as behind Serve's
proxy (tests/support/front_door.py), and `serve run` exits on SIGTERM (a backgrounded one ignores SIGINT)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.front_door import check_front_door
from tests.support.host import pids_using
from tests.support.serve_process import ServeRun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_serve_run_serves_the_shipped_config_behind_haproxy(tmp_path):
    with ServeRun(tmp_path, haproxy=True) as server:
        # really behind HAProxy: its process runs with our private config
        argv0 = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in pids_using(server.ray_tmp)]
        assert any(a.endswith(b"haproxy") for a in argv0), argv0
        check_front_door(server, "e2e-haproxy")
        assert server.stop() is not None  # SIGTERM: `serve run` exits
