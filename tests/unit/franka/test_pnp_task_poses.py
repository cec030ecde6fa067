"""TaskPoses: RLinf's derivation from the target pose, validation before the arm moves (errors name the field), CLI."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from dreamzero_client.errors import ConfigError
from dreamzero_franka.pnp.task_poses import TaskPoses, add_task_pose_args, task_poses_from_args
from tests.support.franka_pnp import TARGET, joints_for, task_poses

RESET = TARGET + np.array([0, 0, 0.10, 0, 0, 0])


def test_from_target_derives_rlinf_reset_and_box():
    poses = task_poses()
    np.testing.assert_allclose(poses.reset, RESET)
    np.testing.assert_allclose(poses.workspace_min, TARGET[:3] - [0.10, 0.15, 0.001])
    np.testing.assert_allclose(poses.workspace_max, TARGET[:3] + [0.10, 0.15, 0.10])
    np.testing.assert_allclose(poses.rotation_above, [0.01, 0.01, np.pi / 6])
    np.testing.assert_allclose(poses.rotation_below, [-0.01, -0.01, -np.pi / 6])


def test_rotation_window_is_continuous_across_pi():
    poses = task_poses()  # target rx = pi
    assert poses.contains_euler([-np.pi + 0.005, 0.0, 0.0])
    assert not poses.contains_euler([-np.pi + 0.05, 0.0, 0.0])


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"workspace_max": TARGET[:3] + [0.1, 0.15, -0.01]}, "workspace_min/workspace_max"),  # empty along z
        ({"workspace_min": [0.45, -0.15, 0.199], "workspace_max": [0.45, 0.15, 0.3]}, "workspace_min/workspace_max"),
        ({"reset": RESET + [0.3, 0, 0, 0, 0, 0]}, "task_poses.reset position"),
        ({"reset": RESET + [0, 0, 0, 0, 0, 0.8]}, "task_poses.reset orientation"),
        ({"home_joints": [0, 0, 0, -1.9, 0, 2, 0]}, "task_poses.home_joints puts the TCP"),  # RLinf home: above box
        ({"home_joints": [0, 0, 0, 0.0, 0, 2, 0]}, "task_poses.home_joints"),  # joint 4 must stay negative
        ({"home_joints": [0, 0, 0, -1.9, 0, 2]}, "task_poses.home_joints must be 7"),
        ({"reset": [450.0, 0.0, 300.0, np.pi, 0, 0]}, "millimetres"),
        ({"rotation_above": [0.01, 0.01, 30.0]}, "degrees"),
        ({"rotation_below": [0.01, -0.01, -0.5]}, "rotation_below must be <= 0"),
        ({"reset": [0.45, 0.0, float("nan"), np.pi, 0, 0]}, "task_poses.reset must be 6 finite"),
    ],
)
def test_invalid_poses_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace("/", "/")):
        task_poses(**overrides)


def test_target_in_millimetres_is_caught():
    with pytest.raises(ConfigError, match="task_poses.target position .*millimetres"):
        TaskPoses.from_target([450.0, 0.0, 200.0, np.pi, 0.0, 0.0])


def test_target_in_degrees_is_caught():
    with pytest.raises(ConfigError, match="task_poses.target angles .*degrees"):
        TaskPoses.from_target([0.45, 0.0, 0.2, 180.0, 0.0, 0.0])


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_task_pose_args(parser)
    return task_poses_from_args(parser.parse_args(argv))


def test_cli_flags_build_and_override():
    home = " ".join(str(v) for v in joints_for(RESET))
    argv = ["--target-ee-pose", *map(str, TARGET), "--home-joints", *home.split()]
    argv += ["--rotation-window", "0.02", "0.02", "0.3"]
    poses = _parse(argv + ["--workspace-max", "0.6", "0.2", "0.35"])
    np.testing.assert_allclose(poses.workspace_max, [0.6, 0.2, 0.35])
    np.testing.assert_allclose(poses.rotation_above, [0.02, 0.02, 0.3])
    np.testing.assert_allclose(poses.rotation_below, [-0.02, -0.02, -0.3])
    np.testing.assert_allclose(poses.reset, RESET)


def test_cli_requires_the_target_and_validates():
    with pytest.raises(SystemExit):
        _parse([])
    with pytest.raises(ConfigError, match="task_poses.home_joints"):
        _parse(["--target-ee-pose", *map(str, TARGET)])  # RLinf's default home is above RLinf's default box
