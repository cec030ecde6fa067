"""The Isaac Lab sim-evals adapter, against a fake env with sim-evals' observation structure (no Isaac here)."""

import importlib.util

import numpy as np
import pytest
import torch

from dreamzero.errors import ConfigError, InvalidObservation, MissingDependency
from eval.env_contract import check_droid_env, check_droid_observation
from eval.isaac_sim_evals import IsaacDroidEnv, make_isaac_env, map_observation, resolve_env_id
from eval.runner import EvalConfig, run_evaluation
from tests.support.evaluation import FakeIsaacEnv, scripted_policy


@pytest.mark.skipif(importlib.util.find_spec("isaaclab") is not None, reason="Isaac Lab is installed here")
def test_missing_isaac_lab_says_how_to_install():
    with pytest.raises(MissingDependency) as err:
        make_isaac_env(1)
    msg = str(err.value)
    assert "isaaclab" in msg and "sim-evals" in msg and "SIM_EVALS_ASSET_ROOT" in msg and "--sim mujoco" in msg


@pytest.mark.parametrize("new_layout", [True, False])
def test_observation_mapping(new_layout):
    fake = FakeIsaacEnv(new_layout=new_layout, image_shape=(72, 128, 3))
    obs, _ = fake.reset()
    mapped = map_observation(obs)
    check_droid_observation(mapped)
    np.testing.assert_array_equal(mapped["exterior_image_0_left"], obs["policy"]["external_cam"][0].numpy())
    np.testing.assert_array_equal(mapped["wrist_image_left"], obs["policy"]["wrist_cam"][0].numpy())
    if new_layout:
        np.testing.assert_array_equal(mapped["exterior_image_1_left"], obs["policy"]["external_cam_2"][0].numpy())
    else:  # the old layout has one exterior camera: the second view is dropped (black), as in training
        assert (mapped["exterior_image_1_left"] == 0).all()
    assert mapped["joint_position"].shape == (7,) and mapped["gripper_position"].shape == (1,)


def test_float_images_and_missing_keys():
    obs = {
        "policy": {
            "external_cam": torch.full((1, 8, 8, 3), 0.5),
            "wrist_cam": torch.zeros(1, 8, 8, 3),
            "arm_joint_pos": torch.zeros(1, 7),
            "gripper_pos": torch.zeros(1, 1),
        }
    }
    mapped = map_observation(obs)
    assert mapped["exterior_image_0_left"].dtype == np.uint8 and mapped["exterior_image_0_left"][0, 0, 0] == 127
    del obs["policy"]["arm_joint_pos"]
    with pytest.raises(InvalidObservation) as err:
        map_observation(obs)
    assert err.value.field == "arm_joint_pos"
    with pytest.raises(InvalidObservation):
        map_observation({"rgb": 1})


def test_env_contract_actions_and_warmup_reset():
    fake = FakeIsaacEnv(image_shape=(72, 128, 3))
    env = IsaacDroidEnv(fake, scene_id=1, max_episode_steps=5)
    check_droid_env(env, steps=2)
    assert fake.reset_calls == 2  # first reset is doubled: sim-evals loads materials on the second
    env.reset(seed=0)
    assert fake.reset_calls == 3
    target = np.array([0.1, -0.6, 0.0, -2.5, 0.0, 1.9, 0.3, 1.0])
    obs, reward, terminated, truncated, _ = env.step(target)
    assert fake.actions[-1].dtype == torch.float32 and tuple(fake.actions[-1].shape) == (1, 8)
    np.testing.assert_allclose(obs["joint_position"], target[:7], rtol=1e-6)
    assert (terminated, truncated) == (False, False)
    for _ in range(4):
        *_, truncated, _ = env.step(target)
    assert truncated  # our own 450-step (here 5) limit
    with pytest.raises(ConfigError):
        env.step(np.zeros(7))
    env.close()
    assert fake.closed


def test_success_heuristic_on_final_object_positions():
    fake = FakeIsaacEnv(names=("can", "mug"))
    env = IsaacDroidEnv(fake, scene_id=2)
    assert env.instruction == "pick up the can and put it in the mug"
    assert not env.is_success()
    fake.scene["can"].data.root_pos_w = torch.tensor([[0.55, -0.15, 0.04]])  # inside the mug at (0.5, -0.2, 0)
    assert env.is_success()
    fake.scene["can"].data.root_pos_w = torch.tensor([[0.55, -0.15, -0.10]])  # fell below the table
    assert not env.is_success()
    assert set(env.object_poses()) == {"can", "mug"} and env.object_poses()["mug"].shape == (7,)


def test_object_names_are_configurable_and_errors_list_what_exists():
    fake = FakeIsaacEnv(names=("red_cube", "blue_bowl"))
    with pytest.raises(ConfigError, match="red_cube"):
        IsaacDroidEnv(fake, scene_id=1).object_poses()
    assert not IsaacDroidEnv(fake, scene_id=1, object_names=("red_cube", "blue_bowl")).is_success()


def test_env_id_resolution_supports_both_layouts():
    assert resolve_env_id(1, "auto", {"DROID"}) == "DROID"
    assert resolve_env_id(2, "auto", {"DROID", "DROID-CanInMug"}) == "DROID-CanInMug"
    assert resolve_env_id(3, "per_scene", set()) == "DROID-BananaInBin"
    assert resolve_env_id(3, "legacy", {"DROID-BananaInBin"}) == "DROID"
    with pytest.raises(ConfigError):
        resolve_env_id(4, "auto", set())
    with pytest.raises(ConfigError):
        resolve_env_id(1, "newest", set())


def test_runner_over_the_adapter_resizes_720p_views(tmp_path):
    policy, link = scripted_policy()
    summary = run_evaluation(
        lambda scene: IsaacDroidEnv(FakeIsaacEnv(), scene),
        policy,
        EvalConfig(out_dir=tmp_path, max_steps=10, record_video=False),
    )
    assert summary["episodes"] == 1 and summary["server_calls"] == 2  # steps 0 and 8
    assert summary["failed_episodes"] == 0
