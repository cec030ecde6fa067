"""The served replay policy (deployments/replay.py) on its own, and the `zmq:` / `policy.replay:` config fields."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.config.sections import ReplayArgs
from deployments.config.settings import PolicySettings
from deployments.policy import PolicyDeployment
from deployments.replay import ReplayPipeline
from dreamzero.embodiments import get_embodiment
from dreamzero.errors import ConfigError
from dreamzero.types import ModelBatch
from serve_graph.config import parse_app_args
from tests.support.embodiments import droid_observation
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    episodes = random_episodes(1, {"observation.state": 8, "action": 8}, seed=4, lengths=[30])
    return write_v2(tmp_path_factory.mktemp("ds") / "ds", episodes, modality=DROID_MODALITY), episodes[0]["action"]


def _normalised_batch(ids, reset=None):
    b = len(ids)
    return ModelBatch(images=np.zeros((b, 1, 8, 8, 3), np.uint8), state=np.zeros((b, 1, 64), np.float32),
                      state_mask=np.ones((b, 1, 64), bool), prompts=["p"] * b, session_ids=list(ids),
                      reset_mask=reset)  # fmt: skip


def test_normalised_form_gets_the_q99_recording_and_sessions_advance(dataset):
    root, recorded = dataset
    emb = get_embodiment("oxe_droid")
    replay = ReplayPipeline(emb, str(root), episode=0, stride=8, max_sessions=2)
    out = replay.generate(_normalised_batch(["a"]))
    assert out.actions.shape == (1, 24, 32) and not out.actions[0, :, 8:].any()  # padding stays zero
    per_key = emb.split_actions(recorded[:24].astype(np.float64))
    want = np.concatenate([emb.action_normalisers[k].normalise(v) for k, v in per_key.items()], -1)
    np.testing.assert_allclose(out.actions[0, :, :8], want, atol=1e-6)
    assert out.sessions[0].restart_reason == "new_session" and out.sessions[0].frame_position == 8
    second = replay.generate(_normalised_batch(["a"]))
    assert second.sessions[0].step == 2 and not second.sessions[0].restarted
    replay.reset_sessions(["a"])
    assert replay.generate(_normalised_batch(["a"])).sessions[0].restart_reason == "reset_requested"
    assert replay.generate(_normalised_batch(["a"], reset=[True])).sessions[0].restart_reason == "reset_requested"
    replay.generate(_normalised_batch(["b", "c"]))  # max_sessions=2: "a" is evicted
    assert "a" not in replay.store and replay.stats()["evictions"] == 1
    assert replay.generate(_normalised_batch(["a"])).sessions[0].restart_reason == "evicted"
    assert replay.drop_sessions(["a", "zzz"]) == 1


def test_raw_form_round_trips_through_the_action_codec(dataset):
    root, recorded = dataset
    emb = get_embodiment("oxe_droid")
    replay = ReplayPipeline(emb, str(root), episode=0, stride=8)
    inputs, context = emb.preprocess(droid_observation(batch=2), "x")
    batch = inputs.to_model_batch(["r0", "r1"], rtc_prefix_len=[2, None])
    out = replay.generate(batch)
    robot = emb.postprocess(out.actions, context)
    np.testing.assert_allclose(robot[:, :, :7], np.broadcast_to(recorded[:24, :7], (2, 24, 7)), atol=1e-4)
    assert [s.rtc for s in out.sessions] == ["cold_start", None]


def test_policy_deployment_serves_the_replay(dataset):
    policy = PolicyDeployment(PolicySettings(replay=ReplayArgs(dataset=str(dataset[0]), episode=0)))
    info = policy.info()
    assert info["config_name"] == "replay" and info["action_horizon"] == 24 and info["max_action_dim"] == 32


def test_config_fields_name_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r"args.policy.replay.dataset: .*is not a directory"):
        parse_app_args({"policy": {"replay": {"dataset": str(tmp_path / "missing")}}})
    with pytest.raises(ConfigError, match=r"args.zmq.port"):
        parse_app_args({"zmq": {"port": 70000}})
    with pytest.raises(ConfigError, match=r"args.zmq.alow_kill: unknown field"):
        parse_app_args({"zmq": {"alow_kill": True}})
    assert parse_app_args({}).zmq is None  # off unless configured
    assert parse_app_args({"zmq": {}}).zmq.port == 5555
