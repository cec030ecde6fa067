"""Test-wide settings: Ray hygiene, headless rendering, skips for what this machine lacks (each with its reason), the
shared fixtures every tier may take (`one_thread`) and the shared data fixtures under tests/fixtures."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.support.parallel import assign_groups, own_ray_tmpdir, record_timeline, torch_threads

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))
os.environ.setdefault("DREAMZERO_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "dreamzero"))
own_ray_tmpdir()  # under pytest-xdist: one per worker (tests/support/parallel.py)
torch_threads()  # one, unless $DREAMZERO_TEST_TORCH_THREADS says otherwise (tests/support/parallel.py)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing or broken: no GPU tests either way
        return False


def _has_gpu_or_simulated() -> bool:
    """CUDA, or a CPU simulating a GPU for the rehearsal of the GPU tier ($DREAMZERO_SIMULATED_GPU, tests/gpu)."""
    return _has_cuda() or bool(os.environ.get("DREAMZERO_SIMULATED_GPU", "").strip())


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_groups(items):
    """Before xdist reads them (its own hook runs first otherwise): each test's group, and the workers' order."""
    assign_groups(items)


def pytest_runtest_logreport(report):
    record_timeline(report)  # only with $DREAMZERO_TEST_TIMELINE (docs/testing.md, "CI time")


def pytest_collection_modifyitems(config, items):
    reasons = {
        "gpu": None if _has_gpu_or_simulated() else "needs a CUDA GPU; none on this machine",
        "isaac": None if _has_module("isaaclab") else "needs Isaac Lab + Isaac Sim (NVIDIA RTX GPU); not installed",
        "hardware": None
        if os.environ.get("DREAMZERO_FRANKA_HOST")
        else "needs a real Franka arm on the network (set DREAMZERO_FRANKA_HOST to its FCI address)",
    }
    for item in items:
        for marker, reason in reasons.items():
            # the marker, not a keyword: a directory named "gpu" in the path does not make a test need a GPU
            if reason and item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of small CPU forwards: they are latency bound, and on this shared 2-core machine
    extra threads only spin against the other test processes (and the two ranks of a CFG-parallel pair in one process,
    against each other). Module-scoped so a module's model fixtures are built under it too; a module takes it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def all_cores():
    """Torch on every core for one test of large CPU forwards (a DiT block at 14B width): compute bound, they run
    about twice as fast on both cores of a serial run; under pytest-xdist the other worker has the second core, so
    they keep one thread there."""
    import torch

    from tests.support.parallel import worker_id

    before = torch.get_num_threads()
    torch.set_num_threads(1 if worker_id() is not None else max(1, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


PARITY_DIR = Path(__file__).resolve().parent / "fixtures" / "dit-parity"
PARITY_FILES = ("config.json", "calls.json", "vectors.npz", "weights.safetensors")


@pytest.fixture(scope="session")
def parity_fixture() -> Path:
    """The DiT parity fixture directory (tests/fixtures/dit-parity, README there); a missing file fails, never skips."""
    missing = [name for name in PARITY_FILES if not (PARITY_DIR / name).is_file()]
    if missing:
        pytest.fail(f"DiT parity fixture incomplete: {missing} missing from {PARITY_DIR} (restore them from git)")
    return PARITY_DIR
