"""Local DROID-like scene on MuJoCo (CPU, headless): the default simulator of `dreamzero-eval`.

`MujocoDroidEnv(scene_id)` is also registered with gymnasium as ``DreamZero/MujocoDroid-v0`` (kwargs: scene_id, ...).
"""

from __future__ import annotations

import gymnasium as gym

from eval.mujoco_droid.env import MujocoDroidEnv

ENV_ID = "DreamZero/MujocoDroid-v0"
if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point="eval.mujoco_droid.env:MujocoDroidEnv")

__all__ = ["ENV_ID", "MujocoDroidEnv"]
