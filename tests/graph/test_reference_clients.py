"""The OpenPI WebSocket door as each reference server's clients use it, unchanged (in-process, no Ray).

- upstream DreamZero's `eval_utils` client: builds its `PolicyServerConfig` dataclass from the handshake (any extra
  key is a TypeError), sends `endpoint: "infer"` / `"reset"`, reads the bare packed array and returns the reset text;
- vLLM-Omni's DreamZero example (path `/v1/realtime/robot/openpi`): no `endpoint` key, `np.asarray(reply, float32)`,
  reset answered with msgpack `{"status": "reset successful"}`;
- openpi-style clients that want `{"actions": ...}` opt in with `response_format=dict` (query or message key).

Plus the opt-ins of our own: the extended handshake and a resumed connection continuing its session.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from starlette.websockets import WebSocketDisconnect

from deployments.requests import openpi as openpi_frames
from dreamzero_client.wire import openpi
from tests.support.ingress import KEY
from tests.support.observations import openpi_droid_observation

WS_HEADERS = {"Authorization": f"Api-Key {KEY}"}
VLLM_PATH = "/v1/realtime/robot/openpi"


@dataclasses.dataclass
class PolicyServerConfig:
    """The reference's dataclass, field for field: a client does `PolicyServerConfig(**handshake)`."""

    image_resolution: tuple[int, int] = (180, 320)
    needs_wrist_camera: bool = True
    n_external_cameras: int = 2
    needs_stereo_camera: bool = False
    needs_session_id: bool = True
    action_space: str = "joint_position"


def _recv(ws):
    return openpi.unpack_frame(ws.receive_bytes())[0]


def _obs(session_id: str, seed: int = 0) -> dict:
    obs = openpi_droid_observation(seed, session_id)
    obs.pop("endpoint", None)
    return obs


@pytest.mark.parametrize("path", ["/", VLLM_PATH])
def test_the_handshake_builds_the_reference_dataclass_on_both_paths(door, path):
    with door.client.websocket_connect(path, headers=WS_HEADERS) as ws:
        handshake = _recv(ws)
    cfg = PolicyServerConfig(**handshake)  # an extra key would be a TypeError
    assert set(handshake) == set(openpi_frames.HANDSHAKE_KEYS)
    assert (cfg.image_resolution, cfg.n_external_cameras, cfg.needs_wrist_camera) == ([180, 320], 2, True)
    assert (cfg.needs_stereo_camera, cfg.needs_session_id, cfg.action_space) == (False, True, "joint_position")


def test_dreamzero_client_infer_is_the_bare_array_and_reset_the_text(door):
    with door.client.websocket_connect("/", headers=WS_HEADERS) as ws:
        PolicyServerConfig(**_recv(ws))
        for seed in range(2):
            ws.send_bytes(openpi.pack_frame({**_obs("ep-1", seed), "endpoint": "infer"}))
            reply = _recv(ws)
            assert isinstance(reply, np.ndarray) and reply.shape == (24, 8) and reply.dtype == np.float32
        ws.send_bytes(openpi.pack_frame({"endpoint": "reset", "session_id": "ep-1"}))
        assert ws.receive_text() == "reset successful"  # the reference client returns what comes back
        ws.send_bytes(openpi.pack_frame({**_obs("ep-1"), "endpoint": "infer"}))
        assert _recv(ws).shape == (24, 8)
    assert door.policy.batches[-1].reset_mask == [True]  # the infer after reset started the session fresh


def test_vllm_omni_client_without_endpoint_gets_an_array_and_a_msgpack_reset(door):
    with door.client.websocket_connect(VLLM_PATH, headers=WS_HEADERS) as ws:
        handshake = _recv(ws)
        assert handshake["image_resolution"] == [180, 320] and handshake["action_space"] == "joint_position"
        ws.send_bytes(openpi.pack_frame(_obs("robot-a")))  # no `endpoint`: infer
        actions = np.asarray(_recv(ws), np.float32)
        assert actions.shape == (24, 8)
        ws.send_bytes(openpi.pack_frame({"endpoint": "reset"}))
        assert _recv(ws) == {"status": "reset successful"}


