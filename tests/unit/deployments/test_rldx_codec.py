"""The RLDX-1 ZMQ message codec (dreamzero_client.wire.rldx) and the RTC fields of the HTTP wire."""

from __future__ import annotations

import io

import msgpack
import numpy as np
import pytest

from deployments.batch_merge import merge_batches, stack_key
from deployments.preprocess import normalised_batch
from deployments.requests.generations import parse_generation_request
from deployments.requests.rldx import parse_get_action, parse_options, parse_request
from dreamzero.types import ModelBatch
from dreamzero_client.errors import InvalidObservation, InvalidRequest
from dreamzero_client.wire import codec, generations, rldx


def _npy_map(arr: np.ndarray) -> dict:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return {"__ndarray_class__": True, "as_npy": buf.getvalue()}


def test_ndarrays_and_modality_configs_round_trip_with_the_rldx_markers():
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    mc = rldx.ModalityConfig([-23, -16, -8, 0], ["exterior_image_1_left"])
    blob = rldx.pack({"a": arr, "m": mc, "s": ["x"], "n": np.int64(3)})
    # the raw msgpack holds the exact tagged maps an RLDX-1 peer writes and reads
    raw = msgpack.unpackb(blob, raw=False)
    assert raw["a"]["__ndarray_class__"] is True and np.load(io.BytesIO(raw["a"]["as_npy"])).shape == (2, 3, 4)
    assert raw["m"] == {"__ModalityConfig_class__": True, "as_json": {
        "delta_indices": [-23, -16, -8, 0], "modality_keys": ["exterior_image_1_left"], "sin_cos_embedding_keys": None,
        "mean_std_embedding_keys": None, "action_configs": None}}  # fmt: skip
    back = rldx.unpack(blob)
    np.testing.assert_array_equal(back["a"], arr)
    assert back["a"].dtype == np.float32 and back["m"] == mc and back["n"] == 3


def test_pickled_arrays_and_garbage_are_refused():
    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)  # an object array needs pickle to load
    evil = msgpack.packb(
        {"endpoint": "get_action", "data": {"x": {"__ndarray_class__": True, "as_npy": buf.getvalue()}}}
    )
    with pytest.raises(InvalidRequest, match="without pickles"):
        rldx.unpack(evil)
    with pytest.raises(InvalidRequest, match="not a msgpack"):
        rldx.unpack(b"\xc1\xc1garbage")
    with pytest.raises(InvalidRequest, match="as_npy"):
        rldx.unpack(msgpack.packb({"__ndarray_class__": True, "as_npy": "text"}))
    with pytest.raises(InvalidRequest, match="object array"):
        rldx.pack(np.array([object()], dtype=object))


def test_request_envelope():
    req = parse_request({"data": {"observation": {}}, "api_token": "t"})
    assert req.endpoint == "get_action" and req.api_token == "t"  # RLDX-1: a missing endpoint means get_action
    assert parse_request({"endpoint": "ping"}).data == {}
    with pytest.raises(InvalidRequest, match="Unknown endpoint"):
        parse_request({"endpoint": "format_disk"})
    with pytest.raises(InvalidObservation, match="'data' must be a map"):
        parse_request({"endpoint": "reset", "data": [1]})
    with pytest.raises(InvalidRequest, match="a request is a map"):
        parse_request([1, 2])


def _obs(b=2, t=4, lang=True):
    obs = {
        "video.exterior_image_1_left": np.zeros((b, t, 8, 8, 3), np.uint8),
        "state.joint_position": np.zeros((b, t, 7), np.float32) + np.arange(t)[None, :, None],
        "state.gripper_position": np.zeros((b, t, 1), np.float32),
    }
    if lang:
        obs["annotation.language.language_instruction"] = [f"task {i}" for i in range(b)]
    return obs


def test_get_action_observation_and_defaults():
    key = "annotation.language.language_instruction"
    req = parse_get_action({"observation": _obs(), "options": None}, key)
    assert req.language_key == key and req.rows.prompts == ["task 0", "task 1"]
    assert req.observation["state.joint_position"].shape == (2, 7)  # (B, T, D): the current (last) step
    assert float(req.observation["state.joint_position"][0, 0]) == 3.0
    assert req.observation["video.exterior_image_1_left"].shape == (2, 4, 8, 8, 3)
    assert req.rows.session_ids == ["default_0", "default_1"]  # RLDX-1's default ids
    assert req.rows.reset_mask == [False, False] and req.rows.action_prefix is None
    no_lang = parse_get_action({"observation": {**_obs(lang=False), "task": ["a", "b"]}})
    assert no_lang.rows.prompts == ["a", "b"]


def test_get_action_options_rtc_and_continuity():
    prefix = np.ones((4, 8), np.float32)
    opts = parse_options(
        {"session_ids": ["a", "b"], "reset_memory": [True, False], "action_prefix": prefix, "rtc_prefix_len": 4,
         "expected_incarnations": ["abc", None], "expected_steps": [3, None]}, ["", ""])  # fmt: skip
    assert opts.reset_mask == [True, False] and opts.rtc_prefix_len == [4, 4]
    assert len(opts.action_prefix) == 2 and opts.action_prefix[1].shape == (4, 8)
    assert opts.expected_incarnations == ["abc", None] and opts.expected_steps == [3, None]
    per_row = parse_options({"action_prefix": np.ones((2, 3, 8))}, ["", ""])
    assert per_row.action_prefix[0].shape == (3, 8)
    for bad, field in (
        ({"session_ids": ["a"]}, "options.session_ids"),
        ({"reset_memory": [True]}, "options.reset_memory"),
        ({"rtc_prefix_len": -1}, "options.rtc_prefix_len[0]"),
        ({"action_prefix": np.ones((3, 3, 8))}, "options.action_prefix"),
        ({"action_prefix": np.full((4, 8), np.nan)}, "options.action_prefix"),
    ):
        with pytest.raises(InvalidObservation) as err:
            parse_options(bad, ["", ""])
        assert err.value.field == field, (bad, err.value.field)


