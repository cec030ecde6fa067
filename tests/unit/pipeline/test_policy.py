"""EmbeddedPolicy (with a scripted pipeline, and end to end with the tiny model) and ReplayPolicy."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from dreamzero.embodiments import get_embodiment
from dreamzero.errors import ConfigError, InvalidObservation, InvalidRequest
from dreamzero.policy import EmbeddedPolicy, ReplayPolicy
from tests.support.embodiments import JOINTS, droid_metadata, droid_observation
from tests.support.lerobot import DROID_MODALITY, random_episodes, write_v2, write_v3
from tests.support.pipeline import ScriptedPipeline, scripted_chunk


@pytest.fixture
def policy():
    return EmbeddedPolicy(ScriptedPipeline(scripted_chunk()), get_embodiment("oxe_droid", droid_metadata()))


def test_unbatched_observation_gives_one_chunk(policy):
    out = policy.infer(droid_observation(), "robot-0", "Pick up the cup", seed=7)
    assert out.actions.shape == (24, 8) and out.actions.dtype == np.float32
    np.testing.assert_allclose(out.actions[:, :7], JOINTS + np.linspace(-0.5, 0.5, 24)[:, None], atol=1e-6)
    np.testing.assert_array_equal(out.actions[:, 7], [0.0] * 12 + [1.0] * 12)
    batch = policy.pipeline.batches[-1]
    assert batch.images.shape == (1, 1, 352, 640, 3) and batch.session_ids == ["robot-0"]
    assert batch.seeds == [7] and batch.reset_mask == [False]
    assert batch.prompts[0].startswith("A multi-view video shows that a robot pick up the cup The video")
    assert out.sessions[0].restarted and out.sessions[0].restart_reason == "new_session"
    assert {"preprocess", "model", "postprocess", "total", "denoise"} <= set(out.timings_ms)


def test_batched_observation_and_per_row_arguments(policy):
    out = policy.infer(droid_observation(batch=2, frames=4), ["a", "b"], ["x", "y"], reset=[True, False],
                       expected_steps=[None, 3])  # fmt: skip
    assert out.actions.shape == (2, 24, 8)
    batch = policy.pipeline.batches[-1]
    assert batch.images.shape == (2, 4, 352, 640, 3)
    assert batch.reset_mask == [True, False] and batch.expected_steps == [None, 3]
    assert [s.session_id for s in out.sessions] == ["a", "b"]


@pytest.mark.parametrize(
    ("ids", "pattern"),
    [(["a"], "expected 2 ids"), (["a", "a"], "unique"), (["a", ""], "non-empty")],
)
def test_bad_session_ids(policy, ids, pattern):
    with pytest.raises(InvalidRequest, match=pattern):
        policy.infer(droid_observation(batch=2), ids)


def test_reset_is_forwarded_and_horizon_mismatch_fails(policy):
    policy.reset("robot-0")
    assert policy.pipeline.resets == [["robot-0"]]
    with pytest.raises(ConfigError, match="24-step chunks, embodiment libero_sim expects 16"):
        EmbeddedPolicy(ScriptedPipeline(scripted_chunk()), get_embodiment("libero_sim"))


def test_bad_observation_never_reaches_the_model(policy):
    obs = droid_observation()
    obs["state.joint_position"] = np.zeros(3)
    with pytest.raises(InvalidObservation, match="state.joint_position"):
        policy.infer(obs, "robot-0")
    assert policy.pipeline.batches == []


# ---------------------------------------------------------------------------------------------------------------------
# end to end with the embedded tiny model (needs the pipeline + embedded default of the model packages)
# ---------------------------------------------------------------------------------------------------------------------

_HAS_PIPELINE = all(importlib.util.find_spec(m) for m in ("dreamzero.pipeline", "dreamzero.embedded_default"))


@pytest.mark.slow  # ~10 s alone on 2 cores (building + running the tiny model); much longer under load
@pytest.mark.skipif(not _HAS_PIPELINE, reason="dreamzero.pipeline / embedded_default not available")
def test_tiny_model_serves_a_droid_observation_end_to_end():
    policy = EmbeddedPolicy.load(None)  # None: the random tiny model (no path: the shipped default)
    raw: list[np.ndarray] = []
    generate = policy.pipeline.generate

    def recording_generate(batch):
        result = generate(batch)
        raw.append(result.actions.copy())
        return result

    policy.pipeline.generate = recording_generate
    out = policy.infer(droid_observation(), "e2e", "put the cube in the bowl")
    assert out.actions.shape == (24, 8) and np.isfinite(out.actions).all()
    assert set(np.unique(out.actions[:, 7])) <= {0.0, 1.0}
    # joint targets = current joints + the un-normalised delta, with the shipped synthetic statistics
    stats = policy.embodiment.metadata.stats("action.joint_position")
    delta = (raw[0][0, :, :7].astype(np.float64) + 1) / 2 * (stats.q99 - stats.q01) + stats.q01
    np.testing.assert_allclose(out.actions[:, :7], JOINTS + delta, rtol=1e-5, atol=1e-5)
    assert out.sessions[0].restarted and out.sessions[0].step == 1
    second = policy.infer(droid_observation(frames=4, seed=1), "e2e", "put the cube in the bowl")
    assert second.sessions[0].step == 2 and not second.sessions[0].restarted


# ---------------------------------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------------------------------


def test_replay_droid_episode_chunk_by_chunk(tmp_path):
    episodes = random_episodes(3, {"observation.state": 8, "action": 8}, seed=9, lengths=[10, 30, 12])
    root = write_v2(tmp_path / "ds", episodes, modality=DROID_MODALITY)
    replay = ReplayPolicy(root, episode_index=1, embodiment="oxe_droid", stride=8)
    recorded = episodes[1]["action"]
    obs = droid_observation()
    first = replay.infer(obs, "s")
    assert first.actions.shape == (24, 8)
    np.testing.assert_array_equal(first.actions, recorded[:24])
    assert first.sessions[0].restart_reason == "new_session" and first.sessions[0].frame_position == 8
    second = replay.infer(obs, "s")
    np.testing.assert_array_equal(second.actions[:22], recorded[8:30])
    np.testing.assert_array_equal(second.actions[22:], recorded[[29, 29]])  # past the end: hold the last action
    assert second.sessions[0].step == 2 and not second.sessions[0].restarted
    mismatch = replay.infer(obs, "s", expected_steps=5)
    assert mismatch.sessions[0].restart_reason == "step_mismatch"
    np.testing.assert_array_equal(mismatch.actions, recorded[:24])
    replay.reset("s")
    assert replay.infer(obs, "s").sessions[0].restart_reason == "reset_requested"


def test_replay_batched_libero_v3_and_validation(tmp_path):
    episodes = random_episodes(3, {"state": 8, "actions": 7}, seed=10, lengths=[20, 20, 20])
    root = write_v3(tmp_path / "ds", episodes)
    replay = ReplayPolicy(root, episode_index=2, embodiment="libero_sim")
    obs = {"video.image": np.zeros((2, 64, 64, 3), np.uint8), "video.wrist_image": np.zeros((2, 64, 64, 3), np.uint8),
           "state.state": np.zeros((2, 8))}  # fmt: skip
    out = replay.infer(obs, ["a", "b"])
    assert out.actions.shape == (2, 16, 7)
    np.testing.assert_array_equal(out.actions[0], episodes[2]["actions"][:16])
    with pytest.raises(InvalidObservation, match="state.state"):
        replay.infer({**obs, "state.state": np.zeros((2, 5))}, ["a", "b"])
    with pytest.raises(ConfigError, match="episode 7 is not in"):
        ReplayPolicy(root, episode_index=7, embodiment="libero_sim")
    with pytest.raises(ConfigError, match="have 8 dims, libero_sim has 7"):
        ReplayPolicy(root, episode_index=0, embodiment="libero_sim", action_columns=["state"])


def test_load_uses_the_checkpoint_metadata_and_config_tag(tmp_path, monkeypatch):
    import json
    import types

    import dreamzero.pipeline as pipeline_module

    (tmp_path / "experiment_cfg").mkdir()
    meta = droid_metadata()
    meta["oxe_droid"]["statistics"]["state"]["gripper_position"]["q99"] = [0.5]
    (tmp_path / "experiment_cfg" / "metadata.json").write_text(json.dumps(meta))
    calls = []

    def fake_load(model_path=None, **kwargs):
        calls.append((model_path, kwargs))
        pipe = ScriptedPipeline(scripted_chunk())
        pipe.model = types.SimpleNamespace(config=types.SimpleNamespace(embodiment_tag="oxe_droid"))
        return pipe

    monkeypatch.setattr(pipeline_module.DreamZeroPipeline, "load", staticmethod(fake_load))
    policy = EmbeddedPolicy.load(tmp_path, device="cpu", max_sessions=4)
    assert calls == [(tmp_path, {"device": "cpu", "max_sessions": 4})]
    assert policy.embodiment.tag == "oxe_droid" and not policy.embodiment.metadata.synthetic
    assert policy.embodiment.metadata.stats("state.gripper_position").q99.tolist() == [0.5]


def test_replay_orders_actions_like_the_embodiment(tmp_path):
    modality = {
        "state": {"joint_position": {"start": 0, "end": 7}, "gripper_position": {"start": 7, "end": 8}},
        "action": {"gripper_position": {"start": 0, "end": 1}, "joint_position": {"start": 1, "end": 8}},
    }
    episodes = random_episodes(1, {"observation.state": 8, "action": 8}, seed=11, lengths=[24])
    root = write_v3(tmp_path / "ds", episodes, modality=modality)
    out = ReplayPolicy(root, 0, "oxe_droid").infer(droid_observation(), "s")
    recorded = episodes[0]["action"]
    np.testing.assert_array_equal(out.actions[:, :7], recorded[:, 1:8])  # joints first, as oxe_droid concatenates
    np.testing.assert_array_equal(out.actions[:, 7], recorded[:, 0])
