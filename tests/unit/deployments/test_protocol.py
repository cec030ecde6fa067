"""dreamzero_client.wire: request parsing (both forms, errors naming fields), responses, OpenPI frames."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from deployments.preprocess import normalised_batch
from deployments.requests import openpi as openpi_frames
from deployments.requests.generations import parse_generation_request
from deployments.requests.openpi import parse_openpi_request
from deployments.requests.replies import build_response
from dreamzero.errors import InvalidObservation, InvalidRequest
from dreamzero.types import SessionReport
from dreamzero_client.wire import codec, generations, openpi, replies

B = 2


def _rlinf_body(b: int = B) -> dict:
    """What RLinf's DreamZero adapter sends (normalised form, LIBERO-sized canvas shrunk for speed)."""
    return {
        "model": "dreamzero-libero",
        "input": {
            "prompt": [f"task {i}" for i in range(b)],
            "observation": {
                "images": np.zeros((b, 1, 16, 32, 3), np.uint8),
                "state": np.zeros((b, 1, 64), np.float32),
                "state_mask": np.zeros((b, 1, 64), bool),
                "embodiment_id": np.zeros((b,), np.int64),
                "has_lapa_action": np.zeros((b,), bool),
                "is_cotrain_instance": np.zeros((b,), bool),
            },
        },
        "parameters": {
            "session_ids": [f"rlinf-eval-r0-stage0-slot{i}" for i in range(b)],
            "reset_mask": [True] * b,
            "seed": 1140,
        },
        "runtime": {"response_format": "envelope", "output_format": "numpy"},
    }


def _raw_body(b: int = B) -> dict:
    return {
        "input": {
            "prompt": "pick up the cube",
            "observation": {
                "video.exterior_image_1_left": np.zeros((b, 1, 18, 32, 3), np.uint8),
                "state": {"joint_position": np.zeros((b, 1, 7), np.float64)},
            },
        },
        "parameters": {"session_ids": [f"s{i}" for i in range(b)], "expected_steps": [None, 3][:b]},
    }


# 1. Parsing ------------------------------------------------------------------------------------------------------


def test_rlinf_normalised_body_round_trips_through_codec_and_parser():
    data, ctype = codec.encode_body(_rlinf_body(), codec.OPENPI)
    req = parse_generation_request(*codec.decode_body(data, ctype))
    assert req.form == "normalised" and req.batch_size == B and req.flavour == codec.OPENPI
    assert req.rows.reset_mask == [True, True] and req.rows.seeds == [1140, 1140]
    assert req.observation["state"].dtype == np.float32 and req.observation["state_mask"].dtype == bool
    assert req.route_key == "rlinf-eval-r0-stage0-slot0"
    batch = normalised_batch(req)
    assert batch.images.shape == (B, 1, 16, 32, 3) and batch.embodiment_id == [0, 0] and len(batch) == B


def test_raw_body_infers_raw_form_flattens_nested_keys_and_broadcasts_prompt():
    req = parse_generation_request(_raw_body())
    assert req.form == "raw"
    assert set(req.observation) == {"video.exterior_image_1_left", "state.joint_position"}
    assert req.prompts == ["pick up the cube"] * B
    assert req.rows.expected_steps == [None, 3] and req.rows.reset_mask == [False, False]
    with pytest.raises(InvalidRequest, match="normalised"):
        normalised_batch(req)


def test_json_lists_become_arrays_with_canonical_dtypes():
    body = json.loads(codec.encode_json(_rlinf_body()))
    req = parse_generation_request(body, flavour=codec.JSON)
    assert req.observation["images"].dtype == np.uint8
    assert req.observation["state"].dtype == np.float32
    assert req.observation["state_mask"].dtype == bool and req.flavour == codec.JSON


def test_explicit_form_and_options():
    body = _raw_body()
    body["input"]["form"] = "raw"
    body["parameters"].update(routing_key="robot-7", seed=[1, 2], negative_prompts="blurry")
    body["runtime"] = {"response_format": "raw", "output_format": "list"}
    req = parse_generation_request(body)
    assert (req.route_key, req.rows.seeds, req.rows.negative_prompts) == ("robot-7", [1, 2], ["blurry", "blurry"])
    assert (req.response_format, req.output_format) == ("raw", "list")


def _mutate(path: str, value):
    body = _rlinf_body()
    node = body
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return body


