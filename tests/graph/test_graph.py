"""The serving graph end to end in local testing mode: both request forms, sessions, errors, health, metadata."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero_client.wire import codec
from tests.support.request_builders import content_type, decode, normalised_body, post_generation, raw_body


def call(graph, body: bytes, flavour: str = codec.OPENPI, ctype: str | None = None):
    """(status, content type, decoded reply) of one generation over the HTTP door."""
    return post_generation(graph, body, ctype or content_type(flavour))


def test_raw_form_returns_robot_actions(graph):
    # raw DROID observations (3 cameras at 180x320, joint + gripper state) -> absolute joint targets + gripper
    status, reply_type, resp = call(graph, raw_body(["raw-0"]))
    assert status == 200, resp
    assert reply_type == "application/msgpack"
    values = np.asarray(resp["data"][0]["action"]["values"], np.float32)
    assert values.shape == (1, 24, 8) and resp["data"][0]["action"]["shape"] == [1, 24, 8]
    assert resp["form"] == "raw"
    assert resp["sessions"][0] == {
        "session_id": "raw-0", "step": 1, "restarted": True, "restart_reason": "new_session",
        "frame_position": resp["sessions"][0]["frame_position"],
        "incarnation": resp["sessions"][0]["incarnation"],
        # the fleet's echo (docs/fleet.md): no observed_at sent, so the server's receive time
        "observed_at": resp["sessions"][0]["observed_at"], "observed_at_source": "server",
        "server_ms": resp["sessions"][0]["server_ms"], "traffic_class": "realtime",
    }  # fmt: skip
    assert isinstance(resp["sessions"][0]["incarnation"], str) and len(resp["sessions"][0]["incarnation"]) == 12
    assert {"preprocess", "policy", "postprocess", "decode"} <= set(resp["timings"])


@pytest.mark.parametrize("flavour", [codec.OPENPI, codec.MSGPACK_NUMPY, codec.JSON])
def test_normalised_form_answers_padded_chunk_in_the_clients_flavour(graph, flavour):
    body = normalised_body([f"n-{flavour}-0", f"n-{flavour}-1"], flavour=flavour)
    status, reply_type, resp = call(graph, body, flavour)
    assert status == 200, resp
    assert reply_type == codec.content_type_for(flavour)
    values = resp["data"][0]["action"]["values"]
    if flavour != codec.JSON:
        assert isinstance(values, np.ndarray) and values.dtype == np.float32
    assert np.asarray(values).shape == (2, 24, 32)
    assert resp["form"] == "normalised"
    assert "preprocess" not in resp["timings"]  # the normalised form skips pre/post
    assert [s["session_id"] for s in resp["sessions"]] == [f"n-{flavour}-0", f"n-{flavour}-1"]


def test_session_continuity_reset_and_expected_step(graph):
    sid = "continuity"
    steps = []
    for t in (1, 4):
        status, _, resp = call(graph, normalised_body([sid], t=t))
        assert status == 200
        steps.append(resp["sessions"][0])
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[1]["restarted"] is False
    # the client believes the session is at step 7: the replica restarts it and says why
    _, _, resp = call(graph, normalised_body([sid], t=4, expected_steps=[7]))
    assert resp["sessions"][0]["restarted"] and resp["sessions"][0]["restart_reason"] == "step_mismatch"
    assert resp["sessions"][0]["step"] == 1
    _, _, resp = call(graph, normalised_body([sid], t=4, expected_steps=[1]))
    assert resp["sessions"][0]["restarted"] is False and resp["sessions"][0]["step"] == 2
    _, _, resp = call(graph, normalised_body([sid], t=4, reset_mask=[True]))
    assert resp["sessions"][0]["restart_reason"] == "reset_requested"


def test_raw_response_format_and_list_output(graph):
    body = normalised_body(["fmt"], flavour=codec.JSON, response_format="raw", output_format="list")
    status, _, resp = call(graph, body, codec.JSON)
    assert status == 200, resp
    assert set(resp) >= {"request_id", "actions", "parameters", "sessions", "timings", "form"}
    assert isinstance(resp["actions"], list) and np.asarray(resp["actions"]).shape == (1, 24, 32)


@pytest.mark.parametrize(
    "body, ctype, status, field",
    [
        (b"\xc1\xc1", "application/msgpack", 400, None),
        (b"{not json", "application/json", 400, None),
        (b"{}", "text/plain", 415, None),
        (codec.encode_json({"input": {"prompt": ["x"], "observation": {}}}), "application/json", 422,
         "parameters.session_ids"),
    ],
)  # fmt: skip
def test_bad_requests_get_mapped_4xx_without_touching_the_graph(graph, body, ctype, status, field):
    got, _, reply = call(graph, body, ctype=ctype)
    assert got == status
    err = reply["error"]
    assert "Traceback" not in err["message"]
    if field:
        assert err["field"] == field
    ok, _, _ = call(graph, normalised_body(["still-serving"]))
    assert ok == 200


def test_wrong_observation_shape_names_the_field(graph):
    body = raw_body(["bad-shape"])
    obj = decode(body)
    obj["input"]["observation"]["state.joint_position"] = np.zeros((1, 5), np.float32)
    status, _, resp = call(graph, codec.encode_msgpack(obj))
    assert status == 422
    assert resp["error"]["field"] == "state.joint_position"


def test_health_and_metadata(graph):
    assert graph.get("/health").json()["status"] == "ok"
    meta = graph.get("/v1/actions/metadata").json()
    assert meta["action_horizon"] == 24 and meta["action_dim"] == 8 and meta["padded_action_dim"] == 32
    assert meta["openpi"]["image_resolution"] == [180, 320] and meta["openpi"]["needs_session_id"] is True
    models = graph.get("/v1/models").json()["data"][0]
    # what the Policy replica settled at start: batching.max_batch_rows auto on a plain CPU is 32, capped by the
    # graph's sessions.max_sessions (8); no byte budget without device memory to fit
    assert (models["max_batch_rows"], models["session_budget_bytes"], models["device"]) == (8, None, None)


def test_a_repeated_single_frame_restart_is_logged_once_per_session_at_the_server(graph, caplog):
    """A loop that resends its first call's one frame restarts the session every call: the server says so once."""
    with caplog.at_level("WARNING", logger="dreamzero.serve.graph"):
        reasons = [call(graph, normalised_body(["one-frame"], t=1))[2]["sessions"][0]["restart_reason"]
                   for _ in range(3)]  # fmt: skip
    assert reasons == ["new_session", "single_frame", "single_frame"]
    told = [r.getMessage() for r in caplog.records if "single_frame" in r.getMessage()]
    assert len(told) == 1 and "one-frame" in told[0] and "frames since the last call" in told[0]
