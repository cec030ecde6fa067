"""tests/host_support.py, the free-port and leftover-process helpers the tests and benchmarks/ share."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.host_support import free_port, kill_leftovers, pids_using


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_pids_using_never_lists_this_process():
    own = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")  # our own interpreter
    assert os.getpid() not in pids_using(own)


def test_kill_leftovers_ends_the_marked_process():
    marker = f"dz-host-support-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in pids_using(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_using(marker) == [proc.pid]
        kill_leftovers(marker, grace_s=0)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert pids_using(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
