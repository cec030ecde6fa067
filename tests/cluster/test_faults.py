"""Faults answered promptly on a real cluster: a Preprocess replica killed under raw-form load.

Raw requests take the hop to the Preprocess deployment (`preprocess.placement: replicas`). The replica is killed
(`ray.kill`, no restart: Serve's controller replaces it) while clients step their sessions. Every call must end as a
200 or a retryable 503 within `preprocess.call_timeout_s` plus the model call (never a wait for the trip's bound,
`http.request_timeout_s`, 300 s here), no client hangs, and every client is served again once the replacement runs.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.cluster import APP, BASE_ARGS, wait_replicas
from tests.support.request_builders import decode, raw_body

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GEN = "/v1/actions/generations"
CALL_TIMEOUT_S = 3.0
ARGS = {
    **BASE_ARGS,
    "preprocess": {"placement": "replicas", "call_timeout_s": CALL_TIMEOUT_S},
    "http": {"request_timeout_s": 300},
}
#: a call that is neither answered nor refused within this is the slow wait this test forbids
PROMPT_S = CALL_TIMEOUT_S + 20
#: bound on the first answer after the replacement Preprocess replica runs
SERVED_AGAIN_S = 60


def _preprocess_replicas() -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#Preprocess#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named if a["namespace"] == "serve" and a["name"].startswith(prefix))


def test_a_killed_preprocess_replica_is_a_prompt_503_and_clients_recover(http, serve_cluster, ensure_app):
    import ray

    base = serve_cluster[0]
    ensure_app(ARGS, 1)
    stop, calls, lock = threading.Event(), [], threading.Lock()

    def client(sid: str) -> None:
        step = incarnation = None
        while not stop.is_set():
            body = raw_body(
                [sid],
                t=1 if step is None else 4,
                expected_steps=None if step is None else [step],
                expected_incarnations=None if incarnation is None else [incarnation],
            )
            t0 = time.monotonic()
            resp = http.post(base + GEN, content=body, headers={"content-type": "application/msgpack"})
            with lock:
                calls.append((t0, time.monotonic() - t0, resp.status_code))
            if resp.status_code == 200:
                report = decode(resp.content)["sessions"][0]
                step, incarnation = report["step"], report["incarnation"]
            else:
                assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1, resp.content[:300]
                time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(f"pre-{i}",), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(4)
    (victim,) = _preprocess_replicas()
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    wait_replicas("Preprocess", 1, 120)
    replaced_at = time.monotonic()
    # served again: a 200 for a call sent after the replacement runs (its first call may compile the canvas kernel)
    deadline = replaced_at + SERVED_AGAIN_S
    while time.monotonic() < deadline:
        with lock:
            if any(status == 200 and t0 > replaced_at for t0, _, status in calls):
                break
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=PROMPT_S + 60)
    assert not any(t.is_alive() for t in threads), "a client hung"

    statuses = {status for _, _, status in calls}
    assert statuses <= {200, 503}, statuses  # nothing but answers and retryable refusals
    slowest = max(duration for _, duration, _ in calls)
    assert slowest < PROMPT_S, f"a call took {slowest:.1f} s: not a prompt answer"
    refused = [c for c in calls if c[2] == 503]
    assert refused and all(t0 >= killed_at - PROMPT_S for t0, _, _ in refused), refused  # the kill's, no others
    assert any(status == 200 and t0 > replaced_at for t0, _, status in calls), "not served again"
    assert _preprocess_replicas() != [victim]


def test_an_ingress_killed_under_load_never_surfaces_a_500_to_our_client(serve_cluster, ensure_app):
    """Serve's proxy answers calls in flight on a dead Ingress with a plain-text 500 (Ray 2.60 maps the replica's
    RayActorError to 500; no proxy setting changes it). The design (docs/reliability.md, "Faults"): `ActionClient`
    retries that 500 (and 502/503/504, connection errors) with the session's continuity echo, so a retry either
    continues the session or restarts it flagged (`step_mismatch` when the lost reply had advanced it), never a
    silent reuse, and the caller never sees the 500."""
    import ray

    from dreamzero_client.http_client import ActionClient
    from tests.support.request_builders import droid_raw_observation

    base = serve_cluster[0]
    ensure_app(ARGS, 1)
    stop, reports, failures, lock = threading.Event(), [], [], threading.Lock()

    def robot(sid: str) -> None:
        with ActionClient(base, timeout_s=60, max_retries=30, backoff_s=0.5, max_backoff_s=3.0) as client:
            first = True
            while not stop.is_set():
                try:
                    res = client.generate(droid_raw_observation(1, 1 if first else 4), "pick up the cup", sid)
                except Exception as exc:  # noqa: BLE001 - any failure the caller would see
                    with lock:
                        failures.append(f"{sid}: {type(exc).__name__}: {exc}"[:300])
                    return
                first = False
                with lock:
                    reports.append((sid, res.sessions[0]))

    threads = [threading.Thread(target=robot, args=(f"ing-{i}",), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(4)
    prefix = f"SERVE_REPLICA::{APP}#Ingress#"
    (victim,) = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(prefix)
    ]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    wait_replicas("Ingress", 1, 120)
    replaced = len(reports)
    deadline = time.monotonic() + SERVED_AGAIN_S  # served again: a few answers through the replacement (bounded)
    while len(reports) < replaced + 3 and time.monotonic() < deadline and not failures:
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=200)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not failures, failures  # no 500 (nor anything else) reached the caller
    assert len(reports) >= replaced + 3, "not served again after the replacement"
    last: dict[str, dict] = {}
    for sid, report in reports:  # continuity: continue exactly, or restart and say why
        prev = last.get(sid)
        if report["restarted"]:
            assert report["step"] == 1 and report["restart_reason"], report
        else:
            assert prev is not None and report["step"] == prev["step"] + 1, (sid, prev, report)
            assert report["incarnation"] == prev["incarnation"], (sid, prev, report)
        last[sid] = report
