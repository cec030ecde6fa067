"""A Ray node holding a Policy replica is lost under load (a two-node cluster on this machine).

The head node holds the proxy, the ingress and the stages (`{"head": ...}` resources) and one Policy replica; a
second node, started with `ray start --address`, holds the other (each Policy replica takes a `policy_slot`: one on
the second node, two on the head, so the replacement fits there). Robots step their sessions through `ActionClient`
(which retries a 503 or a lost connection with the session's continuity echo), two sessions on each replica. Then
every process of the second node is SIGKILLed (raylet, agents, workers: the machine is gone; found by the node's own
temp dir, never `ray stop`). What must hold:

- the sessions that lived on the lost node come back restarted and say so (`new_session`, step 1, on a survivor),
  then continue there;
- the sessions on the head's replica continue untouched: every reply step + 1 with the same incarnation (the model's
  own `window_full` restart aside);
- Serve replaces the lost replica (a new Policy replica runs, on the head);
- no client hangs and none sees an error: every call ends within a bound, answered.

The GCS declares a node dead after `health_check_failure_threshold` failed checks `health_check_period_ms` apart;
both are lowered for the head so that takes ~3 s instead of ~15 s. The driver runs in its own process (a pytest
process may already be connected to another cluster) and writes what it saw as JSON; the test reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support.host import free_port
from tests.support.ray_nodes import two_node_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
APP = "node-loss"
HEAD_ONLY = {"head": 0.01}
ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 32, "ttl_s": 600},
    "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.01},
    "policy": {"num_replicas": 2, "resources": {"policy_slot": 1}},
    **{stage: {"resources": HEAD_ONLY} for stage in ("ingress", "preprocess", "postprocess")},
}
#: the GCS's node health check on the head: a lost node is declared dead after ~3 s
FAST_NODE_DEATH_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
PER_REPLICA = 2  # sessions stepping on each Policy replica
MAX_CANDIDATES = 16  # new sessions tried until each replica holds PER_REPLICA
BEFORE_S, AFTER_S = 4.0, 5.0  # stepping before the kill, and after the replacement runs
REPLACE_TIMEOUT_S = 150
#: each attempt's bound and the retries: a session of the lost node is refused (503) until the routers drop it
ATTEMPT_TIMEOUT_S, MAX_RETRIES = 30.0, 40
#: a call neither answered nor failed within this is a hung client
CALL_BOUND_S = 60.0
DRIVER_TIMEOUT_S = 420
PROMPT = "pick up the cup"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(GCS address, head temp dir, second node's temp dir, work dir) of a private two-node cluster."""
    work = tmp_path_factory.mktemp("node-loss")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "clients" / "dreamzero-client")]),
        "DREAMZERO_CACHE_DIR": str(work / "cache"),
    }
    head = (4, {"head": 1, "policy_slot": 2}, FAST_NODE_DEATH_ENV)
    with two_node_cluster(env, head, (2, {"policy_slot": 1}, {}), prefixes=("rnh", "rnl")) as (address, hd, ld):
        yield address, hd, ld, work


