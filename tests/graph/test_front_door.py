"""The ingress's FastAPI app in-process (Starlette's TestClient, no Ray): routes, the API-key dependency, the exception
handlers' replies in the request's codec, request counting, and the OpenPI WebSocket adapter's continuity fields.

The real ingress, preprocess and postprocess classes run; only the policy is a stand-in that records its batches.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from ray import exceptions as ray_exc
from ray.serve import exceptions as serve_exc
from starlette.testclient import TestClient

from deployments.ingress import IngressDeployment
from deployments.policy import PolicyOutput
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from deployments.requests import openpi as openpi_frames
from dreamzero.types import ChunkResult, ModelBatch, SessionReport
from dreamzero_client.wire import codec, openpi
from serve_graph.builder import ingress_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import LocalHandle, decode, normalised_body

KEY = "front-door-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGPACK = {"content-type": codec.MSGPACK_CONTENT_TYPE}
GEN = "/v1/actions/generations"


class FakePolicy:
    """Zero actions; sessions continue (step + 1, same incarnation) unless the client's expectation differs."""

    def __init__(self):
        self.batches: list[ModelBatch] = []
        self.fail_with: BaseException | None = None
        self.steps: dict[str, tuple[int, str]] = {}

    def generate(self, batch: ModelBatch) -> PolicyOutput:
        self.batches.append(batch)
        if self.fail_with is not None:
            raise self.fail_with
        reports = []
        for sid in batch.session_ids:
            step, inc = self.steps.get(sid, (0, f"inc-{len(self.batches)}"))
            self.steps[sid] = (step + 1, inc)
            reports.append(SessionReport(sid, step + 1, step == 0, "new_session" if step == 0 else None, 1, inc))
        actions = np.zeros((len(batch), 24, 32), np.float32)
        return PolicyOutput(ChunkResult(actions=actions, sessions=reports), "fake-replica")

    def info(self) -> dict:
        return {
            "config_name": "tiny", "action_horizon": 24, "max_action_dim": 32, "max_state_dim": 64,
            "default_seed": 1140, "num_inference_steps": 2,
        }  # fmt: skip

    def ready(self) -> bool:
        if self.fail_with is not None:
            raise self.fail_with
        return True

    def drop_sessions(self, ids):
        return len(ids)


@pytest.fixture
def door(monkeypatch):
    policy = FakePolicy()
    stages = (PreprocessDeployment(), policy, PostprocessDeployment())
    handles = [LocalHandle(stage) for stage in stages]
    cfg = parse_app_args({"api_key": KEY, "http": {"max_body_bytes": 1024 * 1024}})
    ingress = IngressDeployment(*handles, ingress_settings(cfg, resolve_model(cfg)))
    counted: list[tuple[int, str]] = []
    real_count = ingress.http.count

    def counted_call(tenant, status, code=None, **kw):  # the door's one count: note (status, form), then count
        counted.append((status, kw["form"]))
        real_count(tenant, status, code, **kw)

    monkeypatch.setattr(ingress.http, "count", counted_call)
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield SimpleNamespace(client=client, policy=policy, ingress=ingress, counted=counted)


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
