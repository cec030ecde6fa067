"""The environment contract every DROID evaluation simulator implements, and a checker for it.

A DROID env is a `gymnasium.Env` (reset / step / close, `observation_space`, `action_space`) plus:

- observations: a dict with the keys in `OBS_KEYS`
    exterior_image_0_left, exterior_image_1_left, wrist_image_left: uint8 [H, W, 3] RGB (any size; the runner
        applies `resize_with_pad` to 180x320)
    joint_position: float [7] (rad), gripper_position: float [1] in [0, 1] (0 open, 1 closed)
- actions: float [8] = 7 absolute joint targets (rad) + gripper (binary 0/1 after the runner's rule), applied at
  `control_hz` (15 Hz on DROID)
- `instruction`: the scene's prompt; `scene_id`: 1, 2 or 3
- `object_poses()`: {name: float [7] (x, y, z, qw, qx, qy, qz)} in the world frame, for the step record
- `is_success()`: the scene's success rule on the current object positions (see `eval.success`)
- `max_episode_steps`: the step limit after which `step` reports truncated=True

The MuJoCo scene (`eval.mujoco_droid`) and the Isaac Lab adapter (`eval.isaac_sim_evals`) both implement it; tests
use fakes that implement it too.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from dreamzero.errors import InvalidObservation
from dreamzero_droid import droid

IMAGE_KEYS = droid.CAMERAS
STATE_KEYS = ("joint_position", "gripper_position")
OBS_KEYS = IMAGE_KEYS + STATE_KEYS
ACTION_DIM = droid.ACTION_DIM
NUM_JOINTS = droid.NUM_JOINTS


@runtime_checkable
class DroidEnv(Protocol):
    instruction: str
    scene_id: int
    control_hz: float
    max_episode_steps: int

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]: ...

    def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, dict]: ...

    def object_poses(self) -> dict[str, np.ndarray]: ...

    def is_success(self) -> bool: ...

    def close(self) -> None: ...


def check_droid_observation(obs: Any) -> None:
    """Raise InvalidObservation naming the first field that breaks the contract."""
    if not isinstance(obs, dict):
        raise InvalidObservation(f"observation: expected a dict, got {type(obs).__name__}", field="observation")
    for key in OBS_KEYS:
        if key not in obs:
            raise InvalidObservation(f"observation.{key}: missing (keys present: {sorted(obs)})", field=key)
    for key in IMAGE_KEYS:
        img = obs[key]
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] != 3:
            got = f"{getattr(img, 'dtype', type(img).__name__)} {getattr(img, 'shape', '')}"
            raise InvalidObservation(f"observation.{key}: expected uint8 [H, W, 3], got {got}", field=key)
    for key, size in (("joint_position", NUM_JOINTS), ("gripper_position", 1)):
        arr = np.asarray(obs[key])
        if arr.shape != (size,) or not np.issubdtype(arr.dtype, np.floating) or not np.all(np.isfinite(arr)):
            raise InvalidObservation(
                f"observation.{key}: expected finite float [{size}], got {arr.dtype} {arr.shape}", field=key
            )
    grip = float(np.asarray(obs["gripper_position"])[0])
    if not 0.0 <= grip <= 1.0:
        raise InvalidObservation(
            f"observation.gripper_position: expected a value in [0, 1], got {grip}", field="gripper_position"
        )


def check_droid_env(env: Any, steps: int = 2, seed: int = 0) -> None:
    """Check the DROID-specific part of the contract by resetting and stepping `env` at its current joint targets.

    (Run gymnasium's `check_env` as well for the gymnasium part.)
    """
    for attr in ("instruction", "scene_id", "control_hz", "max_episode_steps"):
        if not hasattr(env, attr):
            raise InvalidObservation(f"env.{attr}: missing from {type(env).__name__}", field=attr)
    if not isinstance(env.instruction, str) or not env.instruction:
        raise InvalidObservation("env.instruction: expected a non-empty string", field="instruction")
    obs, _ = env.reset(seed=seed)
    check_droid_observation(obs)
    for _ in range(steps):
        action = np.concatenate([np.asarray(obs["joint_position"], dtype=np.float64), [0.0]])
        obs, reward, terminated, truncated, info = env.step(action)
        check_droid_observation(obs)
        if not isinstance(terminated, bool) or not isinstance(truncated, bool):
            raise InvalidObservation("env.step: terminated/truncated must be bools", field="step")
    poses = env.object_poses()
    for name, pose in poses.items():
        if np.asarray(pose).shape != (7,):
            raise InvalidObservation(f"env.object_poses()[{name!r}]: expected [7], got {np.shape(pose)}", field=name)
    if not isinstance(env.is_success(), bool):
        raise InvalidObservation("env.is_success(): expected a bool", field="is_success")
