"""What the cluster tests share besides their fixtures (those are in tests/cluster/conftest.py): the app's name and
args, the front-door app's keys, starting this session's Ray, and the bounded waits for a deploy, /health and a
deployment's replicas. Ray and Serve are imported inside the functions, so collecting the tier imports neither."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import httpx

from tests.support.host import kill_leftovers

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

#: what `ensure_app` last deployed (its "key"): a test that deploys by other means forgets it (`forget_deployed_app`)
DEPLOYED: dict = {}


def forget_deployed_app() -> None:
    """The running app is no longer what `ensure_app` deployed: its next call deploys again."""
    DEPLOYED.clear()


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
