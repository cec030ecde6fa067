"""The ZeroMQ front door on a real single-node Ray cluster, driven by an RLDX-1-shaped REQ client
(tests/support/rldx.py, its own codec), plus the served replay policy over HTTP, the OpenPI WebSocket and
ZMQ, and RTC fields end to end."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from dreamzero.embodiments import get_embodiment
from dreamzero_client.wire import codec, generations
from tests.support.cluster import API_KEY, AUTH, BASE_ARGS
from tests.support.host import free_port
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2
from tests.support.openpi_wire import connect, droid_frame, pack, recv
from tests.support.request_builders import decode, droid_raw_observation
from tests.support.rldx import RldxShapedClient, droid_rldx_observation

pytestmark = pytest.mark.cluster

GEN = "/v1/actions/generations"
MODEL_PORT, REPLAY_PORT, DEADLINE_PORT = free_port(), free_port(), free_port()
MODEL_ARGS = {**BASE_ARGS, "api_key": API_KEY, "zmq": {"port": MODEL_PORT, "host": "127.0.0.1"}}


def wait_for_door(port: int, token: str | None = API_KEY, timeout_s: float = 120.0) -> None:
    """The door binds when its replica starts, which /health (HTTP ingress) does not wait for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        client = RldxShapedClient(port, token, timeout_s=2)
        try:
            if client.call("ping", requires_input=False).get("status") == "ok":
                return
        except Exception:  # noqa: BLE001 - not bound yet (the REQ socket timed out)
            time.sleep(0.5)
        finally:
            client.close()
    raise TimeoutError(f"the ZMQ door on port {port} did not answer within {timeout_s} s")


@pytest.fixture
def model_door(ensure_app):
    ensure_app(MODEL_ARGS, 1)
    wait_for_door(MODEL_PORT)
    return MODEL_PORT


@pytest.fixture(scope="module")
def episode(tmp_path_factory):
    episodes = random_episodes(2, {"observation.state": 8, "action": 8}, seed=5, lengths=[15, 50])
    root = write_v2(tmp_path_factory.mktemp("replay") / "ds", episodes, modality=DROID_MODALITY)
    return str(root), episodes[1]["action"]


def wait_for_replay(http, base: str, timeout_s: float = 120.0) -> None:
    """/health turns 200 while the previous app's replicas still serve; wait until the replay graph answers."""
    deadline, in_a_row = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and in_a_row < 3:
        resp = http.get(base + "/v1/models", headers=AUTH)
        ok = resp.status_code == 200 and resp.json()["data"][0]["config"] == "replay"
        in_a_row = in_a_row + 1 if ok else 0
        time.sleep(0.5)
    if in_a_row < 3:
        raise TimeoutError(f"the replay app did not take over within {timeout_s} s")


def _replay_args(dataset: str, port: int, **zmq) -> dict:
    return {**BASE_ARGS, "policy": {"replay": {"dataset": dataset, "episode": 1, "stride": 8}}, "api_key": API_KEY,
            "zmq": {"port": port, "host": "127.0.0.1", **zmq}}  # fmt: skip


# --- the model behind the door ----------------------------------------------------------------------------------------
def test_rldx_client_ping_modality_action_reset(model_door):
    client = RldxShapedClient(model_door, API_KEY, timeout_s=180)
    try:
        assert client.call("ping", requires_input=False) == {"status": "ok", "message": "Server is running"}
        modality = client.call("get_modality_config", requires_input=False)
        video = modality["video"]["modality_config"]
        assert len(video["delta_indices"]) == 4 and "wrist_image_left" in video["modality_keys"]
        obs = droid_rldx_observation(b=2)
        action, info = client.call("get_action", {"observation": obs, "options": {"session_ids": ["a", "b"]}})
        assert action["action.joint_position"].shape == (2, 24, 7)
        assert action["action.gripper_position"].shape == (2, 24, 1)
        assert [s["restart_reason"] for s in info["sessions"]] == ["new_session", "new_session"]
        assert {"preprocess", "policy", "postprocess"} <= set(info["timings"])
        options = {"session_ids": ["a", "b"], "expected_incarnations": [s["incarnation"] for s in info["sessions"]]}
        _, info = client.call("get_action", {"observation": obs, "options": options})
        assert [s["step"] for s in info["sessions"]] == [2, 2] and not info["sessions"][0]["restarted"]
        assert client.call("reset", {"options": {"session_ids": ["a"]}}) == {"cleared_sessions": ["a"]}
        _, info = client.call("get_action", {"observation": obs, "options": {"session_ids": ["a", "b"]}})
        assert info["sessions"][0]["restart_reason"] == "reset_requested" and not info["sessions"][1]["restarted"]
    finally:
        client.close()


def test_errors_are_replies(model_door):
    bad = RldxShapedClient(model_door, "not-the-key", timeout_s=30)
    good = RldxShapedClient(model_door, API_KEY, timeout_s=30)
    try:
        assert "Unauthorized" in bad.call("ping", requires_input=False)["error"]
        good.send_raw(b"\xc1 garbage \x00")
        assert "msgpack" in good.receive()["error"]
        assert "disabled" in good.call("kill", requires_input=False)["error"]
        assert good.call("ping", requires_input=False)["status"] == "ok"  # the door still serves
    finally:
        bad.close()
        good.close()


