"""The ingress's FastAPI app in-process (Starlette's TestClient, no Ray): routes, the API-key dependency, the exception
handlers' replies in the request's codec, request counting, and the OpenPI WebSocket adapter's continuity fields.

The real ingress, preprocess and postprocess classes run; only the policy is a stand-in that records its batches
(the `door` fixture: tests/graph/conftest.py over tests/support/ingress.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from ray import exceptions as ray_exc
from ray.serve import exceptions as serve_exc

from deployments.requests import openpi as openpi_frames
from dreamzero_client.wire import codec, openpi
from tests.support.ingress import AUTH, GEN, KEY, MSGPACK
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import decode, normalised_body


def test_one_auth_dependency_guards_generations_metadata_and_models(door):
    for method, path in (("post", GEN), ("get", "/v1/actions/metadata"), ("get", "/v1/models")):
        resp = door.client.request(method, path, headers=MSGPACK)
        assert resp.status_code == 401, path
        assert decode(resp.content)["error"]["code"] == "unauthorized"  # msgpack in, msgpack error out
    assert door.client.get("/v1/models", headers={"Authorization": "Api-Key wrong"}).status_code == 401
    assert door.client.get("/v1/models", headers={"Authorization": f"Api-Key {KEY}"}).json()["data"][0]["id"]
    assert door.client.get("/v1/actions/metadata", headers=AUTH).json()["openpi"]["needs_session_id"] is True
    assert door.client.get("/health").json()["status"] == "ok"  # health and liveness need no key
    assert door.client.get("/healthz").json() == {"status": "ok"}
    assert door.counted == [(401, "unknown")]


def test_generations_reply_and_errors_in_the_request_codec(door):
    ok = door.client.post(GEN, content=normalised_body(["a"]), headers={**AUTH, **MSGPACK})
    assert ok.status_code == 200 and ok.headers["content-type"] == codec.MSGPACK_CONTENT_TYPE
    assert decode(ok.content)["served_by"] == "fake-replica"

    bad = decode(normalised_body(["b"]))
    bad["input"]["observation"]["state"] = np.zeros((1, 1, 5), np.float32)
    resp = door.client.post(GEN, content=codec.encode_msgpack(bad), headers={**AUTH, **MSGPACK})
    assert resp.status_code == 422 and decode(resp.content)["error"]["field"] == "input.observation.state"

    resp = door.client.post(GEN, content=b"{}", headers={**AUTH, "content-type": "text/plain"})
    assert resp.status_code == 415 and resp.json()["error"]["code"] == "unsupported_media_type"
    resp = door.client.post(GEN, content=b"x" * (1024 * 1024 + 1), headers={**AUTH, **MSGPACK})
    assert resp.status_code == 413
    assert door.counted == [(200, "normalised"), (422, "unknown"), (415, "unknown"), (413, "unknown")]


@pytest.mark.parametrize(
    "failure, status, code",
    [
        (serve_exc.BackPressureError(num_queued_requests=3, max_queued_requests=2), 503, "no_capacity"),
        (ray_exc.RayTaskError("generate", "traceback", RuntimeError("secret")).as_instanceof_cause(), 500,
         "internal_error"),
        (RuntimeError("secret"), 500, "internal_error"),
    ],
)  # fmt: skip
def test_graph_failures_map_through_the_table(door, failure, status, code):
    door.policy.fail_with = failure
    resp = door.client.post(GEN, content=normalised_body(["c"], flavour=codec.JSON), headers=AUTH)
    assert resp.status_code == status and resp.json()["error"]["code"] == code
    assert "secret" not in resp.text and "Traceback" not in resp.text
    if status == 503:
        assert int(resp.headers["retry-after"]) >= 1
    assert door.counted == [(status, "normalised")]  # parsed before it failed: the form is known
    health = door.client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "not_ready"


def test_a_bug_in_the_front_door_is_a_plain_500(door, monkeypatch):
    async def broken(req, t0):
        raise KeyError("internals")

    monkeypatch.setattr(door.ingress.http, "answer", broken)
    resp = door.client.post(GEN, content=normalised_body(["d"], flavour=codec.JSON), headers=AUTH)
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "Internal inference error"


def test_websocket_sends_the_last_step_and_incarnation_of_its_session(door):
    headers = {"Authorization": f"Api-Key {KEY}"}
    with door.client.websocket_connect("/v1/realtime/robot/openpi", headers=headers) as ws:
        assert openpi.unpack_frame(ws.receive_bytes())[0]["action_space"] == "joint_position"
        replies = []
        for seed in range(3):
            ws.send_bytes(openpi.pack_frame({**openpi_droid_observation(seed, "ep"), "response_format": "dict"}))
            replies.append(openpi.unpack_frame(ws.receive_bytes())[0])
        assert [r["session"]["step"] for r in replies] == [1, 2, 3]
        assert all(r["served_by"] == "fake-replica" and r["actions"].shape == (24, 8) for r in replies)
        first, second, third = door.policy.batches  # what preprocess handed the policy
        assert first.reset_mask == [True] and first.expected_steps is None and first.expected_incarnations is None
        inc = replies[0]["session"]["incarnation"]
        assert (second.expected_steps, second.expected_incarnations) == ([1], [inc])
        assert (third.expected_steps, third.expected_incarnations) == ([2], [inc])
        ws.send_bytes(openpi.pack_frame({"endpoint": "reset"}))
        assert openpi.unpack_frame(ws.receive_bytes())[0] == openpi_frames.OPENPI_RESET_REPLY
        ws.send_bytes(openpi.pack_frame({"session_id": "ep", "prompt": "x"}))  # no observation: an error frame
        err = openpi.unpack_frame(ws.receive_bytes())[0]
        assert err["type"] == "error" and err["status"] == 422 and err["field"].startswith("observation/")


def test_websocket_without_the_key_is_refused(door):
    from starlette.websockets import WebSocketDisconnect

    with pytest.raises(WebSocketDisconnect) as info:
        with door.client.websocket_connect("/") as ws:
            ws.receive_bytes()
    assert info.value.code == 1008
