"""The server side of `benchmarks/reliability.py`, driven from outside through Ray's public APIs only.

A private single-node Ray (its own RAY_TMPDIR, loopback only, Prometheus metrics on a free port), the graph deployed
the way `serve deploy` does it (import path + args through the controller, so a config-only change of the Policy's
`num_replicas` scales without replacing the other replicas), replica actors found by name, killed with `ray.kill`,
their RSS read from /proc through psutil, and every Ray process of the private temp dir gone at the end.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
from reliability_stats import prometheus_values

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: tests/ of the repository
from tests.support.host import free_port, kill_leftovers, pids_using

APP = "dzrel"
IMPORT_PATH = "serve_graph.builder:build_app"
DEPLOY_TIMEOUT_S = 600
START_ATTEMPTS = 3  # the shared 2-core machine can take minutes to start four replicas


def _is_raylet(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/raylet")
    except OSError:
        return False


def _replica_label(title: str) -> str | None:
    """`ray::ServeReplica:dzrel:Policy.handle_request` -> `Policy`; `ray::ProxyActor` -> `Proxy`; else None."""
    if title.startswith("ray::ProxyActor"):
        return "Proxy"
    prefix = f"ray::ServeReplica:{APP}:"
    if title.startswith(prefix):
        return title[len(prefix) :].split(".", 1)[0].split()[0]
    return None


class Cluster:
    """`with Cluster(request_timeout_s) as c: c.deploy(args, policy_replicas=2)`; c.url is the HTTP front door.
    `request_timeout_s`: Serve's proxy timeout; None (as the shipped serve_config.yaml) leaves it off."""

    def __init__(self, request_timeout_s: float | None = None):
        self.request_timeout_s = request_timeout_s
        self.ray_tmp = tempfile.mkdtemp(prefix="rayRel", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.url = ""
        self.metrics_url = ""

    def __enter__(self) -> Cluster:
        import ray
        from ray import serve

        os.environ.update(RAY_TMPDIR=self.ray_tmp, RAY_AUTH_MODE="disabled", RAY_metrics_report_interval_ms="1000")
        os.environ.pop("RAY_ADDRESS", None)
        port, metrics_port = free_port(), free_port()
        try:
            for attempt in range(START_ATTEMPTS):
                try:
                    ray.init(
                        num_cpus=2,
                        include_dashboard=False,
                        object_store_memory=200 * 1024 * 1024,
                        log_to_driver=False,
                        _metrics_export_port=metrics_port,
                    )
                    break
                except Exception:  # Ray gives its raylet a fixed 30 s to register: a busy machine can miss it
                    ray.shutdown()
                    self._kill_leftovers(grace_s=5)
                    if attempt == START_ATTEMPTS - 1:
                        raise
            http = {"host": "127.0.0.1", "port": port}
            if self.request_timeout_s is not None:
                http["request_timeout_s"] = self.request_timeout_s
            serve.start(http_options=http)
        except BaseException:
            self.close()
            raise
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Serve and Ray down (bounded), then SIGKILL whatever process of our RAY_TMPDIR is left."""
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
        self._kill_leftovers(grace_s=30)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def _kill_leftovers(self, grace_s: float) -> None:
        kill_leftovers(self.ray_tmp, grace_s)

    # 1. Deploying and scaling -----------------------------------------------------------------------------------

    def deploy(self, args: dict, policy_replicas: int = 1) -> None:
        """(Re)deploy the app with `args`; a changed `policy_replicas` alone scales the Policy in place."""
        from ray import serve
        from ray.serve.schema import ServeDeploySchema

        app = {
            "name": APP,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": args,
            "deployments": [{"name": "Policy", "num_replicas": policy_replicas}],
        }
        # the call `serve deploy <config>` ends in (what tests/cluster does too)
        serve.context._get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))
        self.wait_replicas("Policy", policy_replicas, DEPLOY_TIMEOUT_S)
        self.wait_healthy(DEPLOY_TIMEOUT_S)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answers 200 (TimeoutError past `timeout_s`)."""
        t0 = time.monotonic()
        last: object = None
        with httpx.Client(timeout=10, trust_env=False) as client:
            while time.monotonic() - t0 < timeout_s:
                try:
                    last = client.get(self.url + "/health")
                    if last.status_code == 200:
                        return time.monotonic() - t0
                except httpx.HTTPError as exc:
                    last = exc
                time.sleep(0.5)
        raise TimeoutError(f"/health not 200 within {timeout_s} s (last: {last!r})")

    def wait_replicas(self, deployment: str, n: int, timeout_s: float) -> float:
        """Seconds until `deployment` has exactly `n` replicas, all RUNNING."""
        from ray import serve

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            status = serve.status().applications.get(APP)
            if status is not None and deployment in status.deployments:
                counts = {str(k): v for k, v in status.deployments[deployment].replica_states.items()}
                running = sum(v for k, v in counts.items() if k.endswith("RUNNING"))
                if running == n and sum(counts.values()) == n:
                    return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"{deployment} did not reach {n} running replicas within {timeout_s} s")

    # 2. Replicas -------------------------------------------------------------------------------------------------

    def replicas(self, deployment: str | None = None) -> list[str]:
        """Names of our app's replica actors (all deployments unless one is named), from the GCS's named actors."""
        import ray

        prefix = f"SERVE_REPLICA::{APP}#" + (f"{deployment}#" if deployment else "")
        named = ray.util.list_named_actors(all_namespaces=True)
        return sorted(a["name"] for a in named if a["namespace"] == "serve" and a["name"].startswith(prefix))

    def kill_one(self, deployment: str) -> str:
        """`ray.kill` one replica of `deployment` (no restart: Serve's controller replaces it); its actor name."""
        import ray

        names = self.replicas(deployment)
        if not names:
            raise RuntimeError(f"no {deployment} replica to kill")
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        return names[0]

    def rss(self) -> dict[str, int]:
        """RSS bytes of our replica and proxy processes (label `Deployment/pid`), read through psutil.

        The processes are the children of our own raylet (the one whose command line names our RAY_TMPDIR), found
        by their process titles (`ray::ServeReplica:<app>:<Deployment>[.method]`, `ray::ProxyActor`), so another
        Ray on the machine is never measured.
        """
        import psutil

        out = {}
        for raylet in (p for p in pids_using(self.ray_tmp) if _is_raylet(p)):
            try:
                children = psutil.Process(raylet).children()
            except psutil.Error:
                continue
            for child in children:
                try:
                    title = " ".join(child.cmdline())
                    rss = child.memory_info().rss
                except psutil.Error:
                    continue  # a replica that just died
                label = _replica_label(title)
                if label:
                    out[f"{label}/{child.pid}"] = rss
        return out

    def policy_stats(self, replicas: int, timeout_s: float = 60.0) -> dict[str, dict]:
        """Every Policy replica's session-store stats (live, bytes, evictions, ...), by replica actor name.

        Each replica actor is asked for the routing keys it holds (`record_routing_stats`, the hook the session
        router polls; a private Serve actor method, as the replica names are); then its `stats` is called through a
        Serve handle routed by one of those keys, which the session router sends to that replica. A replica holding
        no session reports zeros. `replicas` is the count expected (fewer answers are returned as they are).
        """
        import ray
        from ray import serve

        handle = serve.get_deployment_handle("Policy", APP)
        out: dict[str, dict] = {}
        for name in self.replicas("Policy")[: max(replicas, 1) * 4]:
            actor = ray.get_actor(name, namespace="serve")
            report = ray.get(actor.record_routing_stats.remote(), timeout=timeout_s) or {}
            keys = list(report.get("session_keys") or [])
            if not keys:
                out[name] = {"live": 0, "bytes": 0}
                continue
            out[name] = handle.options(session_id=keys[0]).stats.remote().result(timeout_s=timeout_s)
        return out

    # 3. Metrics --------------------------------------------------------------------------------------------------

    def metric_sum(self, metric: str, labels: dict[str, str] | None = None) -> float | None:
        """Sum of a metric over our node's Prometheus endpoint (None when not exported yet); the node is ours alone."""
        try:
            text = httpx.get(self.metrics_url, timeout=10, trust_env=False).text
        except httpx.HTTPError:
            return None
        values = prometheus_values(text, metric, labels)
        return sum(v for _, v in values) if values else None

    def metric_by_replica(self, metric: str) -> dict[str, float]:
        try:
            text = httpx.get(self.metrics_url, timeout=10, trust_env=False).text
        except httpx.HTTPError:
            return {}
        return {lab.get("replica", "?"): v for lab, v in prometheus_values(text, metric)}

    def metric_lines(self, word: str) -> list[str]:
        """The endpoint's lines mentioning `word` (for the record when a gauge is missing)."""
        try:
            text = httpx.get(self.metrics_url, timeout=10, trust_env=False).text
        except httpx.HTTPError as exc:
            return [repr(exc)]
        return [line for line in text.splitlines() if word in line and not line.startswith("#")][:20]
