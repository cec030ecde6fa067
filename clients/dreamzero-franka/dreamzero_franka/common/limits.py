"""The arm's limits and the limit arithmetic both Franka safety filters share: DROID's joint filter
(`droid/safety.py`) and franka_pnp's Cartesian filter (`pnp/safety.py`).

- the Franka Research 3 joint limits and velocity caps (`FR3_*`), and the DROID home pose both loops and the simulated
  arm start from;

- `JointLimitFields`: the FR3 joint limits, margin and velocity caps of a safety config, their checks and the limits
  minus the margin;
- `per_step_limit`: the largest change per control step (a step bound or what a speed cap allows in one period);
- `widened`: limits a reference already outside them may stay at (it may only move back, never further out);
- `longest_safe_fraction`: bisection for the longest safe part of a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_franka.common.contracts import NUM_JOINTS

#: Franka Research 3 limits (rad, rad/s) and the DROID home pose
FR3_JOINT_LOWER = np.array([-2.7437, -1.7837, -2.9007, -3.0421, -2.8065, 0.5445, -3.0159])
FR3_JOINT_UPPER = np.array([2.7437, 1.7837, 2.9007, -0.1518, 2.8065, 4.5169, 3.0159])
FR3_MAX_JOINT_VELOCITY = np.array([2.075, 2.075, 2.075, 2.075, 2.51, 2.51, 2.51])
DROID_HOME = np.array([0.0, -np.pi / 5, 0.0, -4 * np.pi / 5, 0.0, 3 * np.pi / 5, 0.0])

T = TypeVar("T")


class JointLimitFields:
    """Mixin of a safety config dataclass with the fields `joint_lower`, `joint_upper`, `joint_margin_rad` and
    `max_joint_velocity` (each config declares them itself, so its field order stays its own)."""

    joint_lower: np.ndarray
    joint_upper: np.ndarray
    joint_margin_rad: float
    max_joint_velocity: np.ndarray

    def _check_joint_limits(self, prefix: str) -> None:
        """Turn the joint fields into float64 arrays and check them; `prefix` names the config in errors."""
        for name in ("joint_lower", "joint_upper", "max_joint_velocity"):
            value = np.asarray(getattr(self, name), dtype=np.float64)
            if value.shape != (NUM_JOINTS,) or not np.all(np.isfinite(value)):
                raise ConfigError(f"{prefix}.{name} must be {NUM_JOINTS} finite numbers, got {getattr(self, name)!r}")
            setattr(self, name, value)
        if not 0 <= self.joint_margin_rad < 0.5:
            raise ConfigError(f"{prefix}.joint_margin_rad must be in [0, 0.5), got {self.joint_margin_rad}")
        if np.any(self.lower >= self.upper):
            raise ConfigError(
                f"{prefix}.joint_lower + margin must stay below {prefix}.joint_upper - margin on every joint"
            )
        if np.any(self.max_joint_velocity <= 0):
            raise ConfigError(f"{prefix}.max_joint_velocity must be positive on every joint")

    @property
    def lower(self) -> np.ndarray:
        return self.joint_lower + self.joint_margin_rad

    @property
    def upper(self) -> np.ndarray:
        return self.joint_upper - self.joint_margin_rad


def per_step_limit(max_step, max_speed, control_hz: float):
    """The smaller of the step bound and the speed cap times one control period (elementwise for arrays), so the
    commanded speed never exceeds the cap at any control rate."""
    return np.minimum(max_step, np.asarray(max_speed) / control_hz)


def widened(lower, upper, reference) -> tuple[np.ndarray, np.ndarray]:
    """`lower` / `upper` moved out to `reference` where it lies outside them: a reference that is already outside (a
    manual move, a measured pose within the controller's tolerance) may stay there, and only move back in."""
    return np.minimum(lower, reference), np.maximum(upper, reference)


def longest_safe_fraction(probe: Callable[[float], T], iterations: int) -> tuple[float, T | None]:
    """Bisection on [0, 1] for the longest safe part of a step: `probe(fraction)` answers something falsy (False,
    None) where that part is unsafe. Returns the largest fraction found safe and its answer there, or (0.0, None)
    when none was (the caller holds). The full step (1.0) is never probed: the callers bisect after it failed."""
    good, bad, found = 0.0, 1.0, None
    for _ in range(iterations):
        mid = 0.5 * (good + bad)
        answer = probe(mid)
        if answer:
            good, found = mid, answer
        else:
            bad = mid
    return good, found
