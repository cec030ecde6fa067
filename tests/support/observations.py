"""DROID observations as the tests build them: the OpenPI frame a robot sends over the WebSocket (flat
`observation/...` keys, `openpi_droid_observation`) and the dict the DROID client runtime reads from a robot
(camera names, `droid_runtime_observation`). numpy only at import, so the client distribution's tests can use it."""

from __future__ import annotations

import numpy as np

#: the three DROID cameras of an OpenPI frame, in the order their images are drawn from the seed
OPENPI_IMAGE_KEYS = (
    "observation/exterior_image_0_left",
    "observation/exterior_image_1_left",
    "observation/wrist_image_left",
)


def openpi_droid_observation(
    seed: int = 0,
    session_id: str | None = None,
    prompt: str | None = "pick up the cup",
    *,
    frames: int | None = None,
    hw: tuple[int, int] = (180, 320),
    gripper: float = 0.0,
    cartesian: bool = False,
) -> dict:
    """One OpenPI DROID frame as an openpi client sends it: three random camera images (one unbatched image, or
    `frames` stacked), joint positions in [-1, 1], the gripper, optionally the cartesian pose; the prompt and the
    session id unless None."""
    rng = np.random.default_rng(seed)
    shape = (*hw, 3) if frames is None else (frames, *hw, 3)
    obs = {key: rng.integers(0, 256, shape, dtype=np.uint8) for key in OPENPI_IMAGE_KEYS}
    obs["observation/joint_position"] = rng.uniform(-1, 1, 7).astype(np.float32)
    obs["observation/gripper_position"] = np.array([gripper], np.float32)
    if cartesian:
        obs["observation/cartesian_position"] = np.zeros(6)
    if prompt is not None:
        obs["prompt"] = prompt
    if session_id is not None:
        obs["session_id"] = session_id
    return obs


def droid_runtime_observation(
    value: int = 0, hw: tuple[int, int] = (180, 320), gripper: float = 0.0, prompt: str | None = None
) -> dict:
    """What a DROID robot hands the client runtime: each camera a flat image of `value + its index` (so a test can
    tell frames and cameras apart), joints 0, 0.1, ..., 0.6, the gripper, and the prompt unless None."""
    from dreamzero_droid import droid  # the DROID runtime: only the tests that use it need it installed

    obs: dict = {cam: np.full((*hw, 3), value + i, np.uint8) for i, cam in enumerate(droid.CAMERAS)}
    obs.update(joint_position=np.arange(7) * 0.1, gripper_position=np.array([gripper]))
    if prompt is not None:
        obs["prompt"] = prompt
    return obs
