"""Tenants through every front door, in-process (no Ray): the real ingress (HTTP and OpenPI WebSocket doors), the
ZeroMQ door object, real Preprocess / Postprocess and a real Policy replica with the embedded tiny model.

Three callers use the same session ids: the legacy key (tenant `default`), team-a and team-b. Each gets its own
sessions on every door, a resume token or ZMQ identity of another tenant reaches nothing of its owner's, quotas
answer 429 to the tenant over them only, replies carry the caller's own ids, and the per-tenant counters say who.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments.doors.zmq import ZmqDoor
from deployments.ingress import IngressDeployment
from deployments.policy import PolicyDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from deployments.tenants import key_digest
from dreamzero_client.wire import codec, openpi, rldx
from serve_graph.builder import ingress_settings, policy_settings, zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import LocalHandle, decode, normalised_body
from tests.support.rldx import droid_rldx_observation

GEN = "/v1/actions/generations"
MSGPACK = {"content-type": codec.MSGPACK_CONTENT_TYPE}
LEGACY, A_KEY, B_KEY, C_KEY, R_KEY = "legacy-key", "team-a-key", "team-b-key", "team-c-key", "team-r-key"
ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 16, "ttl_s": 600},
    "api_key": LEGACY,
    "api_keys": {"team-a": key_digest(A_KEY), "team-b": key_digest(B_KEY), "team-q": key_digest("team-q-key"),
                 "team-r": key_digest(R_KEY)},
    "tenants": {"per_tenant": {
        "team-b": {"max_rows_per_request": 2},
        "team-r": {"requests_per_s": 0.01, "burst": 3},
        "team-q": {"max_sessions_per_replica": 2},
    }},
    "zmq": {"port": 5555, "host": "127.0.0.1"},  # the door object only: nothing binds
}  # fmt: skip


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}", **MSGPACK}


@pytest.fixture(scope="module")
def served():
    cfg = parse_app_args(ARGS)
    model = resolve_model(cfg)
    policy = PolicyDeployment(policy_settings(cfg, model))
    handles = [LocalHandle(s) for s in (PreprocessDeployment(), policy, PostprocessDeployment())]
    ingress = IngressDeployment(*handles, ingress_settings(cfg, model))
    zmq = ZmqDoor(ingress.runner, zmq_door_settings(cfg, model))
    counted: list[tuple] = []
    metrics = ingress.runner.metrics
    real_count = metrics.count_tenant
    metrics.count_tenant = lambda *a: counted.append(a) or real_count(*a)  # the one process-wide object
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield SimpleNamespace(client=client, zmq=zmq, policy=policy, ingress=ingress, counted=counted)
    del metrics.count_tenant


def post(served, key: str, ids: list[str], t: int = 1, **kwargs):
    return served.client.post(GEN, content=normalised_body(ids, t=t, **kwargs), headers=bearer(key))


def step(served, key: str, sid: str, expected: tuple | None = None) -> dict:
    """One chunk of session `sid` as `key`'s tenant, echoing (step, incarnation) when given; returns its report."""
    kwargs = {} if expected is None else {"expected_steps": [expected[0]], "expected_incarnations": [expected[1]]}
    resp = post(served, key, [sid], t=1 if expected is None else 4, **kwargs)
    assert resp.status_code == 200, resp.content[:300]
    return decode(resp.content)["sessions"][0]


