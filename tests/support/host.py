"""This machine's free loopback ports and the processes one run started, for the tests and for benchmarks/.

Standard library only, and nothing in the installable packages imports it: benchmarks/ import it as
`tests.support.host` with the repository root on `sys.path` (as benchmarks/fuzz.py imports tests.support.fuzz).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    """A loopback TCP port that nothing listened on a moment ago (the OS's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_using(marker: str) -> list[int]:
    """Processes whose command line mentions `marker` (a private RAY_TMPDIR): the Ray processes one run started.

    Never this process itself, whatever its own command line says: callers SIGKILL what this returns.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def kill_leftovers(marker: str, grace_s: float) -> None:
    """Wait up to `grace_s` for the processes `pids_using(marker)` to exit on their own, then SIGKILL the rest."""
    deadline = time.monotonic() + grace_s
    while pids_using(marker) and time.monotonic() < deadline:
        time.sleep(1.0)
    for pid in pids_using(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
