"""Where a franka_pnp episode starts and where the arm may go: home joints, reset pose, workspace box.

RLinf configures its pick-and-place task with one measured pose, `target_ee_pose` = (x, y, z, rx, ry, rz) in the
robot base frame (metres, Euler "xyz" radians): the lowest point of the task's motion space. Everything else is
derived from it (see docs/franka.md, section 8): the reset pose hovers 0.10 m above it, and the clip box spans
x +- 0.10, y +- 0.15, z from -0.001 to +0.10 around it, with rx / ry held within +- 0.01 rad and rz within +- pi/6 of
its orientation. `TaskPoses.from_target` reproduces that derivation; every field can be overridden.

All fields are checked before the arm moves (`validate`, run by the constructor); errors name the field.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_franka.common.limits import FR3_JOINT_LOWER, FR3_JOINT_UPPER
from dreamzero_franka.pnp.arm_model import tcp_pose
from dreamzero_franka.pnp.rotations import pose_from_xyz_euler, wrap_to_pi

#: RLinf's joint reset configuration for its Franka envs (rad)
RLINF_HOME_JOINTS = (0.0, 0.0, 0.0, -1.9, 0.0, 2.0, 0.0)
#: RLinf's bin-relocation clip ranges around the target pose (m, rad)
RLINF_BOX_HALF_X = 0.10
RLINF_BOX_HALF_Y = 0.15
RLINF_BOX_BELOW_Z = 0.001
RLINF_BOX_ABOVE_Z = 0.10
RLINF_TILT_WINDOW_RAD = 0.01
RLINF_YAW_WINDOW_RAD = np.pi / 6

MAX_REACH_M = 1.0  # the FR3 reaches 0.855 m; anything beyond 1 m is a unit or frame mistake
MIN_BOX_SIDE_M = 0.005
MAX_BOX_SIDE_M = 1.5
HOME_JOINT_MARGIN_RAD = 0.05


def _vector(name: str, value, size: int) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"task_poses.{name} must be {size} numbers, got {value!r}") from exc
    if arr.shape != (size,) or not np.all(np.isfinite(arr)):
        raise ConfigError(f"task_poses.{name} must be {size} finite numbers, got {value!r}")
    return arr


def _check_position(name: str, xyz: np.ndarray) -> None:
    if np.linalg.norm(xyz[:2]) > MAX_REACH_M or abs(xyz[2]) > MAX_REACH_M:
        raise ConfigError(
            f"task_poses.{name} position {xyz.tolist()} is beyond the arm's reach; positions are metres in the "
            "robot base frame (millimetres given?)"
        )


def _check_euler(name: str, euler: np.ndarray) -> None:
    if np.any(np.abs(euler) > 2 * np.pi):
        raise ConfigError(f"task_poses.{name} angles {euler.tolist()} exceed 2*pi; angles are radians (degrees given?)")


@dataclass
class TaskPoses:
    """Task geometry in the robot base frame: metres and Euler "xyz" radians (RLinf's `target_ee_pose` form)."""

    target: np.ndarray  # (6,) the task's reference pose: centre of the rotation window, bottom of the box
    reset: np.ndarray  # (6,) TCP pose every episode starts from (reached by a slow Cartesian move)
    home_joints: np.ndarray  # (7,) joint configuration for the occasional joint reset (rad)
    workspace_min: np.ndarray  # (3,) TCP position box (m)
    workspace_max: np.ndarray  # (3,)
    rotation_below: np.ndarray = field(default_factory=lambda: -_rlinf_window())  # (3,) <= 0, rad from target
    rotation_above: np.ndarray = field(default_factory=lambda: _rlinf_window())  # (3,) >= 0

    def __post_init__(self) -> None:
        self.target = _vector("target", self.target, 6)
        self.reset = _vector("reset", self.reset, 6)
        self.home_joints = _vector("home_joints", self.home_joints, 7)
        self.workspace_min = _vector("workspace_min", self.workspace_min, 3)
        self.workspace_max = _vector("workspace_max", self.workspace_max, 3)
        self.rotation_below = _vector("rotation_below", self.rotation_below, 3)
        self.rotation_above = _vector("rotation_above", self.rotation_above, 3)
        self.validate()

    @classmethod
    def from_target(cls, target, **overrides) -> TaskPoses:
        """RLinf's derivation from the measured target pose; keyword arguments replace single fields."""
        t = _vector("target", target, 6)
        fields = dict(
            target=t,
            reset=t + np.array([0.0, 0.0, RLINF_BOX_ABOVE_Z, 0.0, 0.0, 0.0]),
            home_joints=np.array(RLINF_HOME_JOINTS),
            workspace_min=t[:3] - np.array([RLINF_BOX_HALF_X, RLINF_BOX_HALF_Y, RLINF_BOX_BELOW_Z]),
            workspace_max=t[:3] + np.array([RLINF_BOX_HALF_X, RLINF_BOX_HALF_Y, RLINF_BOX_ABOVE_Z]),
        )
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def validate(self) -> None:
        for name in ("target", "reset"):
            vec = getattr(self, name)
            _check_position(name, vec[:3])
            _check_euler(name, vec[3:])
        for name in ("workspace_min", "workspace_max"):
            _check_position(name, getattr(self, name))
        side = self.workspace_max - self.workspace_min
        if np.any(side < MIN_BOX_SIDE_M):
            axis = "xyz"[int(np.argmin(side))]
            raise ConfigError(
                f"task_poses.workspace_min/workspace_max: the box is empty or thinner than {MIN_BOX_SIDE_M} m along "
                f"{axis} (min {self.workspace_min.tolist()}, max {self.workspace_max.tolist()})"
            )
        if np.any(side > MAX_BOX_SIDE_M):
            raise ConfigError(
                f"task_poses.workspace_min/workspace_max: a side exceeds {MAX_BOX_SIDE_M} m ({side.tolist()}); "
                "units are metres"
            )
        if np.any(self.rotation_below > 0) or np.any(self.rotation_above < 0):
            raise ConfigError(
                "task_poses.rotation_below must be <= 0 and task_poses.rotation_above >= 0 on every axis, got "
                f"{self.rotation_below.tolist()} / {self.rotation_above.tolist()}"
            )
        if np.any(self.rotation_above - self.rotation_below > 2 * np.pi):
            raise ConfigError("task_poses.rotation_below/rotation_above: a window wider than 2*pi (degrees given?)")
        if not self.contains_position(self.reset[:3]):
            raise ConfigError(
                f"task_poses.reset position {self.reset[:3].tolist()} is outside the workspace box "
                f"{self.workspace_min.tolist()} .. {self.workspace_max.tolist()}"
            )
        if not self.contains_euler(self.reset[3:]):
            raise ConfigError(
                f"task_poses.reset orientation {self.reset[3:].tolist()} is outside the rotation window around "
                f"task_poses.target {self.target[3:].tolist()}"
            )
        lower, upper = FR3_JOINT_LOWER + HOME_JOINT_MARGIN_RAD, FR3_JOINT_UPPER - HOME_JOINT_MARGIN_RAD
        outside = (self.home_joints < lower) | (self.home_joints > upper)
        if outside.any():
            raise ConfigError(
                f"task_poses.home_joints {self.home_joints.tolist()} is outside the FR3 joint limits (minus "
                f"{HOME_JOINT_MARGIN_RAD} rad) on joints {np.flatnonzero(outside).tolist()}; values are radians"
            )
        home_tcp = tcp_pose(self.home_joints)[:3, 3]
        if not self.contains_position(home_tcp):
            raise ConfigError(
                f"task_poses.home_joints puts the TCP at {np.round(home_tcp, 3).tolist()}, outside the workspace box "
                f"{self.workspace_min.tolist()} .. {self.workspace_max.tolist()}; choose a home above the task or "
                "raise task_poses.workspace_max"
            )

    def contains_position(self, xyz: np.ndarray, tol: float = 1e-9) -> bool:
        return bool(np.all(xyz >= self.workspace_min - tol) and np.all(xyz <= self.workspace_max + tol))

    def euler_offset(self, euler: np.ndarray) -> np.ndarray:
        """Shortest signed angle from the target's Euler angles, per axis (continuous across +-pi)."""
        return wrap_to_pi(np.asarray(euler, dtype=np.float64) - self.target[3:])

    def contains_euler(self, euler: np.ndarray, tol: float = 1e-9) -> bool:
        off = self.euler_offset(euler)
        return bool(np.all(off >= self.rotation_below - tol) and np.all(off <= self.rotation_above + tol))

    @property
    def reset_pose(self) -> np.ndarray:
        """4x4 reset pose."""
        return pose_from_xyz_euler(self.reset)

    def with_overrides(self, **changes) -> TaskPoses:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _rlinf_window() -> np.ndarray:
    return np.array([RLINF_TILT_WINDOW_RAD, RLINF_TILT_WINDOW_RAD, RLINF_YAW_WINDOW_RAD])


def add_task_pose_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Flags for `task_poses_from_args`: the target pose (`required` unless the caller checks it), the rest default
    to RLinf's derivation."""
    group = parser.add_argument_group("franka_pnp task poses (base frame, metres, Euler xyz radians)")
    pose6 = ("X", "Y", "Z", "RX", "RY", "RZ")
    group.add_argument("--target-ee-pose", type=float, nargs=6, required=required, metavar=pose6,
                       help="measured lowest pose of the task (RLinf's target_ee_pose)")  # fmt: skip
    group.add_argument("--reset-ee-pose", type=float, nargs=6, metavar=pose6,
                       help="episode start pose (default: target + 0.10 m in z)")  # fmt: skip
    group.add_argument("--home-joints", type=float, nargs=7, metavar="Q",
                       help=f"joint home (default {list(RLINF_HOME_JOINTS)})")  # fmt: skip
    group.add_argument("--workspace-min", type=float, nargs=3, metavar=("X", "Y", "Z"))
    group.add_argument("--workspace-max", type=float, nargs=3, metavar=("X", "Y", "Z"))
    group.add_argument("--rotation-window", type=float, nargs=3, metavar=("RX", "RY", "RZ"),
                       help="allowed +- Euler offset from the target orientation (default 0.01 0.01 pi/6)")  # fmt: skip


def task_poses_from_args(args: argparse.Namespace) -> TaskPoses:
    if args.target_ee_pose is None:
        raise ConfigError("--target-ee-pose is required for franka_pnp (the task's measured lowest TCP pose)")
    window = None if args.rotation_window is None else np.abs(_vector("rotation_window", args.rotation_window, 3))
    return TaskPoses.from_target(
        args.target_ee_pose,
        reset=args.reset_ee_pose,
        home_joints=args.home_joints,
        workspace_min=args.workspace_min,
        workspace_max=args.workspace_max,
        rotation_below=None if window is None else -window,
        rotation_above=window,
    )
