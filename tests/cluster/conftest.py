"""One real single-node Ray cluster with Serve's HTTP proxy on a free port, shared by every cluster test, and shut
down right after the last of them (not at the end of the session: an idle cluster with its apps still spends a share
of a core, which every later test of a serial run would pay).

Apps are deployed the way `serve deploy` / `serve run serve_config.yaml` do it (import path + args through the
controller), so a config-only change (replica count) scales the policy without replacing the other replicas. The
apps' args, keys and bounded waits that the tests import too are in tests/support/cluster.py.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import (
    APP,
    DEPLOY_TIMEOUT_S,
    DEPLOYED,
    FRONT_DOOR_ARGS,
    HTTP_TIMEOUT_S,
    IMPORT_PATH,
    METRICS_URL,
    start_ray,
    wait_deployed,
    wait_healthy,
    wait_replicas,
)
from tests.support.host import free_port


@pytest.fixture(scope="session")
def serve_cluster():
    """(base_url, deploy) where deploy(args, **deployment_overrides) (re)deploys the app and waits for /health."""
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # metrics reach the Prometheus endpoint within ~1 s
    port, metrics_port = free_port(), free_port()
    start_ray(metrics_port)
    METRICS_URL["url"] = f"http://127.0.0.1:{metrics_port}/metrics"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base_url = f"http://127.0.0.1:{port}"

    def deploy(args: dict, wait_for: int | None = None, policy_replicas: int | None = None) -> None:
        app = {"name": APP, "route_prefix": "/", "import_path": IMPORT_PATH, "args": args}
        if policy_replicas is not None:  # a config-only override: Serve scales without replacing replicas
            app["deployments"] = [{"name": "Policy", "num_replicas": policy_replicas}]
        schema = ServeDeploySchema(applications=[app])
        started = time.time()
        # private but stable: the call `serve deploy` / `serve run <config>` end in
        serve.context._get_global_client().deploy_apps(schema)
        # the previous version keeps answering /health during a rolling update: wait for this one to be running
        wait_deployed(started, DEPLOY_TIMEOUT_S)
        wait_healthy(base_url, DEPLOY_TIMEOUT_S)
        if wait_for is not None:
            wait_replicas("Policy", wait_for, DEPLOY_TIMEOUT_S)

    def shut_down() -> None:
        if _shutdown.pop("cluster", None) is not None:
            serve.shutdown()
            ray.shutdown()

    _shutdown["cluster"] = shut_down
    try:
        yield base_url, deploy
    finally:
        shut_down()


#: how to shut the shared cluster down, while it runs
_shutdown: dict = {}


def pytest_runtest_teardown(item, nextitem):
    """Shut the shared cluster down after the last test of this process that takes it (its fixture's exit then finds
    nothing to do)."""
    if "cluster" not in _shutdown or "serve_cluster" not in getattr(item, "fixturenames", ()):
        return
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    if not any("serve_cluster" in getattr(other, "fixturenames", ()) for other in later):
        _shutdown["cluster"]()


@pytest.fixture(scope="session")
def http(serve_cluster):
    with httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False) as client:
        yield client


@pytest.fixture(scope="session")
def ensure_app(serve_cluster):
    """ensure_app(args, replicas) deploys only when the args differ from what is running (deploys cost ~30 s)."""
    _, deploy = serve_cluster

    def ensure(args: dict, replicas: int = 1, policy_replicas: int | None = None) -> None:
        key = repr((sorted(args.items()), replicas, policy_replicas))
        if DEPLOYED.get("key") != key:
            deploy(args, wait_for=replicas, policy_replicas=policy_replicas)
            DEPLOYED["key"] = key

    return ensure


@pytest.fixture
def front_door(serve_cluster, ensure_app):
    ensure_app(FRONT_DOOR_ARGS, 1)
    return serve_cluster[0]


def pytest_collection_modifyitems(items):
    """The modules on the `front_door` app run one after another, first: its ~30 s deploy happens once, not again
    after every module that deployed its own args in between (modules in alphabetical order interleave them). Only
    the cluster tests move, among their own places, and each module's tests stay together."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if Path(str(item.fspath)).is_relative_to(here)]
    on_front_door = {str(items[i].fspath) for i in places if "front_door" in getattr(items[i], "fixturenames", ())}
    ours = sorted((items[i] for i in places), key=lambda item: str(item.fspath) not in on_front_door)
    for i, item in zip(places, ours):
        items[i] = item
