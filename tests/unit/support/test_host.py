"""tests/support/host.py, the free-port and leftover-process helpers the tests and benchmarks/ share."""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.host import free_port, kill_leftovers, pids_using


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


def _binds_port_0(node) -> bool:
    """`("127.0.0.1", 0)` and the like: an address whose port the OS picks."""
    if not (isinstance(node, ast.Tuple) and len(node.elts) == 2):
        return False
    host, port = node.elts
    return isinstance(port, ast.Constant) and port.value == 0 and isinstance(host, ast.Constant) and host.value in (
        "127.0.0.1", "", "0.0.0.0", "localhost"
    )  # fmt: skip


def test_benchmarks_and_scripts_share_these_helpers_instead_of_copying_them():
    """A free port is picked, and Ray's leftovers are found in /proc, only here: benchmarks/ and scripts/ import it."""
    root = Path(__file__).resolve().parents[3]
    copies = []
    for path in sorted([*(root / "benchmarks").glob("*.py"), *(root / "scripts").glob("*.py")]):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        copies += [f"{path.name} defines {name}" for name in sorted(defined & {"free_port", "pids_using"})]
        copies += [f"{path.name} binds port 0 itself"] if any(_binds_port_0(n) for n in ast.walk(tree)) else []
    assert copies == [], "use tests.support.host (free_port, pids_using, kill_leftovers)"
    assert _binds_port_0(ast.parse('s.bind(("127.0.0.1", 0))').body[0].value.args[0])  # the check reads real code