@pytest.mark.parametrize(
    "path,value,field,match",
    [
        ("input.observation.state", np.zeros((B, 1, 32), np.float32), "input.observation.state", r"\[B=2, 1, 64\]"),
        ("input.observation.state", np.full((B, 1, 64), "a"), "input.observation.state",
         "float32"),
        ("input.observation.state", np.full((B, 1, 64), np.nan, np.float32), "input.observation.state", "NaN"),
        ("input.observation.state_mask", np.zeros((B, 1, 64), np.float32), "input.observation.state_mask", "bool"),
        ("input.observation.state_mask", KeyError, "input.observation.state_mask", "required"),
        ("input.observation.images", np.zeros((B, 2, 16, 32, 3), np.uint8), "input.observation.images", "T in"),
        ("input.observation.images", np.zeros((B, 1, 16, 32, 4), np.uint8), "input.observation.images", "shape"),
        ("input.observation.images", np.full((B, 1, 2, 2, 3), 300), "input.observation.images", "uint8"),
        ("input.observation.images", [[1, 2], [3]], "input.observation.images", "ragged"),
        ("input.observation.embodiment_id", np.zeros((3,), np.int64), "input.observation.embodiment_id", "int64"),
        ("input.observation.wrist", np.zeros((B, 1)), "input.observation.wrist", "not a key"),
        ("input.observation", [1, 2], "input.observation", "object"),
        ("input.prompt", ["only one"], "input.prompt", "1 entries but the request has 2"),
        ("input.prompt", [1, 2], "input.prompt", "string"),
        ("input.prompt", KeyError, "input.prompt", "required"),
        ("input.form", "latent", "input.form", "one of"),
        ("parameters.session_ids", ["a", "a"], "parameters.session_ids", "twice"),
        ("parameters.session_ids", ["a", ""], "parameters.session_ids", "non-empty"),
        ("parameters.session_ids", KeyError, "parameters.session_ids", "required"),
        ("parameters.session_ids", [], "parameters.session_ids", "at least one"),
        ("parameters.reset_mask", [True], "parameters.reset_mask", "1 entries"),
        ("parameters.reset_mask", ["yes", "no"], "parameters.reset_mask", "true or false"),
        ("parameters.seed", -1, "parameters.seed", "integer"),
        ("parameters.seed", 1.5, "parameters.seed", "integer"),
        ("parameters.expected_steps", ["x", 1], "parameters.expected_steps[0]", "integer"),
        ("parameters.expected_incarnations", [None, 7], "parameters.expected_incarnations[1]", "incarnation"),
        ("parameters.expected_incarnations", ["a"], "parameters.expected_incarnations", "1 entries"),
        ("parameters.routing_key", "", "parameters.routing_key", "non-empty"),
        ("runtime.response_format", "sse", "runtime.response_format", "envelope"),
        ("runtime.output_format", "torch", "runtime.output_format", "numpy"),
        ("model", 3, "model", "string"),
    ],
)  # fmt: skip
def test_each_violation_names_its_field(path, value, field, match):
    with pytest.raises(InvalidObservation, match=match) as info:
        parse_generation_request(_mutate(path, value))
    assert info.value.field == field
    assert field.split("[")[0] in str(info.value)


@pytest.mark.parametrize("body", [[1], {"input": "x"}, {"parameters": {}}, {"input": {}, "parameters": 3}])
def test_structural_errors_are_400(body):
    with pytest.raises(InvalidRequest) as info:
        parse_generation_request(body)
    assert not isinstance(info.value, InvalidObservation)


def test_raw_form_checks_batch_dimension_and_max_batch():
    body = _raw_body()
    body["input"]["observation"]["state"]["joint_position"] = np.zeros((3, 1, 7))
    with pytest.raises(InvalidObservation, match=r"leading batch dimension of 2.*\[3, 1, 7\]") as info:
        parse_generation_request(body)
    assert info.value.field == "input.observation.state.joint_position"
    with pytest.raises(InvalidObservation, match="at most 1"):
        parse_generation_request(_raw_body(), max_batch=1)


