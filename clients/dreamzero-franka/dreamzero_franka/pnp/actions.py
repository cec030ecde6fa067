"""franka_pnp action space: one action row -> an absolute TCP pose target and a gripper command.

What a row means (RLinf's real-world Franka env, see docs/franka.md section 8): 7 numbers
(dx, dy, dz, drx, dry, drz, gripper), a *relative* motion per control step expressed in the current TCP frame, in
units normalised to [-1, 1]. RLinf executes it as
1. map the 6 motion numbers to the base frame with the TCP pose's 6x6 matrix (`rotations.rlinf_adjoint`);
2. clip all 7 numbers to [-1, 1];
3. position target = measured TCP position + 0.03 m * (dx, dy, dz);
4. orientation target = EulerXYZ(0.1 rad * (drx, dry, drz)) @ measured TCP orientation (a base-frame rotation);
5. gripper: <= -0.5 closes, >= +0.5 opens (+1 is open), anything between leaves it.
Steps run at 10 Hz, each from the freshly measured pose. The server's postprocess already un-normalises the
model output and binarises the gripper to +-1, so rows arrive in these units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_franka.pnp.rotations import euler_xyz_to_matrix, make_pose, matrix_to_euler_xyz, rlinf_adjoint

ACTION_DIM = 7  # 6 motion + gripper


@dataclass(frozen=True)
class PnpActionSpace:
    """Scales and rate of the action space (RLinf's bin-relocation values by default)."""

    position_scale_m: float = 0.03  # metres per unit of dx, dy, dz
    rotation_scale_rad: float = 0.1  # radians per unit of drx, dry, drz
    control_hz: float = 10.0
    gripper_threshold: float = 0.5
    tcp_frame: bool = True  # actions in the TCP frame (RLinf's RelativeFrame wrapper); False: base frame

    def __post_init__(self) -> None:
        if not 0 < self.position_scale_m <= 0.1:
            raise ConfigError(f"action_space.position_scale_m must be in (0, 0.1] m, got {self.position_scale_m}")
        if not 0 < self.rotation_scale_rad <= 0.5:
            raise ConfigError(f"action_space.rotation_scale_rad must be in (0, 0.5] rad, got {self.rotation_scale_rad}")
        if not 0 < self.control_hz <= 100:
            raise ConfigError(f"action_space.control_hz must be in (0, 100], got {self.control_hz}")
        if not 0 < self.gripper_threshold <= 1:
            raise ConfigError(f"action_space.gripper_threshold must be in (0, 1], got {self.gripper_threshold}")

    @property
    def period_s(self) -> float:
        return 1.0 / self.control_hz


@dataclass(frozen=True)
class PoseTarget:
    pose: np.ndarray  # 4x4 absolute TCP target in the base frame (before the safety filter)
    gripper_closed: bool | None  # True close, False open, None keep


def gripper_command(value: float, threshold: float) -> bool | None:
    """RLinf's rule: <= -threshold closes, >= +threshold opens, the dead band keeps the current state."""
    if value <= -threshold:
        return True
    if value >= threshold:
        return False
    return None


def base_frame_action(row: np.ndarray, measured_tcp: np.ndarray, space: PnpActionSpace) -> np.ndarray:
    """Steps 1-2: the row's (v, w, gripper) in the base frame, clipped to [-1, 1]."""
    action = np.asarray(row, dtype=np.float64).reshape(ACTION_DIM).copy()
    if space.tcp_frame:
        action[:6] = rlinf_adjoint(measured_tcp) @ action[:6]
    return np.clip(action, -1.0, 1.0)


def action_to_target(row: np.ndarray, measured_tcp: np.ndarray, space: PnpActionSpace) -> PoseTarget:
    """One action row applied to the measured TCP pose (4x4). The row must be finite (see `safety.validate_chunk`)."""
    action = base_frame_action(row, measured_tcp, space)
    position = measured_tcp[:3, 3] + action[:3] * space.position_scale_m
    rotation = euler_xyz_to_matrix(action[3:6] * space.rotation_scale_rad) @ measured_tcp[:3, :3]
    return PoseTarget(make_pose(position, rotation), gripper_command(action[6], space.gripper_threshold))


def preview_chunk(chunk: np.ndarray, start_tcp: np.ndarray, space: PnpActionSpace) -> np.ndarray:
    """(H, 4, 4) targets if every step were reached exactly; used to judge a chunk before executing it."""
    poses, pose = [], np.asarray(start_tcp, dtype=np.float64)
    for row in chunk:
        pose = action_to_target(row, pose, space).pose
        poses.append(pose)
    return np.stack(poses) if poses else np.empty((0, 4, 4))


def executed_action(
    command_pose: np.ndarray | None, measured_tcp: np.ndarray, gripper_closed: bool | None, space: PnpActionSpace
) -> np.ndarray:
    """The row that, applied to `measured_tcp` as RLinf does (`action_to_target`), commands `command_pose`: what the
    arm was really asked to do after the safety filter, in the action space's units, clipped to [-1, 1]. A hold
    (`command_pose` None) is no motion. Gripper: +1 open, -1 closed (None: open, the state after the start move).
    A row the filter let through unchanged comes back as it was sent (when it was inside [-1, 1])."""
    out = np.zeros(ACTION_DIM)
    if command_pose is not None:
        measured = np.asarray(measured_tcp, dtype=np.float64)
        out[:3] = (command_pose[:3, 3] - measured[:3, 3]) / space.position_scale_m
        out[3:6] = matrix_to_euler_xyz(command_pose[:3, :3] @ measured[:3, :3].T) / space.rotation_scale_rad
        if space.tcp_frame:
            out[:6] = np.linalg.solve(rlinf_adjoint(measured), out[:6])
    out[6] = -1.0 if gripper_closed else 1.0
    return np.clip(out, -1.0, 1.0).astype(np.float32)
