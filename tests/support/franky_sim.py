"""franky-sim (libfranka protocol on loopback, MuJoCo, headless) for the e2e tests of the real franky code path.

franky-sim binds the first free 127.x address on ports 1337 (robot) / 1338 (gripper) and prints it;
`running_franky_sim` reads it from stdout, yields it, and kills the simulator's process group on exit (the e2e tier's
`franky_sim` fixture, tests/e2e/conftest.py, runs one per module).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SIM = shutil.which("franky-sim") or str(Path(sys.executable).parent / "franky-sim")
START_TIMEOUT_S = 60.0
#: franky-sim steps its physics once per loop pass and sleeps to a 1 ms tick but never catches up, so on a loaded
#: machine its clock runs slower than the wall clock and a gripper motion (0.8 s for a full stroke, then 100 settled
#: ticks) can take several times as long: the episode-start open gets a bound for that, not the hardware's 5 s
SIM_GRIPPER_TIMEOUT_S = 30.0


def _wait_for_port(host: str, port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"franky-sim did not listen on {host}:{port}")


def _own_group_and_die_with_parent() -> None:
    """Child setup: a new process group (killed as a whole below) that Linux also kills if this test process dies
    without cleaning up (SIGKILL from a timeout, a crash)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux / glibc: the finally below still cleans up on a normal exit


@contextmanager
def running_franky_sim() -> Iterator[str]:
    """franky-sim started with `--simulator mujoco`: its robot IP once both ports listen (within `START_TIMEOUT_S`)."""
    # unbuffered: franky-sim prints its address through Python's stdout, block-buffered when it is a pipe
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [SIM, "--simulator", "mujoco"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_own_group_and_die_with_parent,
    )
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def pump():  # keep draining stdout so the simulator never blocks on a full pipe
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"using '([\d.]+)' as the robot IP", line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        if not ready.wait(START_TIMEOUT_S) or not found:
            pytest.fail(f"franky-sim did not start (exit {proc.poll()}):\n{''.join(lines)[-3000:]}")
        host = found[0]
        _wait_for_port(host, 1337, deadline)
        _wait_for_port(host, 1338, deadline)
        yield host
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