def test_normalised_form_accepts_state_without_time_axis_and_images_without_t():
    body = _rlinf_body()
    obs = body["input"]["observation"]
    obs["state"], obs["state_mask"] = obs["state"][:, 0], obs["state_mask"][:, 0]
    obs["images"] = obs["images"][:, 0]
    req = parse_generation_request(body)
    assert req.observation["state"].shape == (B, 1, 64) and req.observation["images"].shape == (B, 1, 16, 32, 3)


# 2. Responses ----------------------------------------------------------------------------------------------------


def _reports(b=B):
    return [SessionReport(f"s{i}", 1, True, "new_session", 2) for i in range(b)]


def test_envelope_response_has_sglang_path_and_our_extras():
    req = parse_generation_request(_rlinf_body())
    actions = np.random.default_rng(0).normal(size=(B, 24, 32)).astype(np.float64)
    resp = build_response(req, actions, _reports(), {"denoise": 12.5})
    assert resp["object"] == "action.generation" and resp["id"].startswith("act_") and resp["model"] == req.model
    action = resp["data"][0]["action"]
    assert action["shape"] == [B, 24, 32] and action["dtype"] == "float32" and action["values"].dtype == np.float32
    assert resp["sessions"][1]["restart_reason"] == "new_session" and resp["timings"] == {"denoise": 12.5}
    assert resp["form"] == "normalised"
    # what RLinf does with it after the wire
    back = codec.decode_msgpack(codec.encode_msgpack(resp))[0]
    np.testing.assert_allclose(back["data"][0]["action"]["values"], actions.astype(np.float32))
    parsed = replies.parse_actions_response(back)
    assert parsed.actions.shape == (B, 24, 32) and parsed.sessions[0]["step"] == 1 and parsed.form == "normalised"


def test_raw_response_format_and_list_output():
    body = _raw_body()
    body["runtime"] = {"response_format": "raw", "output_format": "list"}
    req = parse_generation_request(body)
    resp = build_response(req, np.ones((B, 4, 8)), _reports())
    assert set(resp) >= {"request_id", "actions", "parameters", "sessions", "timings", "form"}
    assert isinstance(resp["actions"], list) and resp["parameters"]["session_ids"] == ["s0", "s1"]
    json.dumps(resp)  # list output is JSON-serialisable as is
    assert replies.parse_actions_response(resp).actions.shape == (B, 4, 8)


def test_build_response_checks_shapes():
    req = parse_generation_request(_rlinf_body())
    with pytest.raises(ValueError, match="B=2"):
        build_response(req, np.ones((3, 4, 8)), _reports())
    with pytest.raises(ValueError, match="one session report"):
        build_response(req, np.ones((B, 4, 8)), _reports(1))


def test_parse_actions_response_rejects_foreign_replies():
    for bad in ({"data": []}, {"foo": 1}, [1], {"actions": [[1], [2, 3]]}):
        with pytest.raises(InvalidRequest):
            replies.parse_actions_response(bad)


def test_build_request_body_is_what_the_parser_accepts():
    obs = {"video.a": np.zeros((1, 1, 2, 2, 3), np.uint8)}
    body = generations.build_request_body(
        obs, ["x"], ["s"], form="raw", reset_mask=[True], seed=3, expected_steps=[None]
    )
    req = parse_generation_request(copy.deepcopy(body))
    assert req.rows.reset_mask == [True] and req.rows.seeds == [3] and req.rows.expected_steps == [None]


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"error": {"code": "invalid_observation", "message": "bad", "field": "x"}, "detail": "bad"},
         ("invalid_observation", "bad", "x")),
        ({"detail": "nope"}, (None, "nope", None)),
        ({"detail": [{"loc": ["body", "input"], "msg": "field required"}]}, (None, "field required", "input")),
        (b"Internal Server Error", (None, "Internal Server Error", None)),
    ],
)  # fmt: skip
def test_parse_error_body(body, expected):
    assert replies.parse_error_body(body) == expected
    assert replies.parse_error_body(replies.error_body("c", "m", "f")) == ("c", "m", "f")


# 3. OpenPI frames ------------------------------------------------------------------------------------------------


def _droid_msg(**extra):
    msg = {
        "observation/exterior_image_0_left": np.zeros((180, 320, 3), np.uint8),
        "observation/joint_position": np.zeros(7),
        "prompt": "put the marker in the cup",
    }
    msg.update(extra)
    return msg