def test_the_dict_form_is_an_opt_in_by_query_or_by_message(door):
    with door.client.websocket_connect("/?response_format=dict", headers=WS_HEADERS) as ws:
        assert set(_recv(ws)) == set(openpi_frames.HANDSHAKE_KEYS)  # the query changes replies, not the handshake
        ws.send_bytes(openpi.pack_frame(_obs("s")))
        reply = _recv(ws)
        assert reply["actions"].shape == (24, 8) and reply["session"]["step"] == 1 and "timings" in reply
        ws.send_bytes(openpi.pack_frame({**_obs("s", 1), "response_format": "array"}))
        assert isinstance(_recv(ws), np.ndarray)  # the message's own key wins
    with door.client.websocket_connect(VLLM_PATH, headers=WS_HEADERS) as ws:
        _recv(ws)
        ws.send_bytes(openpi.pack_frame({**_obs("t"), "response_format": "dict"}))
        assert _recv(ws)["actions"].shape == (24, 8)


def test_the_extended_handshake_says_the_rest_and_a_resumed_connection_continues(door):
    with door.client.websocket_connect("/?handshake=extended", headers=WS_HEADERS) as ws:
        extended = _recv(ws)
        assert {k: extended[k] for k in openpi_frames.HANDSHAKE_KEYS} == openpi_frames.handshake_config()
        assert (extended["action_horizon"], extended["action_dim"], extended["embodiment"]) == (24, 8, "oxe_droid")
        assert extended["model"] == "dreamzero" and extended["response_formats"] == ["array", "dict"]
        token = extended["resume_token"]
        for seed in range(2):
            ws.send_bytes(openpi.pack_frame({**_obs("arm", seed), "response_format": "dict"}))
            last = _recv(ws)["session"]
    assert last["step"] == 2
    with door.client.websocket_connect(f"{VLLM_PATH}?resume={token}", headers=WS_HEADERS) as ws:
        _recv(ws)
        msg = {**_obs("arm", 2), "response_format": "dict"}
        msg |= {"expected_steps": [last["step"]], "expected_incarnations": [last["incarnation"]]}
        ws.send_bytes(openpi.pack_frame(msg))
        resumed = _recv(ws)["session"]
    assert (resumed["step"], resumed["restarted"], resumed["incarnation"]) == (3, False, last["incarnation"])
    batch = door.policy.batches[-1]
    assert batch.reset_mask == [False] and batch.expected_steps == [2]  # the echo reached the replica


def test_a_plain_connection_frees_its_session_at_close_a_resumable_one_keeps_it(door, monkeypatch):
    dropped: list = []
    monkeypatch.setattr(door.policy, "drop_sessions", lambda ids: dropped.extend(ids) or len(ids))
    for query in ("", "?handshake=extended"):
        with door.client.websocket_connect(f"/{query}", headers=WS_HEADERS) as ws:
            _recv(ws)
            ws.send_bytes(openpi.pack_frame(_obs("x")))
            _recv(ws)
    assert len(dropped) == 1  # only the plain connection's session; the other waits for its client or the TTL


@pytest.mark.parametrize(
    "query, field",
    [("handshake=full", "handshake"), ("response_format=json", "response_format"), ("resume=abc", "resume")],
)
def test_a_bad_query_parameter_is_an_error_frame_naming_it(door, query, field):
    with door.client.websocket_connect(f"/?{query}", headers=WS_HEADERS) as ws:
        err = _recv(ws)
        assert err["type"] == "error" and err["field"] == field and err["status"] == 422
        with pytest.raises(WebSocketDisconnect) as info:
            ws.receive_bytes()
    assert info.value.code == 1008


def test_a_body_that_trickles_past_the_doors_bound_is_a_408(door):
    """Serve's proxy timeout is off in the shipped config (it would end WebSockets), so the door bounds the body."""
    import asyncio
    from types import SimpleNamespace

    from deployments.error_replies import classify
    from dreamzero.errors import RequestTimeout

    http = door.ingress.http
    http.settings = http.settings.model_copy(
        update={"http": http.settings.http.model_copy(update={"request_timeout_s": 0.2})}
    )

    async def trickle():
        yield b"{"
        await asyncio.sleep(30)
        yield b"}"

    request = SimpleNamespace(headers={"content-length": "2"}, stream=trickle)
    with pytest.raises(RequestTimeout, match="http.request_timeout_s"):
        asyncio.run(http.read_body(request))
    assert (classify(RequestTimeout("x")).status, classify(RequestTimeout("x")).code) == (408, "request_timeout")
