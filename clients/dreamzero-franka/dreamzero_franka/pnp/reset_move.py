"""The slow move to the task's reset pose at the start of an episode, through the same safety filter.

RLinf interpolates from the current TCP pose to the reset pose over 1.5 s at the control rate (straight line,
quaternion slerp), retrying up to three times until within 2 cm. Here the filter's per-step limits do the
interpolation: each control period asks for one safe step towards the pose until it is reached or time runs out.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dreamzero_franka.common.contracts import RobotFault
from dreamzero_franka.pnp.cartesian import CartesianRobot
from dreamzero_franka.pnp.rotations import rotation_angle
from dreamzero_franka.pnp.safety import PnpSafetyFilter


def go_to_pose(
    robot: CartesianRobot,
    filt: PnpSafetyFilter,
    pose: np.ndarray,
    timeout_s: float,
    tol_m: float = 0.005,
    tol_rad: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Stream safe steps towards `pose`; returns when the measured TCP is within tolerance, else holds and raises."""
    filt.reset()
    period = filt.space.period_s
    deadline = clock() + timeout_s
    while True:
        tcp = robot.observe_tcp()
        if (
            np.linalg.norm(tcp.pose[:3, 3] - pose[:3, 3]) <= tol_m
            and rotation_angle(pose[:3, :3] @ tcp.pose[:3, :3].T) <= tol_rad
        ):
            filt.reset()
            return
        if clock() >= deadline:
            robot.hold()
            filt.reset()
            raise RobotFault(f"the reset move did not reach the reset pose within {timeout_s:.1f} s")
        cmd = filt.step_to_pose(pose, tcp)
        if cmd.hold:
            robot.hold()
        else:
            robot.send_pose(cmd.pose, cmd.joints)
        sleep(period)