def test_openpi_infer_frame_and_reply_shape_choice():
    msg, flavour = openpi.unpack_frame(openpi.pack_frame(_droid_msg(session_id="ep1", seed=7)))
    req = parse_openpi_request(msg, flavour)
    # no endpoint = infer, answered with the bare array as both DreamZero reference servers do
    assert (req.endpoint, req.session_id, req.rows.seeds[0], req.reply_as_dict) == ("infer", "ep1", 7, False)
    assert parse_openpi_request(msg, flavour, default_dict=True).reply_as_dict is True  # ?response_format=dict
    assert set(req.observation) == {"observation/exterior_image_0_left", "observation/joint_position"}
    assert openpi.OPENPI_DROID_KEY_MAP["observation/exterior_image_0_left"] == "video.exterior_image_1_left"
    assert parse_openpi_request(_droid_msg(endpoint="infer")).reply_as_dict is False
    assert parse_openpi_request(_droid_msg(endpoint="infer", response_format="dict")).reply_as_dict is True
    as_array = parse_openpi_request(_droid_msg(response_format="array"), default_dict=True)
    assert as_array.reply_as_dict is False  # the message's own key wins over the connection's default
    with pytest.raises(InvalidObservation, match="response_format"):
        parse_openpi_request(_droid_msg(response_format="json"))
    assert parse_openpi_request(_droid_msg()).session_id == "default"
    reply = openpi_frames.infer_reply(np.zeros((24, 8)), as_dict=False)
    assert reply.dtype == np.float32 and reply.shape == (24, 8)
    assert openpi_frames.infer_reply(np.zeros((24, 8)), as_dict=True, extra={"x": 1})["x"] == 1


def test_openpi_reset_and_errors():
    assert parse_openpi_request({"endpoint": "reset"}).endpoint == "reset"
    with pytest.raises(InvalidObservation, match="endpoint"):
        parse_openpi_request({"endpoint": "train"})
    with pytest.raises(InvalidObservation, match="prompt") as info:
        parse_openpi_request({"observation/joint_position": np.zeros(7)})
    assert info.value.field == "prompt"
    with pytest.raises(InvalidObservation, match="session_id"):
        parse_openpi_request(_droid_msg(session_id=""))
    with pytest.raises(InvalidRequest, match="map"):
        parse_openpi_request([1, 2])
    with pytest.raises(InvalidRequest, match="text frames"):
        openpi.unpack_frame("hello")


def test_handshake_and_error_frame():
    cfg = openpi_frames.handshake_config()
    assert cfg == {
        "image_resolution": [180, 320], "n_external_cameras": 2, "needs_wrist_camera": True,
        "needs_stereo_camera": False, "needs_session_id": True, "action_space": "joint_position",
    }  # fmt: skip
    assert tuple(cfg) == openpi_frames.HANDSHAKE_KEYS
    plain, extras = openpi_frames.split_server_config({**cfg, "action_horizon": 24, "embodiment": "franka_pnp"})
    assert plain == cfg and extras == {"action_horizon": 24, "embodiment": "franka_pnp"}
    frame = openpi_frames.error_frame("Invalid request payload", code="invalid_request")
    back, _ = openpi.unpack_frame(openpi.pack_frame(frame))
    assert openpi.is_error_frame(back) and back["message"] == "Invalid request payload"
    assert not openpi.is_error_frame({"actions": 1})


def test_openpi_rtc_and_continuity_keys_are_control_keys_with_checked_values():
    prefix = np.zeros((3, 8), np.float32)
    msg = _droid_msg(rtc_prefix_len=[3], rtc_exec_horizon=[8], action_prefix=prefix[None], expected_steps=[2])
    req = parse_openpi_request(openpi.unpack_frame(openpi.pack_frame(msg))[0])
    assert (req.rows.rtc_prefix_len, req.rows.rtc_exec_horizon, req.rows.expected_steps) == ([3], [8], [2])
    assert req.rows.action_prefix[0].shape == (3, 8) and "action_prefix" not in req.observation
    with pytest.raises(InvalidObservation) as err:
        parse_openpi_request(_droid_msg(rtc_prefix_len=[-1]))
    assert err.value.field.startswith("rtc_prefix_len")
    with pytest.raises(InvalidObservation) as err:
        parse_openpi_request(_droid_msg(action_prefix=np.full((1, 2, 8), np.nan, np.float32)))
    assert err.value.field.startswith("action_prefix")