def test_get_action_shape_errors_name_the_key():
    obs = _obs()
    obs["video.exterior_image_1_left"] = np.zeros((2, 8, 8, 3), np.uint8)
    with pytest.raises(InvalidObservation) as err:
        parse_get_action({"observation": obs})
    assert err.value.field == "observation.video.exterior_image_1_left"
    with pytest.raises(InvalidObservation, match="state"):
        parse_get_action({"observation": {"video.x": np.zeros((1, 1, 2, 2, 3), np.uint8)}})


# --- RTC fields on the HTTP wire ------------------------------------------------------------------------------------


def _http_body(**params):
    obs = {"images": np.zeros((2, 1, 8, 8, 3), np.uint8), "state": np.zeros((2, 1, 64), np.float32),
           "state_mask": np.ones((2, 1, 64), bool)}  # fmt: skip
    return generations.build_request_body(obs, ["a", "b"], ["s0", "s1"], **params)


def test_http_rtc_parameters_parse_per_row_or_broadcast():
    body = _http_body(rtc_prefix_len=4, rtc_exec_horizon=[8, None], action_prefix=[np.ones((4, 32)), None])
    # through the real codec, as a client would send it
    blob, ctype = codec.encode_body(body, codec.OPENPI)
    obj, flavour = codec.decode_body(blob, ctype)
    req = parse_generation_request(obj, flavour)
    assert req.rows.rtc_prefix_len == [4, 4] and req.rows.rtc_exec_horizon == [8, None]
    assert req.rows.action_prefix[0].shape == (4, 32) and req.rows.action_prefix[1] is None
    batch = normalised_batch(req)
    assert batch.rtc_prefix_len == [4, 4] and batch.action_prefix[0].dtype == np.float64
    broadcast = parse_generation_request(_http_body(action_prefix=np.zeros((3, 8))))
    assert [p.shape for p in broadcast.rows.action_prefix] == [(3, 8), (3, 8)]
    json_lists = parse_generation_request(_http_body(action_prefix=[[[0.0] * 8] * 2, [[1.0] * 8] * 3]))
    assert [p.shape for p in json_lists.rows.action_prefix] == [(2, 8), (3, 8)]  # ragged rows as JSON lists


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"rtc_prefix_len": "4"}, "parameters.rtc_prefix_len"),
        ({"rtc_prefix_len": [1, 2, 3]}, "parameters.rtc_prefix_len"),
        ({"rtc_exec_horizon": [1, -2]}, "parameters.rtc_exec_horizon[1]"),
        ({"action_prefix": np.zeros((4, 33))}, "parameters.action_prefix"),
        ({"action_prefix": [np.zeros((4, 8)), np.zeros((4,))]}, "parameters.action_prefix[1]"),
        ({"action_prefix": [np.zeros((4, 8))]}, "parameters.action_prefix"),
        ({"action_prefix": np.array([["a", "b"]])}, "parameters.action_prefix"),
    ],
)
def test_http_rtc_parameters_errors_name_the_field(params, field):
    body = _http_body()
    body["parameters"].update(params)
    with pytest.raises(InvalidObservation) as err:
        parse_generation_request(body)
    assert err.value.field == field


def _batch(ids, rtc=None, gain=False):
    b = len(ids)
    return ModelBatch(
        images=np.zeros((b, 1, 8, 8, 3), np.uint8), state=np.zeros((b, 1, 64), np.float32),
        state_mask=np.ones((b, 1, 64), bool), prompts=["p"] * b, session_ids=list(ids),
        rtc_prefix_len=None if rtc is None else [rtc] * b,
        action_prefix=None if rtc is None else [np.ones((rtc, 8))] * b,
        action_gain=np.full((b, 32), 2.0) if gain else None, action_bias=np.full((b, 32), 1.0) if gain else None,
    )  # fmt: skip


def test_merge_batches_carries_rtc_fields_and_the_action_codec():
    merged = merge_batches([_batch(["a"], gain=True), _batch(["b", "c"], rtc=4, gain=True)], default_seed=1140)
    assert merged.rtc_prefix_len == [None, 4, 4] and merged.rtc_exec_horizon is None
    assert merged.action_prefix[0] is None and merged.action_prefix[2].shape == (4, 8)
    assert merged.action_gain.shape == (3, 32) and merged.action_bias.shape == (3, 32)
    plain = merge_batches([_batch(["a"]), _batch(["b"])], default_seed=1140)
    assert plain.rtc_prefix_len is None and plain.action_gain is None
    # rows with a codec (raw form) and without (normalised form) never stack into one call
    assert stack_key(_batch(["a"], gain=True)) != stack_key(_batch(["a"]))
