"""The Cartesian robot contract (defaults over joint streaming), its simulation, and the reset move."""

from __future__ import annotations

import types

import numpy as np
import pytest

from dreamzero_franka.common.contracts import RobotFault
from dreamzero_franka.common.sim_backends import SimRobot
from dreamzero_franka.pnp.arm_model import tcp_pose
from dreamzero_franka.pnp.cartesian import CartesianRobot, SimCartesianRobot, franky_external_wrench
from dreamzero_franka.pnp.reset_move import go_to_pose
from dreamzero_franka.pnp.rotations import rotation_angle
from dreamzero_franka.pnp.safety import PnpSafetyFilter
from tests.support.franka_pnp import joints_for, task_poses

POSES = task_poses()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


class JointStreamingArm(SimRobot, CartesianRobot):
    """A backend that only mixes the contract in (as the franky backend would)."""

    def external_wrench(self) -> np.ndarray:
        return np.arange(6.0)


def test_default_contract_observes_by_forward_kinematics_and_streams_the_hint():
    arm = JointStreamingArm(initial=POSES.home_joints)
    arm.connect()
    tcp = arm.observe_tcp()
    np.testing.assert_allclose(tcp.pose, tcp_pose(POSES.home_joints))
    np.testing.assert_allclose(tcp.wrench, np.arange(6.0))
    hint = POSES.home_joints + 0.01
    arm.send_pose(tcp_pose(hint), hint)
    np.testing.assert_allclose(arm.commands[-1].target, hint)
    with pytest.raises(RobotFault, match="finite 4x4"):
        arm.send_pose(np.full((4, 4), np.nan), hint)


def test_sim_refuses_an_unreachable_pose():
    arm = SimCartesianRobot(initial=POSES.home_joints)
    arm.connect()
    far = tcp_pose(POSES.home_joints)
    far[:3, 3] = [1.4, 0.0, 0.2]
    with pytest.raises(RobotFault, match="unreachable"):
        arm.send_pose(far, POSES.home_joints)
    assert arm.pose_commands == [] and arm.sends == 0


def test_franky_external_wrench_reads_k_f_ext_hat_k():
    fake = types.SimpleNamespace(state=types.SimpleNamespace(K_F_ext_hat_K=[1, 2, 3, 0.1, 0.2, 0.3]))
    np.testing.assert_allclose(franky_external_wrench(fake), [1, 2, 3, 0.1, 0.2, 0.3])
    fake.state.K_F_ext_hat_K = [1, 2, 3]
    with pytest.raises(RobotFault, match="external wrench"):
        franky_external_wrench(fake)


def test_reset_move_reaches_the_reset_pose_in_limited_steps():
    clock = Clock()
    start = POSES.reset + np.array([0.08, -0.12, -0.08, 0, 0, 0.4])
    arm = SimCartesianRobot(initial=joints_for(start, seed=POSES.home_joints), clock=clock)
    arm.connect()
    filt = PnpSafetyFilter(POSES)
    go_to_pose(arm, filt, POSES.reset_pose, timeout_s=10.0, clock=clock, sleep=clock.sleep)
    reached = arm.observe_tcp().pose
    assert np.linalg.norm(reached[:3, 3] - POSES.reset_pose[:3, 3]) <= 0.005
    assert rotation_angle(reached[:3, :3] @ POSES.reset_pose[:3, :3].T) <= 0.02
    steps = np.diff(np.stack([p[:3, 3] for p in arm.pose_commands]), axis=0)
    assert len(arm.pose_commands) >= 6  # 17 cm at <= 3 cm per step
    assert np.all(np.linalg.norm(steps, axis=1) <= 0.03 + 1e-6)


def test_reset_move_times_out_holding():
    clock = Clock()
    start = POSES.reset + np.array([0.05, 0.0, -0.05, 0, 0, 0])
    arm = SimCartesianRobot(initial=joints_for(start, seed=POSES.home_joints), velocity=np.zeros(7), clock=clock)
    arm.connect()
    with pytest.raises(RobotFault, match="within 2.0 s"):
        go_to_pose(arm, PnpSafetyFilter(POSES), POSES.reset_pose, timeout_s=2.0, clock=clock, sleep=clock.sleep)
    assert arm.holding
