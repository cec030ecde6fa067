"""The DROID client conventions, in one place for the sim evaluation and the real Franka.

- A DROID observation (what a simulator or the robot produces each control step) is a dict with the three camera
  frames in `CAMERAS` (uint8 [H, W, 3] RGB, any size), `joint_position` float [7] (rad), `gripper_position` float [1]
  in [0, 1] (1 closed) and optionally `prompt`.
- `make_frame` turns it into a `Frame`: every camera resized with `image_tools.resize_with_pad` to 180x320.
- `FrameHistory` keeps one frame per control step. A session's first query sends 1 frame; every later query sends 4,
  taken at `FRAME_OFFSETS` = (-23, -16, -8, 0) steps from the current one, as DreamZero's DROID client does: a block
  spans the 24 steps of one action chunk and starts right after the step 24 back (the newest frame of the block
  before, when the chunk is executed whole), so whole-chunk queries never send a frame twice. Both links send the
  same frames (the OpenPI server uses a 4-frame stack as sent).
- `raw_observation` builds the embodiment-keyed raw form ("video.*" [1, T, H, W, 3], "state.*" [1, D]) for
  `POST /v1/actions/generations` and the in-process policy; `openpi_observation` builds the OpenPI / RoboArena dict
  (frames [H, W, 3], or [T, H, W, 3] stacks the server uses as sent). `OPENPI_DROID_KEY_MAP` links the two and is
  the map the server's OpenPI adapter uses too.
- `binarize_gripper`: DROID's gripper rule, closed (1.0) iff the policy's output is above 0.5.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from dreamzero_client.errors import InvalidObservation
from dreamzero_client.wire.openpi import OPENPI_DROID_KEY_MAP
from dreamzero_droid.image_tools import resize_with_pad

CAMERAS = ("exterior_image_0_left", "exterior_image_1_left", "wrist_image_left")
IMAGE_HW = (180, 320)  # (H, W) on the wire
NUM_JOINTS = 7
ACTION_DIM = NUM_JOINTS + 1  # 7 absolute joint targets (rad) + gripper in [0, 1]
GRIPPER_THRESHOLD = 0.5
FRAME_OFFSETS = (-23, -16, -8, 0)
HISTORY_LEN = 1 - FRAME_OFFSETS[0]  # frames to keep for FRAME_OFFSETS

_RAW = {key.removeprefix("observation/"): raw for key, raw in OPENPI_DROID_KEY_MAP.items()}


@dataclass(frozen=True)
class Frame:
    """One control step as the policy sees it: the cameras at IMAGE_HW and the proprioceptive state."""

    images: dict[str, np.ndarray]  # camera -> uint8 [180, 320, 3]
    joint_position: np.ndarray  # float32 [7]
    gripper_position: np.ndarray  # float32 [1]


def make_frame(obs: dict, image_hw: tuple[int, int] = IMAGE_HW) -> Frame:
    """Validate a DROID observation and resize its cameras; errors name the offending key."""
    if not isinstance(obs, dict):
        raise InvalidObservation(f"observation: expected a dict, got {type(obs).__name__}", field="observation")
    missing = [k for k in (*CAMERAS, "joint_position", "gripper_position") if k not in obs]
    if missing:
        raise InvalidObservation(f"observation.{missing[0]}: missing (keys present: {sorted(obs)})", field=missing[0])
    images = {cam: resize_with_pad(obs[cam], *image_hw, field=f"observation.{cam}") for cam in CAMERAS}
    joints = _state(obs["joint_position"], "joint_position", NUM_JOINTS)
    gripper = _state(obs["gripper_position"], "gripper_position", 1)
    return Frame(images, joints, gripper)


def _state(value, key: str, size: int) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise InvalidObservation(f"observation.{key}: expected {size} numbers, got {value!r:.80}", field=key) from exc
    if arr.shape != (size,) or not np.all(np.isfinite(arr)):
        raise InvalidObservation(f"observation.{key}: expected {size} finite numbers, got {arr.tolist()}", field=key)
    return arr


class FrameHistory:
    """The last HISTORY_LEN frames of one session, oldest first."""

    def __init__(self) -> None:
        self._frames: deque[Frame] = deque(maxlen=HISTORY_LEN)

    def __len__(self) -> int:
        return len(self._frames)

    def append(self, frame: Frame) -> None:
        self._frames.append(frame)

    def clear(self) -> None:
        self._frames.clear()

    def select(self, first_call: bool) -> list[Frame]:
        """1 frame on a session's first query; else the frames at FRAME_OFFSETS, clamped to the session's start."""
        if not self._frames:
            raise InvalidObservation("no observation recorded for this session yet", field="observation")
        if first_call:
            return [self._frames[-1]]
        last = len(self._frames) - 1
        return [self._frames[max(0, last + off)] for off in FRAME_OFFSETS]


def raw_observation(frames: list[Frame]) -> dict[str, np.ndarray]:
    """The raw form of one session: "video.*" uint8 [1, T, H, W, 3], "state.*" float32 [1, D] (the newest frame)."""
    obs = {_RAW[cam]: np.stack([f.images[cam] for f in frames])[None] for cam in CAMERAS}
    obs[_RAW["joint_position"]] = frames[-1].joint_position[None]
    obs[_RAW["gripper_position"]] = frames[-1].gripper_position[None]
    return obs


def openpi_observation(frames: list[Frame]) -> dict[str, np.ndarray]:
    """The OpenPI DROID keys: cameras [H, W, 3] for one frame, [T, H, W, 3] for several; state of the newest frame."""
    newest = frames[-1]
    obs: dict[str, np.ndarray] = {}
    for cam in CAMERAS:
        stack = np.stack([f.images[cam] for f in frames])
        obs[f"observation/{cam}"] = stack[0] if len(frames) == 1 else stack
    obs["observation/joint_position"] = newest.joint_position
    obs["observation/gripper_position"] = newest.gripper_position
    return obs


def binarize_gripper(value: float, threshold: float = GRIPPER_THRESHOLD) -> float:
    """DROID's gripper rule: 1.0 (closed) iff the policy's gripper output is above `threshold`, else 0.0 (open)."""
    return 1.0 if float(value) > threshold else 0.0