def test_http_same_id_three_tenants_three_sessions(served):
    store = served.policy.pipeline.store
    first = {key: step(served, key, "arm") for key in (LEGACY, A_KEY, B_KEY)}
    assert all(r["session_id"] == "arm" and r["restart_reason"] == "new_session" for r in first.values())
    assert {"arm", "@team-a/arm", "@team-b/arm"} <= set(store.ids())  # the model sees one id per tenant
    # team-b presenting team-a's exact step and incarnation still reaches only its own session
    a = first[A_KEY]
    stolen = step(served, B_KEY, "arm", (a["step"], a["incarnation"]))
    assert stolen["restarted"] and stolen["restart_reason"] == "step_mismatch" and stolen["session_id"] == "arm"
    mine = step(served, A_KEY, "arm", (a["step"], a["incarnation"]))
    assert (mine["step"], mine["restarted"], mine["incarnation"]) == (2, False, a["incarnation"])
    # the legacy tenant's ids are the model's ids; its `@`-id cannot name team-a's session
    legacy = step(served, LEGACY, "@team-a/arm")
    assert legacy["session_id"] == "@team-a/arm" and legacy["restart_reason"] == "new_session"
    assert "@@team-a/arm" in store.ids()
    assert step(served, A_KEY, "arm", (mine["step"], mine["incarnation"]))["step"] == 3


def test_http_quotas_answer_429_to_their_tenant_only(served):
    resp = post(served, B_KEY, ["r0", "r1", "r2"])
    assert resp.status_code == 429 and "retry-after" not in resp.headers  # waiting cannot fix a size
    err = decode(resp.content)["error"]
    assert err["code"] == "quota_exceeded" and "at most 2 sessions per request" in err["message"]
    statuses = [post(served, R_KEY, [f"rate-{i}"]).status_code for i in range(4)]
    assert statuses == [200, 200, 200, 429]  # a burst of 3, then 1 request per 100 s
    refused = post(served, R_KEY, ["rate-x"])
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "requests_per_s" in decode(refused.content)["error"]["message"]
    assert post(served, A_KEY, ["a-unhurried"]).status_code == 200  # another tenant is unaffected
    assert ("team-r", "http", 429, "quota_exceeded") in served.counted
    assert ("team-a", "http", 200, None) in served.counted


def test_session_quota_is_checked_by_the_replica_and_never_evicts_others(served):
    q = "team-q-key"
    held = [step(served, q, f"q{i}") for i in range(2)]
    legacy = step(served, LEGACY, "steady")
    resp = post(served, q, ["q-third"])
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 500  # the oldest idle q session's TTL
    assert "'team-q' holds 2 live session(s) on this replica" in decode(resp.content)["error"]["message"]
    again = step(served, q, "q0", (held[0]["step"], held[0]["incarnation"]))  # its own sessions go on
    assert not again["restarted"]
    assert not step(served, LEGACY, "steady", (legacy["step"], legacy["incarnation"]))["restarted"]
    served.policy.pipeline.store.drop(["@team-q/q1"])  # one ends: room again
    assert post(served, q, ["q-third"]).status_code == 200


def test_websocket_resume_token_of_another_tenant_reaches_nothing(served):
    url = "/v1/realtime/robot/openpi?handshake=extended"
    infer = lambda ws, seed: (  # noqa: E731
        ws.send_bytes(openpi.pack_frame({**openpi_droid_observation(seed, "cam"), "response_format": "dict"})),
        openpi.unpack_frame(ws.receive_bytes())[0],
    )[1]
    with served.client.websocket_connect(url, headers={"Authorization": f"Api-Key {A_KEY}"}) as ws:
        token = openpi.unpack_frame(ws.receive_bytes())[0]["resume_token"]
        assert [infer(ws, s)["session"]["step"] for s in (0, 1)] == [1, 2]
    resume = f"/v1/realtime/robot/openpi?resume={token}"
    with served.client.websocket_connect(resume, headers={"Authorization": f"Api-Key {B_KEY}"}) as ws:
        openpi.unpack_frame(ws.receive_bytes())
        other = infer(ws, 2)["session"]
        assert other["step"] == 1 and other["restart_reason"] == "new_session"
        assert other["session_id"] == f"ws-{token}:cam"  # the door's id, never the tenant's prefix
    with served.client.websocket_connect(resume, headers={"Authorization": f"Api-Key {A_KEY}"}) as ws:
        openpi.unpack_frame(ws.receive_bytes())
        back = infer(ws, 3)["session"]
        assert back["step"] == 3 and not back["restarted"]  # team-a's session was never touched
    with pytest.raises(WebSocketDisconnect) as info:
        with served.client.websocket_connect(url, headers={"Authorization": "Api-Key team-z"}) as ws:
            ws.receive_bytes()
    assert info.value.code == 1008
    assert ("unauthenticated", "openpi_ws", 401, "unauthorized") in served.counted


