"""`return_video` through every front door, in-process (no Ray): the real ingress, preprocess, postprocess and
Policy replica (the embedded tiny model) behind the HTTP door (both forms, both response formats), the OpenPI
WebSocket and the ZeroMQ door; without the option the replies are what they were."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments.doors.zmq import ZmqDoor
from deployments.ingress import IngressDeployment
from deployments.policy import PolicyDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from dreamzero_client.wire import codec, openpi, replies, rldx
from serve_graph.builder import ingress_settings, policy_settings, zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.observations import openpi_droid_observation
from tests.support.request_builders import LocalHandle, decode, normalised_body, raw_body
from tests.support.rldx import droid_rldx_observation

GEN = "/v1/actions/generations"
MSGPACK = {"content-type": codec.MSGPACK_CONTENT_TYPE}


@pytest.fixture(scope="module")
def served():
    cfg = parse_app_args(
        {
            "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
            "sessions": {"max_sessions": 16},
            "zmq": {"port": 5555, "host": "127.0.0.1"},  # the door object only: nothing binds
        }
    )
    model = resolve_model(cfg)
    policy = PolicyDeployment(policy_settings(cfg, model))
    handles = [LocalHandle(s) for s in (PreprocessDeployment(), policy, PostprocessDeployment())]
    ingress = IngressDeployment(*handles, ingress_settings(cfg, model))
    zmq = ZmqDoor(ingress.runner, zmq_door_settings(cfg, model))
    hw = tuple(policy.pipeline.config.model_input_hw)
    frames = 4 * policy.pipeline.dit_cfg.num_frame_per_block
    with TestClient(ingress.__serve_build_asgi_app__(), raise_server_exceptions=False) as client:
        yield SimpleNamespace(client=client, zmq=zmq, hw=hw, frames=frames)


def post(served, body: bytes) -> dict:
    resp = served.client.post(GEN, content=body, headers=MSGPACK)
    assert resp.status_code == 200, resp.content[:300]
    return decode(resp.content, codec.OPENPI)


@pytest.mark.parametrize("form", ["raw", "normalised"])
def test_http_reply_carries_the_frames_beside_the_actions(served, form):
    make = raw_body if form == "raw" else normalised_body
    ids = [f"{form}-a", f"{form}-b"]
    plain = post(served, make(ids))
    assert "video" not in plain["data"][0] and "model.video" not in plain["timings"]
    for t in (1, 4):  # a restart then a continuing chunk: the same frame count
        resp = post(served, make(ids, t=t, return_video=True, reset_mask=[t == 1] * 2))
        video = resp["data"][0]["video"]
        values = video["values"]
        assert isinstance(values, np.ndarray) and values.dtype == np.uint8
        assert values.shape == (2, served.frames, *served.hw, 3) and video["shape"] == list(values.shape)
        assert "model.video" in resp["timings"] and "action" in resp["data"][0]
        reply = replies.parse_actions_response(resp)
        assert reply.video.shape == values.shape and reply.actions.shape[0] == 2
    raw = post(served, make(ids, t=4, return_video=True, response_format="raw"))
    assert raw["video"]["values"].shape == (2, served.frames, *served.hw, 3)


def test_http_refuses_a_bad_return_video_naming_the_field(served):
    body = decode(normalised_body(["bad"]), codec.OPENPI)
    body["runtime"]["return_video"] = "yes"
    resp = served.client.post(GEN, content=codec.encode_body(body, codec.OPENPI)[0], headers=MSGPACK)
    assert resp.status_code == 422 and decode(resp.content, codec.OPENPI)["error"]["field"] == "runtime.return_video"


def test_websocket_answers_the_dict_form_with_the_frames(served):
    with served.client.websocket_connect("/v1/realtime/robot/openpi") as ws:
        openpi.unpack_frame(ws.receive_bytes())
        ws.send_bytes(openpi.pack_frame({**openpi_droid_observation(0, "ws"), "response_format": "array"}))
        assert isinstance(openpi.unpack_frame(ws.receive_bytes())[0], np.ndarray)  # unchanged: the bare array
        ws.send_bytes(openpi.pack_frame({**openpi_droid_observation(0, "ws"), "response_format": "dict"}))
        assert "video" not in openpi.unpack_frame(ws.receive_bytes())[0]
        for seed in (1, 2):
            ws.send_bytes(openpi.pack_frame({**openpi_droid_observation(seed, "ws"), "return_video": True}))
            reply = openpi.unpack_frame(ws.receive_bytes())[0]
            assert reply["actions"].shape[0] == 24
            assert reply["video"].dtype == np.uint8 and reply["video"].shape == (served.frames, *served.hw, 3)


def test_zmq_door_puts_the_frames_in_the_info(served):
    obs = droid_rldx_observation(2, seed=3)
    opts = {"session_ids": ["z0", "z1"], "return_video": True}
    msg = {"endpoint": "get_action", "data": {"observation": obs, "options": opts}}
    call = lambda: rldx.unpack(asyncio.run(served.zmq.handle(b"client-1", rldx.pack(msg))))  # noqa: E731
    action, info = call()
    assert info["video"].dtype == np.uint8 and info["video"].shape == (2, served.frames, *served.hw, 3)
    msg["data"]["options"] = {"session_ids": ["z0", "z1"]}
    action, info = call()
    assert "video" not in info and all(np.shape(v)[0] == 2 for v in action.values())


def test_merged_requests_keep_their_own_video_rows():
    """Requests merged into one model call: rows of a request that did not ask get no frames back."""
    from deployments.batch_merge import merge_batches, split_result
    from dreamzero.types import ChunkResult, ModelBatch, SessionReport

    def req(ids, video):
        n = len(ids)
        return ModelBatch(images=np.zeros((n, 1, 8, 8, 3), np.uint8), state=np.zeros((n, 1, 64), np.float32),
                          state_mask=np.zeros((n, 1, 64), bool), prompts=["p"] * n, session_ids=ids,
                          return_video=[True] * n if video else None)  # fmt: skip

    merged = merge_batches([req(["a"], False), req(["b", "c"], True)], 1140)
    assert merged.return_video == [False, True, True]
    frames = [None, np.ones((8, 8, 8, 3), np.uint8), np.ones((8, 8, 8, 3), np.uint8)]
    reports = [SessionReport(s, 1, True, "new_session", 1) for s in "abc"]
    plain, asked = split_result(ChunkResult(np.zeros((3, 24, 32), np.float32), reports, video=frames), [1, 2])
    assert plain.video is None and [v.shape for v in asked.video] == [(8, 8, 8, 3)] * 2
    assert merge_batches([req(["x"], False), req(["y"], False)], 1140).return_video is None
