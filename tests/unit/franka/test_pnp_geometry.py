"""franka_pnp geometry: rotation conventions (checked against scipy), TCP kinematics, inverse kinematics."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dreamzero_franka.common.limits import FR3_JOINT_LOWER, FR3_JOINT_UPPER
from dreamzero_franka.pnp import rotations as rot
from dreamzero_franka.pnp.arm_model import pose_error, solve_ik, tcp_jacobian, tcp_pose
from tests.support.franka_pnp import READY

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("euler", [RNG.uniform(-np.pi, np.pi, 3) * [1, 0.45, 1] for _ in range(20)])
def test_euler_xyz_matches_scipy_lowercase_xyz(euler):
    expected = Rotation.from_euler("xyz", euler).as_matrix()
    np.testing.assert_allclose(rot.euler_xyz_to_matrix(euler), expected, atol=1e-12)
    back = Rotation.from_matrix(expected).as_euler("xyz")
    np.testing.assert_allclose(rot.matrix_to_euler_xyz(expected), back, atol=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_quaternion_and_rotvec_round_trips_match_scipy(seed):
    r = Rotation.random(random_state=seed)
    m = r.as_matrix()
    q = r.as_quat()
    q = -q if q[3] < 0 else q
    np.testing.assert_allclose(rot.matrix_to_quat(m), q, atol=1e-9)
    np.testing.assert_allclose(rot.quat_to_matrix(q), m, atol=1e-12)
    np.testing.assert_allclose(rot.matrix_to_rotvec(m), r.as_rotvec(), atol=1e-9)
    np.testing.assert_allclose(rot.rotvec_to_matrix(r.as_rotvec()), m, atol=1e-12)


def test_rotvec_log_is_accurate_near_pi():
    m = rot.rotvec_to_matrix([0.0, 0.0, np.pi - 1e-7])
    assert abs(rot.rotation_angle(m) - (np.pi - 1e-7)) < 1e-6


def test_interpolate_pose_ends_and_midpoint():
    a = rot.pose_from_xyz_euler([0.4, 0.0, 0.3, np.pi, 0, 0])
    b = rot.pose_from_xyz_euler([0.5, 0.1, 0.2, np.pi, 0, 0.4])
    np.testing.assert_allclose(rot.interpolate_pose(a, b, 0.0), a, atol=1e-12)
    np.testing.assert_allclose(rot.interpolate_pose(a, b, 1.0), b, atol=1e-12)
    mid = rot.interpolate_pose(a, b, 0.5)
    np.testing.assert_allclose(mid[:3, 3], [0.45, 0.05, 0.25])
    assert rot.rotation_angle(mid[:3, :3] @ a[:3, :3].T) == pytest.approx(0.2, abs=1e-9)


def test_rlinf_adjoint_block_structure():
    pose = rot.pose_from_xyz_euler([0.5, -0.1, 0.2, 3.0, 0.1, 0.2])
    adj = rot.rlinf_adjoint(pose)
    r, p = pose[:3, :3], pose[:3, 3]
    v, w = np.array([1.0, 0, 0]), np.array([0, 0, 1.0])
    out = adj @ np.concatenate([v, w])
    np.testing.assert_allclose(out[:3], r @ v)  # linear part: rotated only
    np.testing.assert_allclose(out[3:], r @ w + np.cross(p, r @ v))  # RLinf's extra term lands on the rotation


def test_tcp_at_ready_pose_points_down_with_zero_yaw():
    # the Franka Hand frame is the flange turned -45 deg: at q7 = pi/4 the TCP axes line up with (x, -y, -z)
    xyz_euler = rot.pose_to_xyz_euler(tcp_pose(READY))
    np.testing.assert_allclose(xyz_euler[:3], [0.360, 0.0, 0.387], atol=2e-3)
    np.testing.assert_allclose(np.abs(xyz_euler[3:]), [np.pi, 0.0, 0.0], atol=1e-9)


def test_jacobian_matches_finite_differences():
    q = np.array([0.2, -0.4, 0.3, -2.1, 0.1, 1.9, 0.6])
    pose, jac = tcp_jacobian(q)
    numeric = np.empty((6, 7))
    for i in range(7):
        dq = np.zeros(7)
        dq[i] = 1e-7
        numeric[:, i] = pose_error(tcp_pose(q + dq), pose) / 1e-7
    np.testing.assert_allclose(jac, numeric, atol=1e-5)


def test_ik_reaches_a_nearby_pose():
    target = tcp_pose(READY)
    target[:3, 3] += [0.05, -0.03, -0.04]
    target[:3, :3] = rot.rotvec_to_matrix([0.0, 0.1, 0.2]) @ target[:3, :3]
    result = solve_ik(target, READY, FR3_JOINT_LOWER, FR3_JOINT_UPPER)
    assert result.converged
    assert np.linalg.norm(pose_error(target, tcp_pose(result.q))[:3]) < 1e-4


def test_ik_does_not_pretend_to_reach_past_a_joint_limit():
    # every joint may move 0.05 rad: a 0.5 rad turn of the hand needs more than that (the arm is redundant, so
    # squeezing joint 7 alone is not enough); the answer stays inside the limits and says it did not converge
    lower, upper = READY - 0.05, READY + 0.05
    target = tcp_pose(READY)
    target[:3, :3] = target[:3, :3] @ rot.rot_z(0.5)
    result = solve_ik(target, READY, lower, upper)
    assert not result.converged
    assert np.all(result.q >= lower) and np.all(result.q <= upper)
    assert result.rotation_error_rad > 0.1


def test_ik_fails_for_an_unreachable_position():
    target = tcp_pose(READY)
    target[:3, 3] = [1.5, 0.0, 0.3]
    assert not solve_ik(target, READY, FR3_JOINT_LOWER, FR3_JOINT_UPPER).converged