def test_losing_the_node_of_a_policy_replica_restarts_only_its_sessions_flagged(two_nodes):
    address, head_dir, lost_dir, work = two_nodes
    out = work / "driver.json"
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'clients' / 'dreamzero-client'}",
    }
    cmd = [sys.executable, "-m", "tests.cluster.test_node_loss", address, head_dir, lost_dir, str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, timeout=DRIVER_TIMEOUT_S, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())

    # the setup: one Policy replica on each node, PER_REPLICA sessions stepping on each
    before = r["replicas_before"]  # replica id -> node ("head" / "lost")
    assert sorted(before.values()) == ["head", "lost"], before
    lost = next(rid for rid, node in before.items() if node == "lost")
    kept = next(rid for rid, node in before.items() if node == "head")
    homes = r["homes"]  # session id -> replica id of its first reply
    assert Counter(homes.values()) == {lost: PER_REPLICA, kept: PER_REPLICA}, homes
    assert r["killed_processes"] >= 3, r["killed_processes"]  # raylet, agents, the replica's worker at least

    # no client hung or saw an error; every call was bounded
    assert not r["hung"], r["hung"]
    assert not r["failures"], r["failures"]
    slowest = max(call["t1"] - call["t0"] for call in r["calls"])
    assert slowest < CALL_BOUND_S, f"a call took {slowest:.1f} s"

    # the lost replica was replaced by a new one (on the head: the only node left)
    after = r["replicas_after"]
    assert len(after) == 2 and kept in after and lost not in after, (before, after)
    assert all(node == "head" for node in after.values()), after

    killed_at, replaced_at = r["killed_at"], r["replaced_at"]
    print(  # the figures docs/reliability.md quotes (pytest -s shows them)
        f"node loss: {len(r['calls'])} calls, 0 failed, slowest {slowest:.1f} s; node dead after "
        f"{r['dead_at'] - killed_at:.1f} s, replica replaced after {replaced_at - killed_at:.1f} s"
    )
    by_session: dict[str, list[dict]] = {}
    for call in r["calls"]:
        by_session.setdefault(call["sid"], []).append(call)
    for sid, calls in by_session.items():
        calls.sort(key=lambda c: c["t1"])
        assert any(c["t0"] > replaced_at for c in calls), f"{sid} not served after the replacement"
        if homes[sid] == kept:  # untouched: every reply continues the last one, on the same replica
            for prev, cur in zip(calls, calls[1:]):
                assert cur["replica"] == kept, (sid, cur)
                if cur["restart_reason"] == "window_full":
                    assert cur["step"] == 1, (sid, cur)
                    continue
                assert not cur["restarted"], (sid, prev, cur)
                assert (cur["step"], cur["incarnation"]) == (prev["step"] + 1, prev["incarnation"]), (sid, prev, cur)
            continue
        # lost: replies from the dead replica only for calls sent before the kill; the next one restarts, flagged
        assert all(c["t0"] < killed_at for c in calls if c["replica"] == lost), (sid, calls)
        moved = [c for c in calls if c["replica"] != lost]
        assert moved, (sid, calls)
        first = moved[0]
        assert first["restarted"] and first["restart_reason"] == "new_session" and first["step"] == 1, (sid, first)
        for prev, cur in zip(moved, moved[1:]):  # then it continues where it was placed again
            assert cur["replica"] == first["replica"], (sid, cur)
            if cur["restart_reason"] == "window_full":
                assert cur["step"] == 1, (sid, cur)
                continue
            assert (cur["step"], cur["incarnation"], cur["restarted"]) == (
                prev["step"] + 1,
                prev["incarnation"],
                False,
            ), (sid, prev, cur)


# ---------------------------------------------------------------------------------------------------------------------
# The driver, run in its own process
# ---------------------------------------------------------------------------------------------------------------------


def _policy_replicas(labels: dict[str, str]) -> dict[str, str]:
    """Live Policy replicas of the app: replica id (as replies' `served_by` name it) -> node label."""
    import ray

    found = {}
    for actor in ray._private.state.actors(actor_state_name="ALIVE").values():
        name = actor.get("Name") or ""
        if actor["ActorClassName"] == f"ServeReplica:{APP}:Policy" and "#" in name:
            found[name.rsplit("#", 1)[1]] = labels.get(actor["Address"]["NodeID"], "?")
    return found


def _policy_running() -> int | None:
    """RUNNING Policy replicas when every replica of the deployment is running, else None."""
    from ray import serve
    from ray.serve._private.common import ReplicaState

    status = serve.status().applications.get(APP)
    if status is None or "Policy" not in status.deployments:
        return None
    counts = status.deployments["Policy"].replica_states
    running = counts.get(ReplicaState.RUNNING, 0)
    return running if running == sum(counts.values()) else None


def _wait(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what} not within {timeout_s} s")


