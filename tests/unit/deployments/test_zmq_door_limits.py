"""The ZeroMQ door against one caller hurting the others (issue 45, item 5 and the door's part of item 1): the token
is checked before anything else is unpacked and the unpack is bounded; `kill` is the operator's and a killed door
reports itself unhealthy; the door remembers only sessions the Policy holds (bounded); `reset` is bounded and
rate-limited per tenant. Driven through `ZmqDoor.handle` (no socket), with the replay policy behind it."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc

import msgpack
import pytest

import deployments.doors.zmq as zmq_door
from deployments.config.sections import ReplayArgs
from deployments.config.settings import PolicySettings
from deployments.doors.zmq import ZmqDoor, ZmqIngressDeployment
from deployments.graph_runner import GraphRunner
from deployments.policy import PolicyDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from deployments.tenants import key_digest
from dreamzero_client.wire import rldx
from serve_graph.builder import zmq_door_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2
from tests.support.rldx import droid_rldx_observation
from tests.support.zmq_door import FakeHandle

KEYS = {"alpha": "key-alpha", "beta": "key-beta", "admin": "key-admin"}


@pytest.fixture(scope="module")
def episode_dir(tmp_path_factory):
    episodes = random_episodes(2, {"observation.state": 8, "action": 8}, seed=3, lengths=[12, 40])
    return write_v2(tmp_path_factory.mktemp("ds") / "ds", episodes, modality=DROID_MODALITY)


def _door(episode_dir, **zmq_args) -> ZmqDoor:
    cfg = parse_app_args({
        "api_keys": {t: key_digest(k) for t, k in KEYS.items()},
        "zmq": {"port": 5555, "host": "127.0.0.1", "request_timeout_s": 20, **zmq_args},
    })  # fmt: skip
    policy = PolicyDeployment(PolicySettings(replay=ReplayArgs(dataset=str(episode_dir), episode=1, stride=8)))
    handles = (FakeHandle(PreprocessDeployment()), FakeHandle(policy), FakeHandle(PostprocessDeployment()))
    settings = zmq_door_settings(cfg, resolve_model(cfg))
    return ZmqDoor(GraphRunner(*handles, settings.graph), settings)


def _call(door: ZmqDoor, endpoint: str, data=None, token: str | None = None, identity: bytes = b"robot-1"):
    message = {"endpoint": endpoint, "data": data or {}}
    if token is not None:
        message["api_token"] = token
    reply = asyncio.run(door.handle(identity, rldx.pack(message)))
    return rldx.unpack(reply)


def _bomb(n: int, token: str | None = None) -> bytes:
    """A message whose `data` is `n` empty lists (one byte each; ~145 bytes of Python objects each if built)."""
    message = {"endpoint": "get_action", "data": {"input": [[]] * n}}
    if token is not None:
        message["api_token"] = token
    return msgpack.packb(message)


def test_the_token_is_checked_before_the_message_is_unpacked(episode_dir, monkeypatch):
    door = _door(episode_dir)
    unpacked = []
    real = zmq_door.bounded_unpack
    monkeypatch.setattr(zmq_door, "bounded_unpack", lambda *a: unpacked.append(1) or real(*a))
    body = _bomb(8 * 2**20, token="wrong")  # 8 MiB of empty lists
    tracemalloc.start()
    try:
        reply = msgpack.unpackb(asyncio.run(door.handle(b"x", body)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply["status"] == 401 and unpacked == []
    assert peak < len(body) // 4  # nothing of `data` was built (building it costs ~145x the body)
    no_token = msgpack.unpackb(asyncio.run(door.handle(b"x", _bomb(1000))))
    assert no_token["status"] == 401 and unpacked == []


def test_a_bomb_with_a_good_token_is_refused_by_the_decode_limits(episode_dir):
    door = _door(episode_dir)
    reply = msgpack.unpackb(asyncio.run(door.handle(b"x", _bomb(2**20, token=KEYS["alpha"]))))
    assert reply["status"] == 400 and "max_container_len" in reply["error"]
    deep = msgpack.packb({"endpoint": "ping", "api_token": KEYS["alpha"], "data": {"x": [[[]] * 4000] * 4000}})
    reply = msgpack.unpackb(asyncio.run(door.handle(b"x", deep)))
    assert reply["status"] == 400 and "max_objects" in reply["error"]
    assert _call(door, "ping", token=KEYS["alpha"])["status"] == "ok"


def test_kill_is_the_operators_and_a_killed_door_is_unhealthy(episode_dir):
    closed = _door(episode_dir)
    assert "disabled" in _call(closed, "kill", token=KEYS["admin"])["error"]
    door = _door(episode_dir, allow_kill=True)
    reply = _call(door, "kill", token=KEYS["alpha"])  # a tenant cannot end the door the others share
    assert reply["status"] == 401 and "admin" in reply["error"] and not door.killed.is_set()
    assert _call(door, "kill", token=KEYS["admin"]) is None and door.killed.is_set()

    deployment = object.__new__(ZmqIngressDeployment)  # the Serve wrapper's health, without binding a port
    deployment.door = door

    async def finished():
        return None

    async def health():
        deployment._task = asyncio.ensure_future(finished())
        await deployment._task
        assert not deployment.ready()
        with pytest.raises(RuntimeError, match="closed by `kill`"):
            deployment.check_health()

    asyncio.run(health())


def test_the_door_remembers_only_sessions_the_policy_holds(episode_dir, monkeypatch):
    door = _door(episode_dir)
    bad = droid_rldx_observation()
    bad["state.joint_position"] = bad["state.joint_position"][..., :5]
    for i in range(50):  # refused requests: none of their ids is remembered
        reply = _call(door, "get_action", {"observation": bad, "options": {"session_ids": [f"r{i}"]}}, KEYS["alpha"])
        assert reply["status"] == 422
    assert door.remembered() == 0 and not door.sessions
    _call(door, "get_action", {"observation": droid_rldx_observation(), "options": {"session_ids": ["s"]}},
          KEYS["alpha"])  # fmt: skip
    assert door.remembered() == 1
    # bounded per client and in all, the least recently used forgotten first
    monkeypatch.setattr(zmq_door, "MAX_REMEMBERED_SESSIONS", 300)
    door._remember(("alpha", "c1"), [f"a{i}" for i in range(1000)], "route")
    assert len(door.sessions[("alpha", "c1")]) == zmq_door.MAX_SESSIONS_PER_CLIENT
    for c in range(10):
        door._remember(("beta", f"d{c}"), [f"b{i}" for i in range(20)], "route")
    assert door.remembered() <= 300
    assert len(door.sessions[("beta", "d9")]) == 20  # the newest client kept whole


def test_reset_is_bounded_and_rate_limited_per_tenant(episode_dir, caplog, monkeypatch):
    import deployments.tenants as tenants

    monkeypatch.setattr(tenants, "_refusal_lines", tenants.RefusalLines())  # no other test's refusals folded in
    door = _door(episode_dir)
    calls = door.runner.policy.calls
    obs = droid_rldx_observation()
    _call(door, "get_action", {"observation": obs, "options": {"session_ids": ["s"]}}, KEYS["alpha"])
    before = calls.count("reset_sessions")
    assert _call(door, "reset", {"options": None}, KEYS["alpha"]) == {"cleared_sessions": ["s"]}
    assert calls.count("reset_sessions") == before + 1  # one Policy call: only the session that exists
    too_many = {"options": {"session_ids": [f"x{i}" for i in range(zmq_door.MAX_SESSIONS_PER_CLIENT + 1)]}}
    reply = _call(door, "reset", too_many, KEYS["alpha"])
    assert reply["status"] == 422 and reply["field"] == "options.session_ids"
    with caplog.at_level(logging.INFO, "dreamzero.audit"):
        replies = [_call(door, "reset", {"options": None}, KEYS["alpha"]) for _ in range(zmq_door.RESET_BURST)]
        _call(door, "ping", token="wrong")
    refused = [r for r in replies if "status" in r]
    assert refused and all(r["status"] == 429 and r["retry_after_s"] > 0 for r in refused)
    assert "resets/s" in refused[0]["error"]
    lines = [r.getMessage() for r in caplog.records if r.name == "dreamzero.audit"]
    # a burst of refusals within a second is one line (the rest folded into the next: deployments.tenants)
    assert lines.count("refuse tenant=alpha at=zmq/reset reason=quota_exceeded:resets_per_s") == 1
    assert lines[-1] == "refuse tenant=unauthenticated at=zmq/unknown reason=unauthorized"
    assert _call(door, "reset", {"options": None}, KEYS["beta"]) == {"cleared_sessions": []}  # beta's own bucket


def test_a_huge_finite_state_is_refused_naming_the_field(episode_dir):
    """Issue 45, item 8: a finite state of 1e30 once made all-NaN actions; now it is refused, naming the key."""
    door = _door(episode_dir)
    obs = droid_rldx_observation()
    obs["state.joint_position"][..., 2] = 1e30
    reply = _call(door, "get_action", {"observation": obs, "options": {"session_ids": ["s"]}}, KEYS["alpha"])
    assert reply["status"] == 422 and "joint_position" in reply["field"] and "normalised" in reply["error"]
    assert door.remembered() == 0
