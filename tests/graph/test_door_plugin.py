"""A new door is one module plus its registration (docs/architecture.md, "A new door"): a door written here, registered
with `@register_door`, is built by the real ingress, serves a request through the one request path, and is counted
exactly as the HTTP, OpenPI WebSocket and ZeroMQ doors are (requests by route, the tenant's requests, errors and bytes
under the door's name). In-process (no Ray): the real ingress, doors and stages; the policy records its batches."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.testclient import TestClient

from deployments.doors import DOORS, Door, register_door
from deployments.doors.zmq import ZmqDoor
from deployments.error_replies import classify
from deployments.ingress import IngressDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from deployments.requests.generations import GenerationRequest, validate_normalised
from deployments.requests.rows import RowOptions
from deployments.tenants import DEFAULT_TENANT
from dreamzero_client.wire import codec, openpi, rldx
from serve_graph.builder import ingress_settings, zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.ingress import RecordingPolicy
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import LocalHandle, normalised_body
from tests.support.rldx import droid_rldx_observation

TEST_PATH = "/test/actions"


class JsonLineDoor(Door):
    """The whole of a door: a JSON body `{prompt, session_id, observation (normalised form), options}` in, `{actions,
    session}` out. Its decoder builds the `RowOptions` with the shared readers; everything else is the base's."""

    name = "test_json"
    hosted = True

    def __init__(self, runner, settings, keys):
        super().__init__(runner)

    def decode(self, body: bytes) -> GenerationRequest:
        msg = json.loads(body)
        rows = RowOptions.read([msg["prompt"]], [msg["session_id"]], None, msg.get("options", {}), "options.")
        return GenerationRequest(validate_normalised(msg["observation"], 1), rows, form="normalised")

    def mount(self, app: FastAPI) -> None:
        @app.post(TEST_PATH)
        async def act(request: Request) -> Response:
            body = await request.body()
            try:
                reply = await self.run(self.decode(body), DEFAULT_TENANT)
                out = json.dumps({"actions": reply.actions.tolist(), "session": reply.sessions[0].to_dict()})
                status, code = 200, None
            except Exception as exc:  # noqa: BLE001 - every error through the one table, as the real doors do
                err = classify(exc)
                out, status, code = json.dumps(err.body()), err.status, err.code
            self.count(DEFAULT_TENANT, status, code, route=f"{self.name}/act", form="normalised",
                       received=len(body), sent=len(out))  # fmt: skip
            return Response(out, status_code=status, media_type="application/json")


class Counts:
    """What the doors report to the process-wide metrics, recorded."""

    def __init__(self, metrics, monkeypatch):
        self.tenant: list[tuple] = []
        self.bytes: list[tuple] = []
        self.routes: list[tuple] = []
        monkeypatch.setattr(metrics, "count_tenant", lambda *a: self.tenant.append(a))
        monkeypatch.setattr(metrics, "count_bytes", lambda *a: self.bytes.append(a))
        requests = SimpleNamespace(inc=lambda n, tags: self.routes.append((tags["route"], tags["status"])))
        monkeypatch.setattr(metrics, "requests", requests)

    def clear(self) -> None:
        self.tenant.clear(), self.bytes.clear(), self.routes.clear()


@pytest.fixture
def served(monkeypatch):
    register_door(JsonLineDoor)  # the registration: the ingress built below hosts every registered door
    try:
        cfg = parse_app_args({"zmq": {"port": 5555, "host": "127.0.0.1"}})  # the door object only: nothing binds
        model = resolve_model(cfg)
        policy = RecordingPolicy()
        handles = [LocalHandle(s) for s in (PreprocessDeployment(), policy, PostprocessDeployment())]
        ingress = IngressDeployment(*handles, ingress_settings(cfg, model))
        zmq = ZmqDoor(ingress.runner, zmq_door_settings(cfg, model))
        counts = Counts(ingress.runner.metrics, monkeypatch)
        with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
            yield SimpleNamespace(client=client, zmq=zmq, policy=policy, ingress=ingress, counts=counts)
    finally:
        DOORS.pop(JsonLineDoor.name, None)


