"""The Cartesian addition to the `Robot` contract that franka_pnp needs, and its simulated implementation.

`contracts.Robot` streams joint targets; franka_pnp commands TCP poses and observes the TCP pose, twist and
external wrench. `CartesianRobot` adds exactly that (two methods) on top of `Robot`, so the existing life cycle,
`hold`, `move_to` (joint home) and `recover` are unchanged. `SimCartesianRobot` implements it over the kinematic
`SimRobot`: a pose target becomes a joint target through the same inverse kinematics the safety filter uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dreamzero_franka.common.contracts import NUM_JOINTS, Robot, RobotFault
from dreamzero_franka.common.limits import FR3_JOINT_LOWER, FR3_JOINT_UPPER
from dreamzero_franka.common.sim_backends import SimRobot
from dreamzero_franka.pnp.arm_model import solve_ik, tcp_jacobian


@dataclass(frozen=True)
class TcpState:
    """One Cartesian reading of the arm (libfranka names in brackets)."""

    pose: np.ndarray  # 4x4 TCP pose in the base frame [O_T_EE]
    twist: np.ndarray  # (6,) TCP (v, w) in the base frame [zero Jacobian @ dq]
    wrench: np.ndarray  # (6,) estimated external force (N) and torque (Nm) [K_F_ext_hat_K]
    joint_positions: np.ndarray  # (7,) rad [q], needed to seed inverse kinematics


class CartesianRobot(Robot):
    """A `Robot` that can also be observed and commanded in TCP poses.

    Both methods have joint-space defaults, so a joint-streaming backend (the franky one) gains the interface by
    mixing this class in: `observe_tcp` is forward kinematics of the measured joints plus `external_wrench()`, and
    `send_pose` streams the safety filter's inverse-kinematics solution through the backend's own `send` (with its
    joint-limit checks). A backend with a native Cartesian controller overrides `send_pose`.
    """

    def external_wrench(self) -> np.ndarray:
        """(6,) estimated external force / torque at the TCP (libfranka's K_F_ext_hat_K); zeros when not measured."""
        return np.zeros(6)

    def observe_tcp(self) -> TcpState:
        """The current TCP state."""
        arm = self.observe()
        pose, jac = tcp_jacobian(arm.joint_positions)
        return TcpState(pose, jac @ arm.joint_velocities, self.external_wrench(), arm.joint_positions)

    def send_pose(self, pose: np.ndarray, joint_hint: np.ndarray) -> None:
        """Start moving the TCP towards the absolute 4x4 `pose` and return at once (a new target preempts the last).

        Callers pass only what `pnp.safety.PnpSafetyFilter` returned: `joint_hint` is the filter's inverse-kinematics
        solution of `pose`, inside the joint limits. Raises `RobotFault` when the controller rejects the target.
        """
        pose = np.asarray(pose, dtype=np.float64)
        hint = np.asarray(joint_hint, dtype=np.float64)
        if pose.shape != (4, 4) or not np.all(np.isfinite(pose)) or hint.shape != (NUM_JOINTS,):
            raise RobotFault(f"pose must be a finite 4x4 matrix and joint_hint (7,), got {pose.shape} / {hint.shape}")
        self.send(hint)


class SimCartesianRobot(SimRobot, CartesianRobot):
    """Kinematic simulation over `SimRobot`: re-solves each pose's IK (as a real controller would have to) before
    streaming it, and records every pose it accepted (`pose_commands`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pose_commands: list[np.ndarray] = []

    def send_pose(self, pose: np.ndarray, joint_hint: np.ndarray) -> None:
        self._require_connected()
        pose = np.asarray(pose, dtype=np.float64)
        hint = np.asarray(joint_hint, dtype=np.float64)
        if pose.shape != (4, 4) or not np.all(np.isfinite(pose)) or hint.shape != (NUM_JOINTS,):
            raise RobotFault(f"pose must be a finite 4x4 matrix and joint_hint (7,), got {pose.shape} / {hint.shape}")
        result = solve_ik(pose, hint, FR3_JOINT_LOWER, FR3_JOINT_UPPER, tol_m=1e-3, tol_rad=1e-2)
        if not result.converged:
            raise RobotFault(
                f"simulated controller: pose unreachable (error {result.position_error_m:.4f} m, "
                f"{result.rotation_error_rad:.4f} rad)"
            )
        self.pose_commands.append(pose.copy())
        self.send(result.q)


def franky_external_wrench(franky_robot) -> np.ndarray:
    """K_F_ext_hat_K of a connected `franky.Robot` as (6,) float64, for a franky backend's `external_wrench`."""
    wrench = np.asarray(franky_robot.state.K_F_ext_hat_K, dtype=np.float64).reshape(-1)
    if wrench.shape != (6,) or not np.all(np.isfinite(wrench)):
        raise RobotFault(f"the robot reported an invalid external wrench: {wrench!r}")
    return wrench
