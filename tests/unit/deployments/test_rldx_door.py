"""The ZMQ front door (deployments/doors/zmq.py) over a real ROUTER socket, in process: real Preprocess and
Postprocess, a Policy deployment serving a recorded LeRobot episode (no weights), stand-in handles instead of Ray."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest

from dreamzero.embodiments import get_embodiment
from dreamzero_client.errors import AuthenticationError, ReplyTimeout
from dreamzero_client.zmq_client import ZmqPolicyClient
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2
from tests.support.rldx import RldxShapedClient, droid_rldx_observation
from tests.support.zmq_door import TOKEN, start_zmq_door


@pytest.fixture(scope="module")
def episode(tmp_path_factory):
    episodes = random_episodes(2, {"observation.state": 8, "action": 8}, seed=3, lengths=[12, 40])
    root = write_v2(tmp_path_factory.mktemp("ds") / "ds", episodes, modality=DROID_MODALITY)
    return root, episodes[1]["action"]


@pytest.fixture(scope="module")
def door(episode):
    door, loop, thread, port, handles = start_zmq_door(episode[0], request_timeout_s=20)
    yield door, port, handles
    loop.call_soon_threadsafe(door.killed.set)
    thread.join(10)
    assert not thread.is_alive()


def test_ping_modality_config_and_replayed_actions(door, episode):
    _, port, _ = door
    _, recorded = episode
    client = RldxShapedClient(port, TOKEN)
    try:
        assert client.call("ping", requires_input=False) == {"status": "ok", "message": "Server is running"}
        modality = client.call("get_modality_config", requires_input=False)
        assert modality["video"]["modality_config"]["delta_indices"] == [-23, -16, -8, 0]
        assert modality["video"]["modality_config"]["modality_keys"] == [
            "exterior_image_1_left", "exterior_image_2_left", "wrist_image_left"]  # fmt: skip
        assert modality["language"]["modality_config"]["modality_keys"] == ["annotation.language.language_instruction"]
        assert len(modality["action"]["modality_config"]["delta_indices"]) == 24

        obs = droid_rldx_observation(b=2)
        action, info = client.call("get_action", {"observation": obs, "options": {"session_ids": ["l", "r"]}})
        assert set(action) == {"action.joint_position", "action.gripper_position"}
        assert (
            action["action.joint_position"].shape == (2, 24, 7) and action["action.joint_position"].dtype == np.float32
        )
        gripper_rule = get_embodiment("oxe_droid").gripper_rules[0]
        for row in range(2):  # the recording comes back through preprocess -> policy -> postprocess
            np.testing.assert_allclose(action["action.joint_position"][row], recorded[:24, :7], atol=1e-4)
            np.testing.assert_array_equal(action["action.gripper_position"][row], gripper_rule(recorded[:24, 7:]))
        assert [s["session_id"] for s in info["sessions"]] == ["l", "r"]
        assert info["sessions"][0]["restart_reason"] == "new_session"
        inc = info["sessions"][0]["incarnation"]
        action, info = client.call("get_action", {"observation": obs, "options": {
            "session_ids": ["l", "r"], "expected_incarnations": [inc, None], "rtc_prefix_len": 2}})  # fmt: skip
        np.testing.assert_allclose(action["action.joint_position"][0], recorded[8:32, :7], atol=1e-4)
        assert info["sessions"][0]["step"] == 2 and not info["sessions"][0]["restarted"]
        assert info["sessions"][0]["rtc"] == "cold_start"  # a recording ignores RTC targets, and says so
        stale = client.call("get_action", {"observation": obs, "options": {
            "session_ids": ["l", "r"], "expected_incarnations": ["0123456789ab", None]}})  # fmt: skip
        assert stale[1]["sessions"][0]["restart_reason"] == "step_mismatch"
    finally:
        client.close()


def test_errors_always_get_a_reply(door):
    _, port, _ = door
    bad = RldxShapedClient(port, "wrong-token")
    good = RldxShapedClient(port, TOKEN)
    try:
        assert "Unauthorized" in bad.call("ping", requires_input=False)["error"]
        good.send_raw(b"\x00\xffnot msgpack")
        assert "msgpack" in good.receive()["error"]
        reply = good.call("kill", requires_input=False)
        assert "disabled" in reply["error"]
        reply = good.call("format", {})
        assert "Unknown endpoint" in reply["error"]
        obs = droid_rldx_observation()
        obs["state.joint_position"] = obs["state.joint_position"][..., :5]
        reply = good.call("get_action", {"observation": obs, "options": None})
        assert reply["field"] == "observation/joint_position" or "joint_position" in reply["error"]
        assert good.call("ping", requires_input=False)["status"] == "ok"  # the socket still works
    finally:
        bad.close()
        good.close()


def test_reset_clears_only_the_callers_sessions(door):
    _, port, _ = door
    a, b = RldxShapedClient(port, TOKEN), RldxShapedClient(port, TOKEN)
    obs = droid_rldx_observation()
    try:
        for c in (a, b):  # both robots use RLDX-1's default id `default_0`; they must not share it
            assert c.call("get_action", {"observation": obs, "options": None})[1]["sessions"][0]["step"] == 1
        assert a.call("reset", {"options": None}) == {"cleared_sessions": ["default_0"]}
        assert a.call("get_action", {"observation": obs, "options": None})[1]["sessions"][0]["restart_reason"] == (
            "reset_requested"
        )
        other = b.call("get_action", {"observation": obs, "options": None})[1]["sessions"][0]
        assert other["step"] == 2 and not other["restarted"]
        assert b.call("reset", {"options": {"session_ids": ["default_0"]}}) == {"cleared_sessions": ["default_0"]}
    finally:
        a.close()
        b.close()


def test_interleaved_clients_get_their_own_replies(door):
    _, port, _ = door
    clients = [RldxShapedClient(port, TOKEN) for _ in range(3)]
    try:
        for i, c in enumerate(clients):  # all in flight before any reply is read
            c.send("get_action", {"observation": droid_rldx_observation(), "options": {"session_ids": [f"c{i}"]}})
        for i, c in reversed(list(enumerate(clients))):
            _, info = c.receive()
            assert info["sessions"][0]["session_id"] == f"c{i}"
    finally:
        for c in clients:
            c.close()


def test_our_client_and_the_deadline(episode):
    door, loop, thread, port, _ = start_zmq_door(
        episode[0], policy_delay_s=3.0, request_timeout_s=0.5, allow_kill=True, max_in_flight=1
    )
    try:
        slow, other = RldxShapedClient(port, TOKEN), RldxShapedClient(port, TOKEN)
        slow.send("get_action", {"observation": droid_rldx_observation(), "options": None})
        time.sleep(0.2)
        busy = other.call("ping", requires_input=False)  # over max_in_flight: refused at once, with a reply
        assert busy["status"] == 503 and "in flight" in busy["error"]
        assert "deadline" in slow.receive()["error"]
        slow.close()
        other.close()
        with ZmqPolicyClient("127.0.0.1", port, timeout_s=20, api_token=TOKEN) as client:
            assert client.ping()
            t0 = time.monotonic()
            with pytest.raises(Exception, match="deadline"):
                client.get_action(droid_rldx_observation(), {"session_ids": ["slow"]})
            assert time.monotonic() - t0 < 2.5  # the error came at the deadline, not after the slow policy
            assert client.get_modality_config()["state"].modality_keys == ["joint_position", "gripper_position"]
        with ZmqPolicyClient("127.0.0.1", port, timeout_s=20, api_token="nope") as client:
            with pytest.raises(AuthenticationError):
                client.ping()
        with ZmqPolicyClient("127.0.0.1", port, timeout_s=20, api_token=TOKEN) as client:
            assert client.call("kill") is None  # allowed here: the door closes
        thread.join(10)
        assert not thread.is_alive()
        with ZmqPolicyClient("127.0.0.1", port, timeout_s=0.3, api_token=TOKEN) as client:
            with pytest.raises(ReplyTimeout):
                client.call("ping")
    finally:
        loop.call_soon_threadsafe(door.killed.set)
        thread.join(10)


def test_oversized_message_is_refused_with_a_reply(episode):
    door, loop, thread, port, _ = start_zmq_door(episode[0], max_message_bytes=4096)
    client = RldxShapedClient(port, TOKEN, timeout_s=5)
    try:
        # over ZMQ_MAXMSGSIZE the peer is disconnected by ZMQ itself; our own check answers what ZMQ lets through
        assert door.zcfg.max_message_bytes == 4096
        reply = asyncio.run_coroutine_threadsafe(door.handle(b"id", b"x" * 5000), loop).result(10)
        assert "exceeds" in msgpack.unpackb(reply)["error"]
        assert client.call("ping", requires_input=False)["status"] == "ok"
    finally:
        client.close()
        loop.call_soon_threadsafe(door.killed.set)
        thread.join(10)