def _test_body(**options) -> bytes:
    obs = {"images": np.zeros((1, 1, 8, 8, 3), int).tolist(), "state": np.zeros((1, 64)).tolist(),
           "state_mask": np.ones((1, 64), int).tolist()}  # fmt: skip
    return json.dumps({"prompt": "wipe", "session_id": "t0", "observation": obs, "options": options}).encode()


def test_a_registered_door_is_hosted_and_serves_through_the_one_request_path(served):
    assert isinstance(served.ingress.hosted["test_json"], JsonLineDoor)
    resp = served.client.post(TEST_PATH, content=_test_body(seed=7, rtc_prefix_len=2, expected_steps=[3]))
    assert resp.status_code == 200, resp.content[:300]
    assert np.shape(resp.json()["actions"]) == (1, 24, 32) and resp.json()["session"]["session_id"] == "t0"
    batch = served.policy.batches[-1]  # the shared readers filled the rows; the runner carried them to the batch
    assert (batch.session_ids, batch.seeds, batch.rtc_prefix_len, batch.expected_steps) == (["t0"], [7], [2], [3])

    bad = served.client.post(TEST_PATH, content=_test_body(seed=-1))
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "options.seed"  # the readers name the field


def test_every_door_counts_requests_tenants_and_bytes_the_same(served):
    """One answered request per door -> one request by route, one tenant count under the door's name, its bytes in
    and out; an error reply also counts under its code."""
    c = served.counts

    def one(send) -> tuple[tuple, tuple, tuple]:
        c.clear()
        send()
        assert len(c.tenant) == len(c.bytes) == len(c.routes) == 1, (c.tenant, c.bytes, c.routes)
        return c.tenant[0], c.bytes[0], c.routes[0]

    def http():
        headers = {"content-type": codec.MSGPACK_CONTENT_TYPE}
        assert served.client.post("/v1/actions/generations", content=normalised_body(["h"]), headers=headers).is_success

    def websocket():
        with served.client.websocket_connect("/v1/realtime/robot/openpi") as ws:
            openpi.unpack_frame(ws.receive_bytes())  # the handshake
            ws.send_bytes(openpi.pack_frame(openpi_droid_observation(0, "ws")))
            assert openpi.unpack_frame(ws.receive_bytes())[0].shape == (24, 8)

    def zmq():
        msg = {"endpoint": "get_action", "data": {"observation": droid_rldx_observation(1, seed=3)}}
        action, _ = rldx.unpack(asyncio.run(served.zmq.handle(b"client-1", rldx.pack(msg))))
        assert all(np.shape(v)[0] == 1 for v in action.values())

    def test_door():
        assert served.client.post(TEST_PATH, content=_test_body()).status_code == 200

    for door, send in (("http", http), ("openpi_ws", websocket), ("zmq", zmq), ("test_json", test_door)):
        tenant, sent_bytes, (route, status) = one(send)
        assert tenant == (DEFAULT_TENANT, door, 200, None), tenant
        assert sent_bytes[:2] == (DEFAULT_TENANT, door) and sent_bytes[2] > 0 and sent_bytes[3] > 0, sent_bytes
        assert route.startswith(("/v1/", f"{door}/")) and status == "200", route

    tenant, _, (_, status) = one(lambda: served.client.post(TEST_PATH, content=_test_body(rtc_prefix_len="x")))
    assert tenant == (DEFAULT_TENANT, "test_json", 422, "invalid_observation") and status == "422"


def test_door_names_are_unique():
    class Twin(Door):
        name = "http"

    with pytest.raises(ValueError, match="registered already"):
        register_door(Twin)
    with pytest.raises(TypeError, match="name"):
        register_door(type("Nameless", (Door,), {}))
    assert {"http", "openpi_ws", "zmq"} <= set(DOORS)
