"""Metadata dicts with round numbers (so expected values can be worked out by hand) and raw observations."""

from __future__ import annotations

import numpy as np


def stats(q01, q99, mean=None, std=None):
    q01, q99 = list(map(float, q01)), list(map(float, q99))
    mean = mean or [(a + b) / 2 for a, b in zip(q01, q99)]
    std = std or [1.0] * len(q01)
    return {"min": q01, "max": q99, "mean": mean, "std": std, "q01": q01, "q99": q99}


def droid_metadata() -> dict:
    """Joint state in [-2, 2] except joint 7 constant; joint deltas in [-1, 1] (identity); gripper in [0, 1]."""
    return {
        "oxe_droid": {
            "statistics": {
                "state": {
                    "joint_position": stats([-2] * 6 + [0.5], [2] * 6 + [0.5]),
                    "gripper_position": stats([0], [1]),
                },
                "action": {"joint_position": stats([-1] * 7, [1] * 7), "gripper_position": stats([0], [1])},
            },
            "modalities": {"state": {"joint_position": {"shape": [7]}, "gripper_position": {"shape": [1]}}},
            "embodiment_tag": "oxe_droid",
        }
    }


def libero_metadata(tag: str = "libero_sim") -> dict:
    """State dims in [0, 4]; actions in [-2, 2] (un-normalised = 2 y)."""
    return {
        tag: {
            "statistics": {
                "state": {"state": stats([0] * 8, [4] * 8)},
                "action": {"actions": stats([-2] * 7, [2] * 7)},
            },
            "embodiment_tag": tag,
        }
    }


JOINTS = np.array([0.0, -0.6, 0.0, -2.5, 0.0, 1.9, 0.5])


def droid_observation(batch: int | None = None, frames: int = 1, hw=(180, 320), seed: int = 0) -> dict:
    """Own-key DROID observation; batch=None -> unbatched (single frame when frames == 1)."""
    rng = np.random.default_rng(seed)
    lead = ([] if batch is None else [batch]) + ([] if frames == 1 and batch is None else [frames])

    def image():
        return rng.integers(0, 256, (*lead, *hw, 3), dtype=np.uint8)

    state_lead = [] if batch is None else [batch]
    return {
        "video.exterior_image_1_left": image(),
        "video.exterior_image_2_left": image(),
        "video.wrist_image_left": image(),
        "state.joint_position": np.broadcast_to(JOINTS, (*state_lead, 7)).copy(),
        "state.gripper_position": np.full((*state_lead, 1), 0.25),
    }
