"""Shared geometry of the franka_pnp tests: a task above the table in front of the arm, near DROID's ready pose."""

from __future__ import annotations

import numpy as np

from dreamzero_franka.common.limits import FR3_JOINT_LOWER, FR3_JOINT_UPPER
from dreamzero_franka.pnp.arm_model import solve_ik
from dreamzero_franka.pnp.rotations import pose_from_xyz_euler
from dreamzero_franka.pnp.task_poses import TaskPoses

# DROID's home with the hand turned so the TCP frame lines up with the base (TCP at (0.36, 0, 0.387), pointing down)
READY = np.array([0.0, -np.pi / 5, 0.0, -4 * np.pi / 5, 0.0, 3 * np.pi / 5, np.pi / 4])
TARGET = np.array([0.45, 0.0, 0.20, np.pi, 0.0, 0.0])


def joints_for(pose6, seed=READY) -> np.ndarray:
    result = solve_ik(pose_from_xyz_euler(pose6), seed, FR3_JOINT_LOWER, FR3_JOINT_UPPER, tol_m=1e-6, tol_rad=1e-6)
    assert result.converged, pose6
    return result.q


def task_poses(**overrides) -> TaskPoses:
    """RLinf's derivation from TARGET, with the joint home at the reset pose (so it lies inside the box)."""
    reset = TARGET + np.array([0, 0, 0.10, 0, 0, 0])
    return TaskPoses.from_target(TARGET, **{"home_joints": joints_for(reset), **overrides})
