"""The ZMQ front door (deployments/doors/zmq.py) over a real ROUTER socket, in process: real Preprocess and
Postprocess, a Policy deployment serving a recorded LeRobot episode (no weights), stand-in handles instead of Ray."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time

import msgpack
import numpy as np
import pytest

from deployments.config.sections import ReplayArgs
from deployments.config.settings import PolicySettings
from deployments.doors.zmq import ZmqDoor
from deployments.graph_runner import GraphRunner
from deployments.policy import PolicyDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from dreamzero.embodiments import get_embodiment
from dreamzero_client.errors import AuthenticationError, ReplyTimeout
from dreamzero_client.zmq_client import ZmqPolicyClient
from serve_graph.builder import zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.host import free_port
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2
from tests.support.rldx import RldxShapedClient, droid_rldx_observation

TOKEN = "door-token"


class _Method:
    def __init__(self, fn, delay_s: float = 0.0):
        self.fn, self.delay_s = fn, delay_s

    def remote(self, *args):
        async def run():
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            out = self.fn(*args)
            return await out if inspect.isawaitable(out) else out

        return asyncio.ensure_future(run())  # awaitable and cancellable, like a DeploymentResponse


class FakeHandle:
    """Stands in for a DeploymentHandle: `.options(...)` is ignored, `.m.remote(...)` runs on the caller's loop."""

    def __init__(self, obj, delay_s: float = 0.0):
        self.obj, self.delay_s, self.calls = obj, delay_s, []

    def options(self, **kwargs):
        return self

    def __getattr__(self, name):
        self.calls.append(name)
        return _Method(getattr(self.obj, name), self.delay_s if name == "generate" else 0.0)


@pytest.fixture(scope="module")
def episode(tmp_path_factory):
    episodes = random_episodes(2, {"observation.state": 8, "action": 8}, seed=3, lengths=[12, 40])
    root = write_v2(tmp_path_factory.mktemp("ds") / "ds", episodes, modality=DROID_MODALITY)
    return root, episodes[1]["action"]


def _start_door(episode_dir, policy_delay_s=0.0, **zmq_args):
    port = free_port()
    cfg = parse_app_args({"api_key": TOKEN, "zmq": {"port": port, "host": "127.0.0.1", **zmq_args}})
    replay = ReplayArgs(dataset=str(episode_dir), episode=1, stride=8)
    policy = PolicyDeployment(PolicySettings(replay=replay))
    handles = (FakeHandle(PreprocessDeployment()), FakeHandle(policy, policy_delay_s),
               FakeHandle(PostprocessDeployment()))  # fmt: skip
    settings = zmq_door_settings(cfg, resolve_model(cfg))
    door = ZmqDoor(GraphRunner(*handles, settings.graph), settings)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        sock = door.bind()
        started.set()
        loop.run_until_complete(door.serve(sock))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    return door, loop, thread, port, handles


@pytest.fixture(scope="module")
def door(episode):
    door, loop, thread, port, handles = _start_door(episode[0], request_timeout_s=20)
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
    door, loop, thread, port, _ = _start_door(
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
    door, loop, thread, port, _ = _start_door(episode[0], max_message_bytes=4096)
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