def test_two_interleaved_clients_share_the_door(model_door):
    clients = [RldxShapedClient(model_door, API_KEY, timeout_s=180) for _ in range(2)]
    try:
        for i, c in enumerate(clients):  # both requests in flight before either reply is read
            c.send("get_action", {"observation": droid_rldx_observation(seed=i), "options": None})
        infos = [c.receive()[1] for c in reversed(clients)]
        # both said `default_0`: each got its own fresh session, not the other robot's
        assert all(i["sessions"][0]["session_id"] == "default_0" for i in infos)
        assert all(i["sessions"][0]["restart_reason"] == "new_session" for i in infos)
    finally:
        for c in clients:
            c.close()


def test_rtc_action_prefix_reaches_the_pipeline(model_door, http, serve_cluster):
    base = serve_cluster[0]
    client = RldxShapedClient(model_door, API_KEY, timeout_s=180)
    try:
        options = {"session_ids": ["rtc"], "action_prefix": np.zeros((4, 8), np.float32), "rtc_prefix_len": 4}
        _, info = client.call("get_action", {"observation": droid_rldx_observation(), "options": options})
        assert info["sessions"][0]["rtc"] == "client_prefix"
    finally:
        client.close()
    obs = droid_raw_observation(1)
    body = generations.build_request_body(
        obs, ["pick up the cup"], ["rtc-http"], action_prefix=np.zeros((4, 8)), rtc_prefix_len=4, rtc_exec_horizon=8
    )
    headers = {"content-type": codec.content_type_for(codec.OPENPI), **AUTH}
    resp = http.post(base + GEN, content=codec.encode_body(body, codec.OPENPI)[0], headers=headers)
    assert resp.status_code == 200, resp.text
    assert decode(resp.content)["sessions"][0]["rtc"] == "client_prefix"
    bad = generations.build_request_body(obs, ["x"], ["rtc-bad"], rtc_prefix_len=20)  # d > H/2
    resp = http.post(base + GEN, content=codec.encode_body(bad, codec.OPENPI)[0], headers=headers)
    assert resp.status_code in (400, 422) and "rtc_prefix_len" in resp.text


# --- the replay policy on every transport ----------------------------------------------------------------------------
def _expected(recorded: np.ndarray, start: int) -> np.ndarray:
    rows = np.minimum(np.arange(start, start + 24), len(recorded) - 1)
    out = recorded[rows].astype(np.float32)
    out[:, 7:] = get_embodiment("oxe_droid").gripper_rules[0](out[:, 7:])
    return out


def test_replay_over_http_websocket_and_zmq(ensure_app, http, serve_cluster, episode):
    dataset, recorded = episode
    ensure_app(_replay_args(dataset, REPLAY_PORT), 1)
    base = serve_cluster[0]
    wait_for_replay(http, base)
    # HTTP raw form: two calls walk the episode 8 rows at a time
    for start in (0, 8):
        body = generations.build_request_body(droid_raw_observation(1), ["x"], ["replay-http"], response_format="raw")
        resp = http.post(base + GEN, content=codec.encode_body(body, codec.OPENPI)[0],
                         headers={"content-type": codec.content_type_for(codec.OPENPI), **AUTH})  # fmt: skip
        assert resp.status_code == 200, resp.text
        np.testing.assert_allclose(decode(resp.content)["actions"][0], _expected(recorded, start), atol=1e-4)

    # OpenPI WebSocket
    async def ws_run():
        async with connect(base) as ws:
            await recv(ws)  # handshake
            for start in (0, 8, 16):
                await ws.send(pack({"session_id": "ep", "prompt": "x", **droid_frame(seed=start)}))
                actions = await recv(ws)  # the reference reply: the bare action array
                np.testing.assert_allclose(actions, _expected(recorded, start), atol=1e-4)

    asyncio.run(ws_run())

    # ZMQ
    wait_for_door(REPLAY_PORT)
    client = RldxShapedClient(REPLAY_PORT, API_KEY, timeout_s=60)
    try:
        for start in (0, 8):
            action, info = client.call("get_action", {"observation": droid_rldx_observation(), "options": None})
            got = np.concatenate([action["action.joint_position"], action["action.gripper_position"]], -1)[0]
            np.testing.assert_allclose(got, _expected(recorded, start), atol=1e-4)
        assert info["sessions"][0]["step"] == 2
    finally:
        client.close()


def test_deadline_gives_an_error_reply(ensure_app, episode):
    # 1 ms cannot cover three replica round trips: every get_action passes its deadline
    ensure_app(_replay_args(episode[0], DEADLINE_PORT, request_timeout_s=0.001), 1)
    wait_for_door(DEADLINE_PORT)
    client = RldxShapedClient(DEADLINE_PORT, API_KEY, timeout_s=30)
    try:
        reply = client.call("get_action", {"observation": droid_rldx_observation(), "options": None})
        assert "deadline" in reply["error"]
        assert client.call("ping", requires_input=False)["status"] == "ok"
    finally:
        client.close()
