"""A small synthetic DROID-keyed LeRobot v3.0 dataset for the training tests (written by our demo writer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dreamzero_droid.lerobot import Episode, write_dataset
from eval.mujoco_droid.record import MODALITY, VIDEO_FEATURES

TASK = "put the cube in the bowl"


def synthetic_episodes(n_episodes: int = 2, length: int = 60, hw=(64, 112), seed: int = 0) -> list[Episode]:
    """Smooth random joint paths, a gripper that closes half way, and frames whose colour follows the joints."""
    rng = np.random.default_rng(seed)
    episodes = []
    for _ in range(n_episodes):
        joints = np.cumsum(rng.normal(0, 0.02, size=(length, 7)), axis=0) + rng.normal(0, 0.3, size=7)
        grip = (np.arange(length) >= length // 2).astype(np.float64)[:, None]
        state = np.concatenate([joints, grip], 1).astype(np.float32)
        action = np.concatenate([joints + 0.01, grip], 1).astype(np.float32)  # targets a little ahead
        base = rng.integers(0, 255, size=(1, *hw, 3))
        shade = (np.tanh(joints[:, :3]) * 60)[:, None, None, :]
        frames = np.clip(base + shade, 0, 255).astype(np.uint8)
        episodes.append(
            Episode(
                task=TASK,
                vectors={"observation.state": state, "action": action},
                videos={key: frames for key in VIDEO_FEATURES.values()},
            )
        )
    return episodes


def write_synthetic_dataset(root: Path, **kwargs) -> Path:
    import json

    write_dataset(root, synthetic_episodes(**kwargs), fps=15.0, robot_type="synthetic")
    (root / "meta" / "modality.json").write_text(json.dumps(MODALITY))
    return root


def write_franka_pnp_dataset(root: Path, n_episodes: int = 2, length: int = 60, hw=(48, 48), seed: int = 1) -> Path:
    """A franka_pnp-keyed dataset (RLinf's real-robot layout: 19 state numbers, 7 TCP-delta actions, two cameras)."""
    rng = np.random.default_rng(seed)
    episodes = []
    for _ in range(n_episodes):
        state = np.cumsum(rng.normal(0, 0.05, size=(length, 19)), axis=0).astype(np.float32)
        action = np.clip(rng.normal(0, 0.4, size=(length, 7)), -1, 1).astype(np.float32)
        frames = rng.integers(0, 255, size=(length, *hw, 3)).astype(np.uint8)
        episodes.append(
            Episode(
                task="pick up the red block",
                vectors={"state": state, "actions": action},
                videos={"observation.images.image": frames, "observation.images.wrist_image": frames[:, ::-1]},
            )
        )
    write_dataset(root, episodes, fps=10.0, robot_type="franka")
    return root
