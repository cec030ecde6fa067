"""The e2e tier's shared `serve run`s, each started once for every test that only talks to it and stopped right after
the last of them, not at the end of the session (an idle Ray cluster still spends a share of a core; each `serve run`
costs ~30 s of this 2-core machine to start):

- `shipped_server`: the shipped config as is (a free port only), `embedded:small-scene1`;
- `tiny_server`: the same config with `model_path: null`, the random tiny model the docs name for a quick try.

A test that takes one must not stop it and uses session ids of its own; one that needs a server to die in front of
its client cuts a `tests.support.tcp_relay.TcpRelay` in front of it instead.

`franky_sim` (module scope): franky-sim's robot IP, for the Franka modules that drive the real franky code path;
skipped where franky or franky-sim is not installed."""

from __future__ import annotations

import os

import pytest

from tests.support.serve_process import ServeRun

SHARED = ("shipped_server", "tiny_server")
_running: dict[str, ServeRun] = {}


def _shared(name: str, workdir, args: dict | None):
    with ServeRun(workdir, args=args) as server:
        _running[name] = server
        yield server
    _running.pop(name, None)


@pytest.fixture(scope="session")
def shipped_server(tmp_path_factory):
    """`serve run serve_config.yaml` exactly as shipped."""
    yield from _shared("shipped_server", tmp_path_factory.mktemp("shipped"), None)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """`serve run serve_config.yaml` with `model_path: null`: the random tiny model (its actions are meaningless)."""
    yield from _shared("tiny_server", tmp_path_factory.mktemp("tiny"), {"model_path": None})


def pytest_runtest_teardown(item, nextitem):
    """Stop a shared server after the last test of this process that takes it (its fixture's exit then finds it
    stopped)."""
    names = [n for n in SHARED if n in _running and n in getattr(item, "fixturenames", ())]
    if not names:
        return
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    for name in names:
        if not any(name in getattr(other, "fixturenames", ()) for other in later):
            _running[name].stop()


@pytest.fixture(scope="module")
def franky_sim():
    """franky-sim started for the module (tests/support/franky_sim.py), as its robot IP; killed when it is done."""
    from tests.support.franky_sim import SIM, running_franky_sim

    pytest.importorskip("franky", reason="franky-control is not installed (./scripts/install.sh installs it)")
    if not os.path.exists(SIM):
        pytest.skip("franky-sim is not installed (pip install franky-sim)")
    with running_franky_sim() as host:
        yield host
