"""franka_pnp action rows -> TCP targets, as RLinf's real-world env executes them."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dreamzero_client.errors import ConfigError
from dreamzero_franka.pnp.actions import PnpActionSpace, action_to_target, gripper_command, preview_chunk
from dreamzero_franka.pnp.rotations import pose_from_xyz_euler, rlinf_adjoint, rotation_angle

SPACE = PnpActionSpace()
DOWN = pose_from_xyz_euler([0.45, 0.0, 0.3, np.pi, 0.0, 0.0])  # TCP x = base x, TCP z = -base z


def row(*values):
    out = np.zeros(7)
    out[: len(values)] = values
    return out


def test_zero_action_keeps_the_pose():
    target = action_to_target(row(), DOWN, SPACE)
    np.testing.assert_allclose(target.pose, DOWN, atol=1e-12)
    assert target.gripper_closed is None


def test_translation_is_in_the_tcp_frame_and_scaled():
    # TCP z points down: +dz in the TCP frame moves the hand 3 cm towards the table
    np.testing.assert_allclose(action_to_target(row(0, 0, 1), DOWN, SPACE).pose[:3, 3], [0.45, 0.0, 0.27], atol=1e-12)
    np.testing.assert_allclose(action_to_target(row(1), DOWN, SPACE).pose[:3, 3], [0.48, 0.0, 0.3], atol=1e-12)
    np.testing.assert_allclose(action_to_target(row(0, 0.5), DOWN, SPACE).pose[:3, 3], [0.45, -0.015, 0.3], atol=1e-12)


def test_base_frame_option_skips_the_frame_change():
    space = PnpActionSpace(tcp_frame=False)
    np.testing.assert_allclose(action_to_target(row(0, 0, 1), DOWN, space).pose[:3, 3], [0.45, 0.0, 0.33], atol=1e-12)


def test_values_are_clipped_to_one_after_the_frame_change():
    far = action_to_target(row(0, 0, 5.0), DOWN, SPACE).pose[:3, 3]
    np.testing.assert_allclose(far, [0.45, 0.0, 0.27], atol=1e-12)


def test_rotation_is_a_base_frame_euler_increment_like_rlinf():
    measured = pose_from_xyz_euler([0.45, 0.05, 0.3, 3.0, 0.1, 0.3])
    a = row(0, 0, 0, 0.4, -0.2, 0.7)
    target = action_to_target(a, measured, SPACE).pose
    # the reference computation, written with scipy as RLinf does it
    r = Rotation.from_euler("xyz", [3.0, 0.1, 0.3]).as_matrix()
    p = measured[:3, 3]
    skew_p = np.array([[0, -p[2], p[1]], [p[2], 0, -p[0]], [-p[1], p[0], 0]])
    adj = np.block([[r, np.zeros((3, 3))], [skew_p @ r, r]])
    base = np.clip(adj @ a[:6], -1, 1)
    expected_rot = (Rotation.from_euler("xyz", base[3:] * 0.1) * Rotation.from_matrix(r)).as_matrix()
    np.testing.assert_allclose(target[:3, :3], expected_rot, atol=1e-12)
    np.testing.assert_allclose(target[:3, 3], p + base[:3] * 0.03, atol=1e-12)


def test_full_scale_step_is_three_centimetres_and_at_most_point_one_seven_radians():
    target = action_to_target(row(1, 1, 1, 0, 0, 0), DOWN, SPACE).pose
    assert np.linalg.norm(target[:3, 3] - DOWN[:3, 3]) == pytest.approx(0.03 * np.sqrt(3))
    turned = action_to_target(row(0, 0, 0, 1, 1, 1), DOWN, SPACE).pose
    assert rotation_angle(turned[:3, :3] @ DOWN[:3, :3].T) <= 0.1 * np.sqrt(3) + 1e-9


@pytest.mark.parametrize(
    "value, expected", [(1.0, False), (0.5, False), (0.49, None), (0.0, None), (-0.5, True), (-1.0, True)]
)
def test_gripper_plus_one_opens_minus_one_closes(value, expected):
    assert gripper_command(value, 0.5) is expected
    assert action_to_target(row(0, 0, 0, 0, 0, 0, value), DOWN, SPACE).gripper_closed is expected


def test_preview_chains_the_rows():
    chunk = np.stack([row(1), row(1, 0, 0, 0.2), row(0, 0, 1, 0, 0, -0.5, -1)])
    expected, pose = [], DOWN
    for r in chunk:
        pose = action_to_target(r, pose, SPACE).pose
        expected.append(pose)
    np.testing.assert_allclose(preview_chunk(chunk, DOWN, SPACE), np.stack(expected), atol=1e-12)


def test_recorded_actions_undo_the_frame_change():
    # RLinf records a teleoperated base-frame motion through the inverse of the same 6x6 matrix; replaying that row
    # must give back the pure base-frame motion, including a translation without any rotation
    measured = pose_from_xyz_euler([0.5, 0.1, 0.25, np.pi, 0.0, 0.3])
    base_motion = np.array([0.5, -0.3, 0.2, 0.0, 0.0, 0.0])
    recorded = np.linalg.solve(rlinf_adjoint(measured), base_motion)
    assert np.abs(recorded[3:]).max() > 0.01  # the recorded row carries compensating rotation components
    target = action_to_target(np.append(recorded, 1.0), measured, SPACE).pose
    np.testing.assert_allclose(target[:3, 3], measured[:3, 3] + base_motion[:3] * 0.03, atol=1e-12)
    np.testing.assert_allclose(target[:3, :3], measured[:3, :3], atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"position_scale_m": 3.0}, "position_scale_m"), ({"rotation_scale_rad": 0.0}, "rotation_scale_rad"),
     ({"control_hz": 0}, "control_hz"), ({"gripper_threshold": 1.5}, "gripper_threshold")],
)  # fmt: skip
def test_action_space_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"action_space.{field}"):
        PnpActionSpace(**kwargs)
