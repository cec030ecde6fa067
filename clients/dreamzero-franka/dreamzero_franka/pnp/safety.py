"""Safety filter for franka_pnp: every TCP target goes through `PnpSafetyFilter.step` before `send_pose`.

Per chunk (`check_chunk`; a rejected chunk is not executed at all, the caller holds the arm):
- a finite real (H, 7) array, H >= 1 (and == `expected_rows` when set);
- no motion value beyond `max_abs_action` (the action space is [-1, 1]; far beyond it the model is off its data);
- no jump: chaining the rows from the measured pose never leaves the workspace box by more than
  `max_preview_outside_m`.
Per step, relative to the last command (or the measured pose after a reset / hold):
1. workspace: the position is clipped into the box and the Euler angles into the window around the task target
   (a reference already outside may stay where it is, never go further out);
2. per-step translation and rotation, each the smaller of the step limit and speed cap / control rate;
3. lead: the target stays within `max_lead_m` / `max_lead_rad` of the measured pose;
4. joints: inverse kinematics from the last commanded configuration must reach the target with every joint inside
   the FR3 limits minus a margin and no joint moving faster than its velocity cap;
when 3 or 4 fail the step is shortened (bisection along the straight-line / geodesic path) to the longest prefix
that passes every check; when none does, the filter answers hold. The returned command is re-checked by
`command_violations` before it is handed out, so nothing outside the limits ever leaves the filter.
The joint-limit fields, the per-step limits, the widened limits and the bisection are `franka/limits.py`'s, shared
with DROID's joint filter; what is Cartesian (box, rotation window, lead, IK) is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dreamzero_client.errors import ConfigError, DreamZeroError
from dreamzero_franka.common.limits import (
    FR3_JOINT_LOWER,
    FR3_JOINT_UPPER,
    FR3_MAX_JOINT_VELOCITY,
    JointLimitFields,
    longest_safe_fraction,
    per_step_limit,
    widened,
)
from dreamzero_franka.pnp.actions import ACTION_DIM, PnpActionSpace, action_to_target, preview_chunk
from dreamzero_franka.pnp.arm_model import pose_error, solve_ik, tcp_pose
from dreamzero_franka.pnp.cartesian import TcpState
from dreamzero_franka.pnp.rotations import (
    euler_xyz_to_matrix,
    interpolate_pose,
    make_pose,
    matrix_to_euler_xyz,
    matrix_to_rotvec,
    rotation_angle,
    rotvec_to_matrix,
)
from dreamzero_franka.pnp.task_poses import TaskPoses

_TOL = 1e-6  # numerical slack of the checks (m, rad)
_BISECTIONS = 6  # the shortened step is found to within 1/64 of its length
_IK_ITERATIONS = 30  # a step of <= 3 cm from the last configuration converges in a handful


class PnpChunkRejected(DreamZeroError, ValueError):
    """A franka_pnp chunk that must not be executed (shape, dtype, non-finite values, out-of-range values, jump)."""

    code = "chunk_rejected"

    def __init__(self, message: str, field: str = "actions"):
        super().__init__(message)
        self.field = field


@dataclass
class PnpSafetyConfig(JointLimitFields):
    max_step_m: float = 0.03  # translation per control step (RLinf's full-scale action)
    max_step_rad: float = 0.1  # rotation per control step
    max_speed_m_s: float = 0.3
    max_speed_rad_s: float = 1.0
    control_hz: float = 10.0
    max_lead_m: float = 0.06  # commanded vs measured TCP
    max_lead_rad: float = 0.3
    max_abs_action: float = 1.5  # |motion value| above this rejects the chunk
    max_preview_outside_m: float = 0.10  # a chunk heading further outside the box than this is a jump
    expected_rows: int | None = None
    joint_margin_rad: float = 0.1
    joint_lower: np.ndarray = field(default_factory=lambda: FR3_JOINT_LOWER.copy())
    joint_upper: np.ndarray = field(default_factory=lambda: FR3_JOINT_UPPER.copy())
    max_joint_velocity: np.ndarray = field(default_factory=lambda: FR3_MAX_JOINT_VELOCITY.copy())
    ik_tol_m: float = 1e-3
    ik_tol_rad: float = 1e-2

    def __post_init__(self) -> None:
        positive = ("max_step_m", "max_step_rad", "max_speed_m_s", "max_speed_rad_s", "control_hz", "max_lead_m",
                    "max_lead_rad", "max_abs_action", "max_preview_outside_m", "ik_tol_m", "ik_tol_rad")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise ConfigError(f"pnp_safety.{name} must be a positive number, got {value!r}")
        if self.max_step_m > 0.1 or self.max_speed_m_s > 1.0:
            raise ConfigError("pnp_safety.max_step_m must be <= 0.1 m and max_speed_m_s <= 1.0 m/s (units are metres)")
        if self.max_step_rad > 0.5 or self.max_speed_rad_s > 3.0:
            raise ConfigError("pnp_safety.max_step_rad must be <= 0.5 rad and max_speed_rad_s <= 3 rad/s (radians)")
        if self.max_lead_m < self.step_m or self.max_lead_rad < self.step_rad:
            raise ConfigError("pnp_safety.max_lead_m / max_lead_rad must be at least one control step")
        if self.max_abs_action < 1.0:
            raise ConfigError(f"pnp_safety.max_abs_action must be >= 1 (the action range), got {self.max_abs_action}")
        if self.expected_rows is not None and self.expected_rows < 1:
            raise ConfigError(f"pnp_safety.expected_rows must be >= 1 or None, got {self.expected_rows}")
        self._check_joint_limits("pnp_safety")

    @property
    def step_m(self) -> float:
        return float(per_step_limit(self.max_step_m, self.max_speed_m_s, self.control_hz))

    @property
    def step_rad(self) -> float:
        return float(per_step_limit(self.max_step_rad, self.max_speed_rad_s, self.control_hz))

    @property
    def joint_step(self) -> np.ndarray:
        return self.max_joint_velocity / self.control_hz


@dataclass(frozen=True)
class PnpCommand:
    """What the loop executes for one step: send `pose` (with `joints` as hint) or, when `pose` is None, hold."""

    pose: np.ndarray | None  # 4x4 TCP target
    joints: np.ndarray | None  # (7,) IK configuration of `pose`, inside the joint limits
    gripper_closed: bool | None  # True close, False open, None keep
    # what changed the target: "workspace", "rotation_window", "step_limit", and "shortened" when the step was cut
    # (or, for a hold, refused) because the lead, joint-limit, joint-velocity or window checks failed along it
    clamped: tuple[str, ...]

    @property
    def hold(self) -> bool:
        return self.pose is None


@dataclass(frozen=True)
class _Reference:
    pose: np.ndarray
    q: np.ndarray


class PnpSafetyFilter:
    """Stateful: remembers the last command, which is the reference of the step and joint-velocity limits."""

    def __init__(self, poses: TaskPoses, space: PnpActionSpace | None = None, config: PnpSafetyConfig | None = None):
        self.poses = poses
        self.space = space or PnpActionSpace()
        self.config = config or PnpSafetyConfig(control_hz=self.space.control_hz)
        if abs(self.config.control_hz - self.space.control_hz) > 1e-9:
            raise ConfigError(
                f"pnp_safety.control_hz ({self.config.control_hz}) must equal action_space.control_hz "
                f"({self.space.control_hz})"
            )
        self._ref: _Reference | None = None

    def reset(self) -> None:
        """Forget the last command: after a hold, a home / reset move or a new chunk source, start from the arm."""
        self._ref = None

    # -- chunks -------------------------------------------------------------------------------------------------------

    def check_chunk(self, chunk: object, tcp: TcpState, executed_rows: int | None = None) -> np.ndarray:
        """The chunk as float64 (H, 7), or `PnpChunkRejected` naming what is wrong. `executed_rows`: how many rows
        the caller will execute; the jump check follows only those (rows never executed cannot move the arm)."""
        cfg = self.config
        if not isinstance(chunk, np.ndarray):
            raise PnpChunkRejected(f"actions must be a numpy array, got {type(chunk).__name__}")
        if chunk.dtype.kind not in "fiu":
            raise PnpChunkRejected(f"actions must be a real numeric array, got dtype {chunk.dtype}")
        if chunk.ndim != 2 or chunk.shape[1] != ACTION_DIM or chunk.shape[0] < 1:
            raise PnpChunkRejected(f"actions must have shape (H >= 1, {ACTION_DIM}), got {chunk.shape}")
        if cfg.expected_rows is not None and chunk.shape[0] != cfg.expected_rows:
            raise PnpChunkRejected(f"actions must have {cfg.expected_rows} rows (the horizon), got {chunk.shape[0]}")
        chunk = chunk.astype(np.float64)
        bad = ~np.isfinite(chunk)
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise PnpChunkRejected(
                f"actions hold {int(bad.sum())} non-finite values (first at row {row}, column {col})",
                field=f"actions[{row}, {col}]",
            )
        big = np.abs(chunk) > cfg.max_abs_action
        if big.any():
            row, col = np.argwhere(big)[0]
            raise PnpChunkRejected(
                f"actions[{row}, {col}] = {chunk[row, col]:.3g} is beyond +-{cfg.max_abs_action} (the action range is "
                "[-1, 1]; was the chunk left normalised or sent in metres?)",
                field=f"actions[{row}, {col}]",
            )
        path = preview_chunk(chunk[:executed_rows], tcp.pose, self.space)[:, :3, 3]
        outside = np.linalg.norm(path - np.clip(path, self.poses.workspace_min, self.poses.workspace_max), axis=1)
        if outside.max() > cfg.max_preview_outside_m:
            row = int(np.argmax(outside > cfg.max_preview_outside_m))
            raise PnpChunkRejected(
                f"actions jump: following the chunk puts the TCP {outside[row]:.3f} m outside the workspace box at row "
                f"{row} (limit {cfg.max_preview_outside_m} m)",
                field=f"actions[{row}]",
            )
        return chunk

    # -- steps --------------------------------------------------------------------------------------------------------

    def step(self, row: np.ndarray, tcp: TcpState) -> PnpCommand:
        """The safe command for one action row (already part of a chunk that passed `check_chunk`)."""
        row = np.asarray(row, dtype=np.float64)
        if row.shape != (ACTION_DIM,) or not np.all(np.isfinite(row)):
            raise PnpChunkRejected(f"action row must be {ACTION_DIM} finite numbers, got {row!r}", field="actions[i]")
        self._check_measured(tcp)
        target = action_to_target(row, tcp.pose, self.space)
        return self._safe_command(target.pose, target.gripper_closed, tcp)

    def step_to_pose(self, pose: np.ndarray, tcp: TcpState) -> PnpCommand:
        """The safe command one control step towards an absolute 4x4 TCP pose (used for the reset move)."""
        pose = np.asarray(pose, dtype=np.float64)
        if pose.shape != (4, 4) or not np.all(np.isfinite(pose)):
            raise PnpChunkRejected(f"pose must be a finite 4x4 matrix, got {pose.shape}", field="pose")
        self._check_measured(tcp)
        return self._safe_command(pose, None, tcp)

    @staticmethod
    def _check_measured(tcp: TcpState) -> None:
        if not (np.all(np.isfinite(tcp.pose)) and np.all(np.isfinite(tcp.joint_positions))):
            raise PnpChunkRejected("the measured TCP pose or joint positions are not finite", field="tcp")

    def _safe_command(self, target_pose: np.ndarray, gripper_closed: bool | None, tcp: TcpState) -> PnpCommand:
        ref = self._ref or _Reference(np.asarray(tcp.pose, dtype=np.float64), np.asarray(tcp.joint_positions, float))
        clamped: list[str] = []

        goal = self._clip_workspace(target_pose, ref.pose, clamped)
        goal = self._limit_step(goal, ref.pose, clamped)

        q = self._reachable(goal, ref, tcp.pose)
        if q is None:
            fraction, q, goal = self._longest_safe_prefix(goal, ref, tcp.pose)
            clamped.append("shortened")
            if fraction <= 0.0:
                self.reset()
                return PnpCommand(None, None, None, tuple(clamped))
        # `_reachable` already ran these checks; repeating them here keeps the final gate in one visible place
        problems = command_violations(goal, q, ref.pose, ref.q, tcp.pose, self.poses, self.config)
        if problems:
            self.reset()
            return PnpCommand(None, None, None, (*clamped, *problems))
        self._ref = _Reference(goal, q)
        return PnpCommand(goal, q, gripper_closed, tuple(clamped))

    def _clip_workspace(self, pose: np.ndarray, ref: np.ndarray, clamped: list[str]) -> np.ndarray:
        poses = self.poses
        position = np.clip(pose[:3, 3], *widened(poses.workspace_min, poses.workspace_max, ref[:3, 3]))
        if not np.allclose(position, pose[:3, 3], atol=0, rtol=0):
            clamped.append("workspace")
        euler = matrix_to_euler_xyz(pose[:3, :3])
        ref_offset = poses.euler_offset(matrix_to_euler_xyz(ref[:3, :3]))
        offset = poses.euler_offset(euler)
        clipped = np.clip(offset, *widened(poses.rotation_below, poses.rotation_above, ref_offset))
        rot = pose[:3, :3]
        if not np.array_equal(clipped, offset):
            clamped.append("rotation_window")
            rot = euler_xyz_to_matrix(poses.target[3:] + clipped)
        return make_pose(position, rot)

    def _limit_step(self, pose: np.ndarray, ref: np.ndarray, clamped: list[str]) -> np.ndarray:
        cfg = self.config
        move = pose[:3, 3] - ref[:3, 3]
        dist = float(np.linalg.norm(move))
        turn = matrix_to_rotvec(pose[:3, :3] @ ref[:3, :3].T)
        angle = float(np.linalg.norm(turn))
        if dist <= cfg.step_m and angle <= cfg.step_rad:
            return pose
        clamped.append("step_limit")
        # shorten translation and rotation by one common factor so the path stays the commanded one
        scale = min(1.0, cfg.step_m / dist if dist > 0 else 1.0, cfg.step_rad / angle if angle > 0 else 1.0)
        return make_pose(ref[:3, 3] + scale * move, rotvec_to_matrix(scale * turn) @ ref[:3, :3])

    def _reachable(self, pose: np.ndarray, ref: _Reference, measured: np.ndarray) -> np.ndarray | None:
        """The IK configuration of `pose` when every check passes, else None."""
        cfg = self.config
        if np.linalg.norm(pose[:3, 3] - measured[:3, 3]) > cfg.max_lead_m + _TOL:
            return None
        if rotation_angle(pose[:3, :3] @ measured[:3, :3].T) > cfg.max_lead_rad + _TOL:
            return None
        ik = solve_ik(
            pose, ref.q, cfg.lower, cfg.upper, tol_m=cfg.ik_tol_m, tol_rad=cfg.ik_tol_rad, max_iterations=_IK_ITERATIONS
        )
        if not ik.converged or np.any(np.abs(ik.q - ref.q) > cfg.joint_step + _TOL):
            return None
        if command_violations(pose, ik.q, ref.pose, ref.q, measured, self.poses, cfg):
            return None
        return ik.q

    def _longest_safe_prefix(self, goal: np.ndarray, ref: _Reference, measured: np.ndarray):
        """(fraction, q, pose) of the longest verified-safe part of the motion ref -> goal; fraction 0 means none."""

        def probe(fraction: float) -> tuple[np.ndarray, np.ndarray] | None:
            pose = interpolate_pose(ref.pose, goal, fraction)
            q = self._reachable(pose, ref, measured)
            return None if q is None else (q, pose)

        fraction, found = longest_safe_fraction(probe, _BISECTIONS)
        return (fraction, *found) if found is not None else (0.0, None, ref.pose)


def command_violations(
    pose: np.ndarray,
    q: np.ndarray,
    ref_pose: np.ndarray,
    ref_q: np.ndarray,
    measured: np.ndarray,
    poses: TaskPoses,
    cfg: PnpSafetyConfig,
) -> list[str]:
    """Every limit a command breaks (empty when it may be sent). Independent of how the command was built."""
    out = []
    p = pose[:3, 3]
    lo, hi = widened(poses.workspace_min, poses.workspace_max, ref_pose[:3, 3])
    if np.any(p < lo - _TOL) or np.any(p > hi + _TOL):
        out.append("workspace")
    offset = poses.euler_offset(matrix_to_euler_xyz(pose[:3, :3]))
    ref_offset = poses.euler_offset(matrix_to_euler_xyz(ref_pose[:3, :3]))
    w_lo, w_hi = widened(poses.rotation_below, poses.rotation_above, ref_offset)
    if np.any(offset < w_lo - _TOL) or np.any(offset > w_hi + _TOL):
        out.append("rotation_window")
    if np.linalg.norm(p - ref_pose[:3, 3]) > cfg.step_m + _TOL:
        out.append("step_translation")
    if rotation_angle(pose[:3, :3] @ ref_pose[:3, :3].T) > cfg.step_rad + _TOL:
        out.append("step_rotation")
    if np.linalg.norm(p - measured[:3, 3]) > cfg.max_lead_m + _TOL:
        out.append("lead_translation")
    if rotation_angle(pose[:3, :3] @ measured[:3, :3].T) > cfg.max_lead_rad + _TOL:
        out.append("lead_rotation")
    if np.any(q < cfg.lower - _TOL) or np.any(q > cfg.upper + _TOL):
        out.append("joint_limit")
    if np.any(np.abs(q - ref_q) > cfg.joint_step + _TOL):
        out.append("joint_velocity")
    err = pose_error(pose, tcp_pose(q))
    if np.linalg.norm(err[:3]) > cfg.ik_tol_m + _TOL or np.linalg.norm(err[3:]) > cfg.ik_tol_rad + _TOL:
        out.append("joints_do_not_reach_pose")
    return out
