"""One real single-node Ray cluster with Serve's HTTP proxy on a free port, shared by every cluster test, and shut
down right after the last of them (not at the end of the session: an idle cluster with its apps still spends a share
of a core, which every later test of a serial run would pay).

Apps are deployed the way `serve deploy` / `serve run serve_config.yaml` do it (import path + args through the
controller), so a config-only change (replica count) scales the policy without replacing the other replicas.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.support.host import free_port, kill_leftovers

APP = "dz"
IMPORT_PATH = "serve_graph.builder:build_app"
#: the tiny embedded model with the cheapest loop that still exercises every stage
BASE_ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 64, "ttl_s": 600},
    "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.01},
}
DEPLOY_TIMEOUT_S = 240
#: Ray's Prometheus endpoint of this node, filled in by the cluster fixture
METRICS_URL: dict[str, str] = {}
HTTP_TIMEOUT_S = 120


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


#: ray.init tries: Ray waits a fixed 30 s for a new node's raylet, which a loaded 2-core machine (the other pytest-xdist
#: worker computing, tests/support/parallel.py) can miss
RAY_INIT_ATTEMPTS = 3


def start_ray(metrics_port: int) -> None:
    """This session's local Ray cluster, started again after a node that timed out during startup (whose processes,
    found by its session folder's name, are killed first)."""
    import ray

    for attempt in range(RAY_INIT_ATTEMPTS):
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                object_store_memory=200 * 1024 * 1024,
                log_to_driver=False,
                _metrics_export_port=metrics_port,
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for a node that timed out during startup
            if "timed out during startup" not in str(exc) or attempt == RAY_INIT_ATTEMPTS - 1:
                raise
            ray.shutdown()
            session = Path(os.environ["RAY_TMPDIR"], "ray", "session_latest").resolve()
            if session.name.startswith("session_2"):  # a started session (the link resolved), not the bare link
                kill_leftovers(session.name, grace_s=0)


def wait_deployed(since: float, timeout_s: float) -> None:
    """Until the app's config deployed at or after `since` (epoch s) is RUNNING: no replica of an older one serves."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP)
        if (
            status is not None
            and status.last_deployed_time_s >= since - 1.0
            and status.status == ApplicationStatus.RUNNING
        ):
            return
        time.sleep(0.5)
    raise TimeoutError(f"app {APP} did not run its new config within {timeout_s} s")


def wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    with httpx.Client(timeout=10, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                last = client.get(f"{base_url}/health")
                if last.status_code == 200:
                    return
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.5)
    raise TimeoutError(f"/health not 200 within {timeout_s} s (last: {last!r})")


def wait_replicas(deployment: str, n: int, timeout_s: float) -> None:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and deployment in status.deployments:
            counts = status.deployments[deployment].replica_states
            if counts.get(ReplicaState.RUNNING, 0) == n and sum(counts.values()) == n:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{deployment} did not reach {n} running replicas within {timeout_s} s")


@pytest.fixture(scope="session")
def http(serve_cluster):
    with httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False) as client:
        yield client


API_KEY = "test-key-123"
#: keys of two named tenants beside the legacy key (tenant `default`), for the corpus's tenant cases
TENANT_KEYS = {"team-a": "team-a-key-456", "team-b": "team-b-key-789"}
#: one app for the route, corpus and WebSocket tests: auth on, small limits so the limit paths are cheap to hit
FRONT_DOOR_ARGS = {
    **BASE_ARGS,
    "api_key": API_KEY,
    "api_keys": {t: "sha256:" + hashlib.sha256(k.encode()).hexdigest() for t, k in TENANT_KEYS.items()},
    "http": {"max_body_bytes": 8 * 1024 * 1024, "ws_max_message_bytes": 2 * 1024 * 1024, "ws_idle_timeout_s": 4.0},
    # usual raw requests are transformed in the ingress, a large one takes the Preprocess replicas: both paths run
    "preprocess": {"ingress_max_bytes": "4MiB"},
}
AUTH = {"Authorization": f"Bearer {API_KEY}"}

_current: dict = {}


@pytest.fixture(scope="session")
def ensure_app(serve_cluster):
    """ensure_app(args, replicas) deploys only when the args differ from what is running (deploys cost ~30 s)."""
    _, deploy = serve_cluster

    def ensure(args: dict, replicas: int = 1, policy_replicas: int | None = None) -> None:
        key = repr((sorted(args.items()), replicas, policy_replicas))
        if _current.get("key") != key:
            deploy(args, wait_for=replicas, policy_replicas=policy_replicas)
            _current["key"] = key

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
