"""The fleet's wire (issue 47, docs/fleet.md) on every front door, in-process (no Ray): the real ingress, doors,
preprocess and postprocess, with a stand-in policy that records the batches it is given. Each door reads
`traffic_class`, `deadline_ms` and `observed_at` (refusing bad ones naming the field), resolves the class of rows
that name none (the tenant's, else realtime for one row and batch for more), hands the model batch its classes and
deadlines, and echoes per row, in the session report it already sends, the observation time the chunk answers, its
source, the server's time and the class served; the doors count each row's chunk latency by class."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments.doors.zmq import ZmqDoor
from deployments.ingress import IngressDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from deployments.tenants import key_digest
from dreamzero_client.wire import codec, openpi, rldx
from serve_graph.builder import ingress_settings, zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.ingress import RecordingPolicy
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import LocalHandle, decode, raw_body
from tests.support.rldx import droid_rldx_observation

GEN = "/v1/actions/generations"
KEYS = {"robots": "key-robots", "farm": "key-farm"}
ARGS = {
    "api_keys": {tenant: key_digest(key) for tenant, key in KEYS.items()},
    "tenants": {"per_tenant": {"farm": {"traffic_class": "batch"}}},
    "zmq": {"port": 5555, "host": "127.0.0.1"},  # the door object only: nothing binds
}
ECHO_KEYS = {"observed_at", "observed_at_source", "server_ms", "traffic_class"}


@pytest.fixture(scope="module")
def doors():
    cfg = parse_app_args(ARGS)
    model = resolve_model(cfg)
    policy = RecordingPolicy()
    handles = [LocalHandle(s) for s in (PreprocessDeployment(), policy, PostprocessDeployment())]
    ingress = IngressDeployment(*handles, ingress_settings(cfg, model))
    zmq = ZmqDoor(ingress.runner, zmq_door_settings(cfg, model))
    observed: list[tuple] = []
    metrics = ingress.runner.metrics
    real_observe = metrics.observe_rows
    metrics.observe_rows = lambda *a: observed.append(a) or real_observe(*a)  # the one process-wide object
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield SimpleNamespace(client=client, zmq=zmq, policy=policy, observed=observed)
    del metrics.observe_rows


def post(doors, ids: list[str], tenant: str = "robots", **fields) -> tuple[int, dict]:
    headers = {"content-type": codec.MSGPACK_CONTENT_TYPE, "Authorization": f"Bearer {KEYS[tenant]}"}
    resp = doors.client.post(GEN, content=raw_body(ids, **fields), headers=headers)
    return resp.status_code, decode(resp.content)


def zmq_call(doors, options: dict, b: int, tenant: str = "robots"):
    data = {"observation": droid_rldx_observation(b, seed=3), "options": options}
    msg = {"endpoint": "get_action", "data": data, "api_token": KEYS[tenant]}
    return rldx.unpack(asyncio.run(doors.zmq.handle(b"client-1", rldx.pack(msg))))


@pytest.mark.parametrize("response_format", ["envelope", "raw"])
def test_http_reads_the_fields_and_echoes_them_per_row(doors, response_format):
    observed_before = len(doors.observed)
    status, reply = post(doors, ["h0", "h1"], traffic_class=["realtime", "batch"], deadline_ms=[250, None],
                         observed_at=[1234.5, None], response_format=response_format)  # fmt: skip
    assert status == 200, reply
    first, second = reply["sessions"]
    assert first["observed_at"] == 1234.5 and first["observed_at_source"] == "client"  # echoed unchanged
    assert second["observed_at_source"] == "server" and abs(second["observed_at"] - 1.7e9) < 1e9  # unix seconds
    assert (first["traffic_class"], second["traffic_class"]) == ("realtime", "batch")
    assert first["server_ms"] == second["server_ms"] >= 0 and first["session_id"] == "h0"  # the report as before
    batch = doors.policy.batches[-1]
    assert batch.traffic_class == ["realtime", "batch"]
    assert batch.deadline_at[1] is None and abs(batch.deadline_at[0] - second["observed_at"] - 0.25) < 1e-6
    door, echo, deadlines = doors.observed[observed_before]  # counted once, by class, with the rows' deadlines
    assert door == "http" and [e["traffic_class"] for e in echo] == ["realtime", "batch"] and deadlines == [250, None]


def test_the_default_class_is_realtime_for_one_row_batch_for_more_and_the_tenants_when_it_sets_one(doors):
    def served_as(ids, tenant="robots", **fields):
        status, reply = post(doors, ids, tenant, **fields)
        assert status == 200, reply
        assert doors.policy.batches[-1].traffic_class == [s["traffic_class"] for s in reply["sessions"]]
        return [s["traffic_class"] for s in reply["sessions"]]

    assert served_as(["d0"]) == ["realtime"]
    assert served_as(["d1", "d2"]) == ["batch", "batch"]
    assert served_as(["d3"], tenant="farm") == ["batch"]  # the tenant's class
    assert served_as(["d4"], tenant="farm", traffic_class="realtime") == ["realtime"]  # the request's field wins


@pytest.mark.parametrize(
    ("field", "value"),
    [("traffic_class", "urgent"), ("deadline_ms", -1), ("deadline_ms", 1e9), ("observed_at", "now")],
)
def test_http_refuses_a_bad_field_with_422_naming_it(doors, field, value):
    status, reply = post(doors, ["bad"], **{field: value})
    assert status == 422 and reply["error"]["field"].startswith(f"parameters.{field}"), reply


def test_the_websocket_echoes_in_the_dict_reply_and_leaves_the_bare_array_as_it_was(doors):
    auth = {"Authorization": f"Bearer {KEYS['robots']}"}
    with doors.client.websocket_connect("/v1/realtime/robot/openpi", headers=auth) as ws:
        openpi.unpack_frame(ws.receive_bytes())  # the handshake
        msg = {**openpi_droid_observation(0, "ws"), "response_format": "dict", "observed_at": 99.0, "deadline_ms": 400}
        ws.send_bytes(openpi.pack_frame(msg))
        reply = openpi.unpack_frame(ws.receive_bytes())[0]
        report = reply["session"]
        echo = [report[k] for k in ("observed_at", "observed_at_source", "traffic_class")]
        assert echo == [99.0, "client", "realtime"]
        assert report["server_ms"] >= 0 and report["step"] == 1  # the session report as before, plus the echo
        assert doors.policy.batches[-1].traffic_class == ["realtime"] and doors.policy.batches[-1].deadline_at[0]

        ws.send_bytes(openpi.pack_frame({**openpi_droid_observation(1, "ws"), "traffic_class": "batch"}))
        bare = openpi.unpack_frame(ws.receive_bytes())[0]
        assert isinstance(bare, np.ndarray) and bare.shape == (24, 8)  # a reference client's reply: unchanged
        assert doors.policy.batches[-1].traffic_class == ["batch"]

        ws.send_bytes(openpi.pack_frame({**openpi_droid_observation(2, "ws"), "traffic_class": "urgent"}))
        error = openpi.unpack_frame(ws.receive_bytes())[0]
        assert error["type"] == "error" and error["status"] == 422 and error["field"].startswith("traffic_class")


def test_zmq_reads_the_options_and_echoes_them_in_its_session_reports(doors):
    action, info = zmq_call(doors, {"session_ids": ["z0", "z1"], "observed_at": [5.0, None], "deadline_ms": 100}, 2)
    assert all(np.shape(v)[0] == 2 for v in action.values())
    first, second = info["sessions"]
    assert (first["session_id"], first["observed_at"], first["observed_at_source"]) == ("z0", 5.0, "client")
    assert second["observed_at_source"] == "server" and {first["traffic_class"], second["traffic_class"]} == {"batch"}
    assert ECHO_KEYS <= set(first) and doors.policy.batches[-1].deadline_at[0] is not None

    _, info = zmq_call(doors, {"session_ids": ["z2"]}, 1)
    assert info["sessions"][0]["traffic_class"] == "realtime"
    refused = zmq_call(doors, {"session_ids": ["z3"], "traffic_class": ["batch", "batch"]}, 1)
    assert refused["status"] == 422 and refused["field"] == "options.traffic_class", refused
