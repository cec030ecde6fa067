"""The local MuJoCo DROID scene: gymnasium's checker, the DROID contract, home pose, control and the success rule."""

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from dreamzero.errors import ConfigError
from eval.env_contract import IMAGE_KEYS, check_droid_env
from eval.mujoco_droid import ENV_ID, MujocoDroidEnv
from eval.mujoco_droid.scene import HOME_QPOS

DROID_HOME_EE = np.array([0.360, 0.0, 0.387])


@pytest.fixture(scope="module")
def env():
    e = MujocoDroidEnv(1, image_size=(90, 160), render_quality="fast", max_episode_steps=30)
    yield e
    e.close()


# DROID actions are absolute joint targets in radians, so the action space is deliberately not normalised.
@pytest.mark.filterwarnings("ignore:.*symmetric and normalized space")
def test_gymnasium_check_env(env):
    check_env(env, skip_render_check=True)


def test_droid_contract(env):
    check_droid_env(env)
    obs, _ = env.reset(seed=0)
    assert set(obs) == set(IMAGE_KEYS) | {"joint_position", "gripper_position"}
    assert obs["wrist_image_left"].shape == (90, 160, 3)
    assert env.instruction == "put the cube in the bowl"


def test_home_pose_tcp_matches_droid(env):
    env.reset(seed=0)
    np.testing.assert_allclose(env.data.qpos[:7], HOME_QPOS)
    tcp = env.tcp_position()
    assert np.linalg.norm(tcp - DROID_HOME_EE) < 0.01, tcp  # measured: (0.3597, 0.0, 0.3865)


def test_fingers_close_square_to_the_cube_faces(env):
    # at the home pose the fingers slide along a base diagonal; the cube is turned to face them, so a top-down grasp
    # meets two faces instead of two opposite vertical edges (which squeeze the cube out when off centre)
    env.reset(seed=0)
    joint = env.model.joint("finger_joint1")
    slide = env.data.xmat[joint.bodyid[0]].reshape(3, 3) @ env.model.jnt_axis[joint.id]
    cube = env.data.geom("cube_geom").xmat.reshape(3, 3)
    alignment = np.abs(cube.T @ slide)  # |cos| to each face normal: one of them is 1 when the fingers face a side
    assert alignment.max() > 0.999, alignment


def test_holds_home_and_tracks_a_target_at_15hz(env):
    obs, _ = env.reset(seed=0)
    for _ in range(10):  # holding home: gravity compensation leaves no sag
        obs, *_ = env.step(np.append(HOME_QPOS, 0.0))
    assert np.abs(obs["joint_position"] - HOME_QPOS).max() < 2e-3
    target = HOME_QPOS + np.array([0.2, 0.1, -0.1, 0.1, 0.1, -0.1, 0.2])
    for _ in range(15):  # 1 s
        obs, *_ = env.step(np.append(target, 0.0))
    assert np.abs(obs["joint_position"] - target).max() < 5e-3


def test_gripper_closes_and_opens(env):
    obs, _ = env.reset(seed=0)
    assert obs["gripper_position"][0] < 0.05
    for _ in range(8):
        obs, *_ = env.step(np.append(HOME_QPOS, 1.0))
    assert obs["gripper_position"][0] > 0.9
    for _ in range(8):
        obs, *_ = env.step(np.append(HOME_QPOS, 0.0))
    assert obs["gripper_position"][0] < 0.1


def test_success_rule_on_object_positions(env):
    env.reset(seed=0)
    assert not env.is_success()  # the cube starts 30 cm from the bowl
    bowl = env.object_poses()["bowl"]
    adr = env.model.joint("cube_free").qposadr[0]
    env.data.qpos[adr : adr + 3] = [bowl[0] + 0.02, bowl[1], 0.03]  # drop it into the bowl
    env.data.qvel[:] = 0
    obs, reward, terminated, truncated, info = env.step(np.append(HOME_QPOS, 0.0))
    assert env.is_success() and info["success"] and reward == 1.0
    assert not terminated  # sim-evals semantics: success is judged at the end, the episode runs on


def test_truncates_at_the_step_limit():
    e = MujocoDroidEnv(1, image_size=(32, 48), render_quality="fast", max_episode_steps=3)
    try:
        e.reset(seed=1)
        flags = [e.step(np.append(HOME_QPOS, 0.0))[3] for _ in range(3)]
        assert flags == [False, False, True]
    finally:
        e.close()


def test_seeded_resets_are_reproducible(env):
    a, _ = env.reset(seed=5)
    pa = env.object_poses()
    b, _ = env.reset(seed=5)
    np.testing.assert_array_equal(a["exterior_image_0_left"], b["exterior_image_0_left"])
    np.testing.assert_array_equal(pa["cube"], env.object_poses()["cube"])
    env.reset(seed=6)
    assert not np.array_equal(pa["cube"], env.object_poses()["cube"])


@pytest.mark.parametrize("scene,objects", [(2, {"can", "mug"}), (3, {"banana", "bin"})])
def test_other_scenes(scene, objects):
    e = MujocoDroidEnv(scene, image_size=(32, 48), render_quality="fast")
    try:
        e.reset(seed=0)
        assert set(e.object_poses()) == objects and not e.is_success()
        assert "mug" in e.instruction or "bin" in e.instruction
    finally:
        e.close()


def test_registered_and_validates_arguments():
    import gymnasium as gym

    e = gym.make(ENV_ID, scene_id=1, image_size=(32, 48), render_quality="fast")
    e.close()
    with pytest.raises(ConfigError, match="scene"):
        MujocoDroidEnv(5)
    with pytest.raises(ConfigError, match="render_quality"):
        MujocoDroidEnv(1, render_quality="ultra")


def test_quality_render_differs_from_fast():
    views = []
    for quality in ("quality", "fast"):
        e = MujocoDroidEnv(1, image_size=(48, 64), render_quality=quality, render_mode="rgb_array")
        try:
            e.reset(seed=0)
            frame = e.render()
            assert frame.shape == (48, 64 * 3, 3) and frame.std() > 5  # a real image, not a blank canvas
            views.append(frame)
        finally:
            e.close()
    assert not np.array_equal(views[0], views[1])