def _drive(address: str, head_dir: str, lost_dir: str, out: str) -> None:
    import httpx
    import ray
    from ray import serve

    from dreamzero_client.http_client import ActionClient
    from serve_graph.builder import build_app
    from tests.support.ray_nodes import kill_node
    from tests.support.request_builders import droid_raw_observation

    ray.init(address=address, log_to_driver=False, _temp_dir=head_dir)  # the head's raylet, not the one to lose
    labels = {node["NodeID"]: ("head" if "head" in node["Resources"] else "lost") for node in ray.nodes()}
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, proxy_location="HeadOnly")
    serve.run(build_app(ARGS), name=APP, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{http_port}"

    def healthy() -> bool:
        try:
            return httpx.get(base + "/health", timeout=5, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    _wait("/health 200", healthy, 240)
    _wait("2 running Policy replicas", lambda: _policy_running() == 2, 240)
    replicas_before = _wait("both Policy replicas in the actor table", lambda: _policy_replicas(labels), 30)
    origin = time.monotonic()
    now = lambda: time.monotonic() - origin  # noqa: E731

    calls, failures, lock = [], [], threading.Lock()

    def record(sid: str, t0: float, res) -> None:
        call = {"sid": sid, "t0": t0, "t1": now(), "replica": res.response["served_by"]}
        call.update({k: res.sessions[0].get(k) for k in ("step", "incarnation", "restarted", "restart_reason")})
        with lock:
            calls.append(call)

    # sessions started one by one until each replica holds PER_REPLICA (new keys spread by load and hashing)
    robots: dict[str, ActionClient] = {}
    homes: dict[str, str] = {}
    for j in range(MAX_CANDIDATES):
        sid = f"robot-{j}"
        client = ActionClient(
            base, timeout_s=ATTEMPT_TIMEOUT_S, max_retries=MAX_RETRIES, backoff_s=0.5, max_backoff_s=2.0
        )
        t0 = now()
        res = client.generate(droid_raw_observation(1, 1), PROMPT, sid)
        replica = res.response["served_by"]
        if Counter(homes.values())[replica] >= PER_REPLICA:
            client.close()
            continue
        robots[sid], homes[sid] = client, replica
        record(sid, t0, res)
        if len(robots) == 2 * PER_REPLICA:
            break

    stop = threading.Event()

    def robot(sid: str, client: ActionClient) -> None:
        while not stop.is_set():
            t0 = now()
            try:
                res = client.generate(droid_raw_observation(1, 4), PROMPT, sid)
            except Exception as exc:  # noqa: BLE001 - any failure the caller would see
                with lock:
                    failures.append(f"{sid} at {t0:.1f} s, after {now() - t0:.1f} s: {type(exc).__name__}: {exc}"[:400])
                return
            record(sid, t0, res)

    threads = [threading.Thread(target=robot, args=item, daemon=True) for item in robots.items()]
    for t in threads:
        t.start()
    time.sleep(BEFORE_S)
    killed_at = now()
    killed = kill_node(lost_dir)
    lost_nodes = {nid for nid, label in labels.items() if label == "lost"}

    def lost_node_dead() -> bool:
        return not any(node["Alive"] for node in ray.nodes() if node["NodeID"] in lost_nodes)

    _wait("the lost node declared dead", lost_node_dead, 60)
    dead_at = now()

    def replaced() -> dict | None:
        current = _policy_replicas(labels)
        fresh = set(current) - set(replicas_before)
        return current if fresh and len(current) == 2 and _policy_running() == 2 else None

    try:
        replicas_after = _wait("a replacement Policy replica", replaced, REPLACE_TIMEOUT_S)
    except TimeoutError:
        replicas_after = _policy_replicas(labels)
    replaced_at = now()
    time.sleep(AFTER_S)
    stop.set()
    for t in threads:
        t.join(timeout=CALL_BOUND_S + 30)
    hung = [sid for t, sid in zip(threads, robots) if t.is_alive()]
    report = {
        "replicas_before": replicas_before,
        "replicas_after": replicas_after,
        "homes": homes,
        "killed_processes": killed,
        "killed_at": killed_at,
        "dead_at": dead_at,
        "replaced_at": replaced_at,
        "calls": calls,
        "failures": failures,
        "hung": hung,
    }
    Path(out).write_text(json.dumps(report, indent=1))
    for client in robots.values():
        client.close()
    ray.shutdown()  # the test's fixture kills the nodes: serve.shutdown() would wait on the lost one


if __name__ == "__main__":
    _drive(*sys.argv[1:5])