def test_websocket_quota_error_frame_says_when_to_retry(served):
    with served.client.websocket_connect("/", headers={"Authorization": f"Api-Key {R_KEY}"}) as ws:
        openpi.unpack_frame(ws.receive_bytes())
        frames = []
        for seed in range(4):
            ws.send_bytes(openpi.pack_frame(openpi_droid_observation(seed, "ws-b")))
            frames.append(openpi.unpack_frame(ws.receive_bytes())[0])
        err = frames[-1]
        assert openpi.is_error_frame(err) and err["status"] == 429 and err["code"] == "quota_exceeded"
        assert err["retry_after_s"] > 0


def zmq_call(served, token: str, identity: bytes, endpoint: str, data: dict | None = None):
    msg = {"endpoint": endpoint, "api_token": token, **({"data": data} if data is not None else {})}
    return rldx.unpack(asyncio.run(served.zmq.handle(identity, rldx.pack(msg))))


def test_zmq_identity_of_another_tenant_reaches_nothing(served):
    robot = b"robot-7"  # a routing id the client chose: anyone may choose it
    obs = droid_rldx_observation(1, seed=1)
    _, info = zmq_call(served, A_KEY, robot, "get_action", {"observation": obs, "options": {"session_ids": ["arm"]}})
    a = info["sessions"][0]
    assert a["session_id"] == "arm" and a["step"] == 1
    # team-b with team-a's identity: its reset lists nothing of team-a's, and its session is its own
    assert zmq_call(served, B_KEY, robot, "reset", {}) == {"cleared_sessions": []}
    opts = {"session_ids": ["arm"], "expected_steps": [1], "expected_incarnations": [a["incarnation"]]}
    _, info = zmq_call(served, B_KEY, robot, "get_action", {"observation": obs, "options": opts})
    assert info["sessions"][0]["restart_reason"] == "new_session" and info["sessions"][0]["session_id"] == "arm"
    assert zmq_call(served, B_KEY, robot, "reset", {}) == {"cleared_sessions": ["arm"]}
    _, info = zmq_call(served, A_KEY, robot, "get_action", {"observation": obs, "options": opts})
    assert info["sessions"][0]["step"] == 2 and not info["sessions"][0]["restarted"]  # not reset by team-b
    denied = zmq_call(served, "team-z", robot, "ping")
    assert denied["status"] == 401 and denied["code"] == "unauthorized"
    assert ("team-b", "zmq", 200, None) in served.counted


def test_ingress_user_config_rotates_keys_without_a_new_replica(served):
    ingress = served.ingress
    ingress.reconfigure({"api_keys": {"team-a": key_digest("team-a-new"), "team-c": key_digest(C_KEY)}})
    try:
        assert post(served, A_KEY, ["rot"]).status_code == 401  # the old key of team-a is gone
        assert post(served, "team-a-new", ["rot"]).status_code == 200
        assert post(served, C_KEY, ["rot"]).status_code == 200
        assert post(served, LEGACY, ["rot"]).status_code == 200  # the legacy key lives in args: untouched
        assert np.isfinite(decode(post(served, C_KEY, ["rot"], t=4).content)["data"][0]["action"]["values"]).all()
    finally:
        ingress.reconfigure({})  # back to the args' keys
    assert post(served, A_KEY, ["rot-2"]).status_code == 200 and post(served, C_KEY, ["rot"]).status_code == 401
