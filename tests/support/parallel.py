"""Test processes on this 2-core machine: torch's threads in each (one by default, `torch_threads`), and how
`pytest -n 2 --dist loadgroup` (pytest-xdist; scripts/test.sh's default, `DREAMZERO_TEST_WORKERS=0` for a serial
run: docs/testing.md) shares the suite between its workers.

Every test gets an `xdist_group`, and a group runs whole on one worker (pytest-xdist 3.8 tags a grouped test by
rewriting its `_nodeid`, which pytest 9 no longer reads: the dev extra pins pytest below 9 for that, and
tests/house/test_parallel_groups.py fails if the groups stop holding):
  - all of tests/cluster is one group, so one worker starts the session's Ray cluster (tests/cluster/conftest.py)
    and every cluster test reuses it, as in a serial run (two clusters would also cost two ~30 s deploys per app);
  - the e2e tests that take one of the tier's shared `serve run`s (`shipped_server`, `tiny_server`:
    tests/e2e/conftest.py) are one group per server, so each starts once;
  - the GPU-check rehearsal's module is one group: its runs share the slice checkpoints its module fixture writes
    (~25 s and 2 GB each time);
  - any other test is grouped by its module, so a module-scoped fixture (a trained model, a written checkpoint, a
    `serve run`) is built once, never once per worker.

In a worker the collection is reordered longest group first (`FIRST`: the GPU-check rehearsal, the cluster group,
the other `serve run` modules), so that the last group a worker starts is a short one; run it with
`--no-loadscope-reorder` (xdist's own order is by test count, which puts the two-test rehearsal last). xdist hands the
first groups out in turn, so the two longest (~800 s each, under CI's load) start at once on the two workers, and
neither waits behind the other. A serial run keeps its usual order.

Each worker gets its own RAY_TMPDIR: Ray's `session_latest` link (where a test finds the running session's log
folder) is one per temp dir, so two workers' clusters must not share one. Ports are the OS's free ones everywhere
(tests/support/host.py: free_port), and every `serve run` has its own temp dir and HAProxy paths
(tests/support/serve_process.py), so two workers' servers cannot collide.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

#: groups started first, longest first (the suite's --durations): whatever is not named keeps its collection order
FIRST = ("tests/e2e/test_gpu_rehearsal.py", "tests/cluster", "tests/e2e")
CLUSTER_GROUP = "tests/cluster"
#: the e2e tier's shared `serve run` fixtures: the tests taking one are a group (named for it)
SHARED_SERVERS = ("shipped_server", "tiny_server")


def worker_id() -> str | None:
    """The xdist worker this process is (gw0, gw1, ...), or None in a serial run and in the controller."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def own_ray_tmpdir() -> None:
    """A RAY_TMPDIR of this worker's own (short: Ray's socket paths must stay under 108 bytes)."""
    worker = worker_id()
    if worker is not None:
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"ray{worker}", dir="/tmp")


#: torch's threads in a test process (`DREAMZERO_TEST_TORCH_THREADS` changes it; `0` leaves torch's default, a thread
#: per core): on this shared 2-core machine a second thread spins against the other processes. Measured on 152 unit
#: tests (8 modules, load average ~3): 92 s at torch's default, 60 s at one thread; two xdist workers 110 s / 83 s
TORCH_THREADS_ENV = "DREAMZERO_TEST_TORCH_THREADS"


def torch_threads() -> None:
    """This test process's torch threads (subprocesses it starts, `serve run` and the GPU check's stages, keep their
    own defaults); a test or module that wants another count sets it and restores it (`one_thread`)."""
    n = int(os.environ.get(TORCH_THREADS_ENV, "1"))
    if n <= 0:
        return
    try:
        import torch
    except ImportError:  # the robot client's own venv runs its tests without torch
        return
    torch.set_num_threads(n)


def group_of(nodeid: str, fixtures: tuple[str, ...] | list[str] = ()) -> str:
    shared = [name for name in SHARED_SERVERS if name in fixtures]
    if shared:
        return "tests/e2e/" + shared[0]
    path = nodeid.split("::", 1)[0]
    return CLUSTER_GROUP if path.startswith(CLUSTER_GROUP + "/") else path


def _group(item: pytest.Item) -> str:
    return group_of(item.nodeid, getattr(item, "fixturenames", ()))


def _rank(group: str) -> int:
    for i, prefix in enumerate(FIRST):
        if group == prefix or group.startswith((prefix + "/", prefix + "::")):
            return i
    return len(FIRST)


def assign_groups(items: list[pytest.Item]) -> None:
    """Mark each item with its group and, in a worker, order the groups longest first (a stable sort: the order
    within a group, and among groups of one rank, stays the collection's)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    if worker_id() is not None:
        items.sort(key=lambda item: _rank(_group(item)))


#: `DREAMZERO_TEST_TIMELINE=<file>`: every test phase appended there as a JSON line (worker, test, phase, start and
#: stop in epoch seconds, outcome, load average), to see where a run's time went and how the workers shared it
TIMELINE_ENV = "DREAMZERO_TEST_TIMELINE"


def record_timeline(report: pytest.TestReport) -> None:
    path = os.environ.get(TIMELINE_ENV)
    if not path or (worker_id() is None and hasattr(report, "node")):  # xdist's controller: its worker wrote it
        return
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    row = {"worker": worker_id() or "main", "test": report.nodeid, "phase": report.when, "start": report.start,
           "stop": report.stop, "outcome": report.outcome, "load": load}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
