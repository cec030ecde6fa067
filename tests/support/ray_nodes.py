"""Private multi-node Ray clusters on this machine for tests: each node started with `ray start` under a temp dir of
its own, and stopped (or lost) by killing exactly the processes of that temp dir.

`ray stop` would stop every Ray process on the machine, other clusters included, and Ray has no command that stops
one node of several on a host. Every process a node starts (raylet, agents, log monitor, workers) names the node's
temp dir in its command line, so that is how a node's processes are found; their children are taken too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.host import free_port

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 240
#: node options every test node shares: logical CPUs only (the stages reserve none), a small object store, loopback
COMMON = ["--disable-usage-stats", "--object-store-memory=100000000", "--node-ip-address=127.0.0.1"]
#: a busy 2-core machine starts a node's Python agent slowly; without this the raylet gives up on it and exits
SLOW_AGENT_ENV = {"RAY_agent_register_timeout_ms": "240000"}


def node_ports() -> list[str]:
    """Free ports for the per-node servers: two nodes on one machine cannot both take the fixed defaults."""
    names = (
        "--node-manager-port", "--object-manager-port", "--metrics-export-port", "--runtime-env-agent-port",
        "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
    )  # fmt: skip
    return [f"{name}={free_port()}" for name in names]


def ray_start(args: list[str], env: dict, temp_dir: str, attempts: int = 3) -> None:
    """`ray start --temp-dir=<temp_dir> ...`, again after a failed try (whose processes are killed first): on a
    loaded machine a node's agent can start slower than its raylet waits for it."""
    done = None
    for _ in range(attempts):
        cmd = [RAY, "start", f"--temp-dir={temp_dir}", *args]
        done = subprocess.run(cmd, env=env, timeout=START_TIMEOUT_S, capture_output=True, text=True)
        if done.returncode == 0:
            return
        kill_node(temp_dir)
    raise RuntimeError(f"ray start {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _names(part: str, temp_dir: str) -> bool:
    """Whether a command-line argument names `temp_dir` itself or a path under it (not a sibling sharing a prefix)."""
    root = temp_dir.rstrip(os.sep)
    at = part.find(root)
    while at != -1:
        end = at + len(root)
        if end == len(part) or part[end] in (os.sep, " ", ",", ";", '"', "'"):
            return True
        at = part.find(root, at + 1)
    return False


def node_processes(temp_dir: str) -> list:
    """The live processes (psutil) whose command line names `temp_dir`, with all their children."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(_names(part, temp_dir) for part in proc.info["cmdline"] or ()):
                found[proc.pid] = proc
                found.update({child.pid: child for child in proc.children(recursive=True)})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def kill_node(temp_dir: str) -> int:
    """SIGKILL every process of the node started under `temp_dir` (by pid), as a lost machine; returns how many."""
    import psutil

    victims = node_processes(temp_dir)
    for proc in victims:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    psutil.wait_procs(victims, timeout=10)
    return len(victims)


@contextlib.contextmanager
def two_node_cluster(
    env: dict,
    head: tuple[int, dict, dict],
    node: tuple[int, dict, dict],
    prefixes: tuple[str, str] = ("rnh", "rnn"),
) -> Iterator[tuple[str, str, str]]:
    """A private head + one more node on this machine -> (GCS address, head temp dir, node temp dir); both killed
    and their dirs removed on exit. `head` / `node`: (CPUs, custom resources, extra environment) of each; `env` is
    what both start with (SLOW_AGENT_ENV is added). Short temp dirs with different prefixes: Ray's socket paths must
    stay under 108 bytes, and neither dir may be a prefix of the other (kill_node finds a node by its dir)."""
    head_dir = tempfile.mkdtemp(prefix=prefixes[0], dir="/tmp")
    node_dir = tempfile.mkdtemp(prefix=prefixes[1], dir="/tmp")
    env = {**env, **SLOW_AGENT_ENV, "RAY_AUTH_MODE": "disabled"}
    port = free_port()
    try:
        (cpus, resources, extra) = head
        ray_start(
            ["--head", f"--port={port}", "--include-dashboard=false", f"--dashboard-port={free_port()}",
             f"--ray-client-server-port={free_port()}", f"--num-cpus={cpus}", "--resources", json.dumps(resources),
             *COMMON, *node_ports()],
            {**env, **extra, "RAY_TMPDIR": head_dir},
            head_dir,
        )  # fmt: skip
        (cpus, resources, extra) = node
        ray_start(
            [f"--address=127.0.0.1:{port}", f"--num-cpus={cpus}", "--resources", json.dumps(resources),
             *COMMON, *node_ports()],
            {**env, **extra, "RAY_TMPDIR": node_dir},
            node_dir,
        )  # fmt: skip
        yield f"127.0.0.1:{port}", head_dir, node_dir
    finally:
        kill_node(node_dir)
        kill_node(head_dir)
        shutil.rmtree(node_dir, ignore_errors=True)
        shutil.rmtree(head_dir, ignore_errors=True)
