"""The safety layer between the policy and the arm. Every joint target goes through `SafetyFilter.filter`.

What it enforces (limits from trusted Franka stacks, see docs/franka.md):
1. Chunk validation (`dreamzero_droid.policy.validate_chunk`): a chunk that is not a finite (H, 8) numeric array
   is rejected whole (`ChunkRejected`); a non-finite target reaching the filter is rejected too.
2. Joint limits minus a margin (FR3 limits, 0.1 rad margin by default).
3. A maximum change per control step, relative to the last command: min(max_step_rad, velocity cap / control rate)
   per joint, so the commanded velocity never exceeds the cap.
4. Optionally a workspace box for the gripper's TCP, checked with forward kinematics: a step that would leave the
   box is shortened to the last point inside it.
5. Gripper binarisation with DROID's rule (`droid.binarize_gripper`, > threshold -> closed).
6. A watchdog that holds the arm when no valid command was sent in time (the loop is blocked, the server is gone),
   through the `CommandGate` both control loops send by (both in `common/guards.py`): after a hold, the command
   filtered before it is dropped.

The FR3 limits and the limit arithmetic (per-step limits, bisection) are shared with franka_pnp's filter
(`common/limits.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_droid.policy import ChunkRejected
from dreamzero_franka.common.contracts import NUM_JOINTS
from dreamzero_franka.common.kinematics import tcp_position
from dreamzero_franka.common.limits import (
    FR3_JOINT_LOWER,
    FR3_JOINT_UPPER,
    FR3_MAX_JOINT_VELOCITY,
    JointLimitFields,
    longest_safe_fraction,
    per_step_limit,
    widened,
)

logger = logging.getLogger(__name__)


@dataclass
class SafetyConfig(JointLimitFields):
    """Limits the filter enforces. Defaults are the FR3's with DROID's 0.2 rad per-step bound."""

    joint_lower: np.ndarray = field(default_factory=lambda: FR3_JOINT_LOWER.copy())
    joint_upper: np.ndarray = field(default_factory=lambda: FR3_JOINT_UPPER.copy())
    joint_margin_rad: float = 0.1  # targets stay this far inside the hardware limits
    max_step_rad: float = 0.2  # largest change of any joint target per control step
    max_joint_velocity: np.ndarray = field(default_factory=lambda: FR3_MAX_JOINT_VELOCITY.copy())  # rad/s
    control_hz: float = 15.0
    workspace_min: tuple[float, float, float] | None = None  # TCP box in the base frame (m); None = no box
    workspace_max: tuple[float, float, float] | None = None
    gripper_threshold: float = 0.5

    def __post_init__(self) -> None:
        self._check_joint_limits("safety")
        if not 0 < self.max_step_rad <= 0.5:
            raise ConfigError(f"safety.max_step_rad must be in (0, 0.5], got {self.max_step_rad}")
        if not 0 < self.control_hz <= 1000:
            raise ConfigError(f"safety.control_hz must be in (0, 1000], got {self.control_hz}")
        if (self.workspace_min is None) != (self.workspace_max is None):
            raise ConfigError("safety.workspace_min and safety.workspace_max must be given together")
        if self.workspace_min is not None:
            lo, hi = np.asarray(self.workspace_min, float), np.asarray(self.workspace_max, float)
            if lo.shape != (3,) or hi.shape != (3,) or np.any(lo >= hi):
                raise ConfigError(
                    f"safety.workspace_min/max must be (x, y, z) with min < max, got {self.workspace_min} / "
                    f"{self.workspace_max}"
                )
        if not 0 < self.gripper_threshold < 1:
            raise ConfigError(f"safety.gripper_threshold must be in (0, 1), got {self.gripper_threshold}")

    @property
    def step_limit(self) -> np.ndarray:
        """(7,) largest allowed change of each joint target per control step."""
        return per_step_limit(self.max_step_rad, self.max_joint_velocity, self.control_hz)

    @property
    def has_workspace(self) -> bool:
        return self.workspace_min is not None


@dataclass(frozen=True)
class SafeCommand:
    joint_targets: np.ndarray  # (7,) what may be sent to the arm
    clamped: tuple[str, ...]  # which limits changed the target: "joint_limit", "step_limit", "workspace"


class SafetyFilter:
    """Turns policy joint targets into commands within every limit. Stateful: it remembers the last command."""

    def __init__(self, config: SafetyConfig | None = None):
        self.config = config or SafetyConfig()
        self._reference: np.ndarray | None = None  # last command sent; None -> use the measured position

    def reset(self) -> None:
        """Forget the last command (after a hold or a home move the next step starts from the measured position)."""
        self._reference = None

    def workspace_violation(self, q: np.ndarray) -> float:
        """Distance (m) of the TCP outside the workspace box; 0 inside it or when no box is configured."""
        if not self.config.has_workspace:
            return 0.0
        p = tcp_position(q)
        inside = np.clip(p, self.config.workspace_min, self.config.workspace_max)
        return float(np.linalg.norm(p - inside))

    def filter(self, target: np.ndarray, measured: np.ndarray) -> SafeCommand:
        cfg = self.config
        try:
            target = np.asarray(target, dtype=np.float64).reshape(NUM_JOINTS)
            measured = np.asarray(measured, dtype=np.float64).reshape(NUM_JOINTS)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ChunkRejected(
                f"joint target and measured position must be {NUM_JOINTS} numbers each: {exc}", field="actions[:, :7]"
            ) from None
        if not (np.all(np.isfinite(target)) and np.all(np.isfinite(measured))):
            raise ChunkRejected("joint target or measured position is not finite", field="actions[:, :7]")
        ref = measured if self._reference is None else self._reference
        clamped = []

        # 2. limits minus margin; a joint already outside them may only move back towards them
        safe = np.clip(target, *widened(cfg.lower, cfg.upper, ref))
        if not np.array_equal(safe, target):
            clamped.append("joint_limit")

        # 3. per-step change (velocity cap)
        step = cfg.step_limit
        stepped = np.clip(safe, ref - step, ref + step)
        if not np.array_equal(stepped, safe):
            clamped.append("step_limit")
        safe = stepped

        # 4. workspace box: never end further outside than where we start; shorten the step by bisection
        if cfg.has_workspace:
            allowed = self.workspace_violation(ref) + 1e-9
            if self.workspace_violation(safe) > allowed:
                good, _ = longest_safe_fraction(
                    lambda f: self.workspace_violation(ref + f * (safe - ref)) <= allowed, 12
                )
                safe = ref + good * (safe - ref)
                clamped.append("workspace")

        self._reference = safe
        return SafeCommand(joint_targets=safe, clamped=tuple(clamped))
