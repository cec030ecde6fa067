"""LIBERO observations -> one B-row request, and the reply -> B chunks of LIBERO actions. Pure numpy, no simulator.

A LIBERO observation (robosuite's dict) becomes a `LiberoFrame`: both camera images turned upright (the renderer's
images are upside down and mirrored: rotate by 180 degrees, as openpi and RLinf do) and the 8-dim `libero_sim` state
(eef position 3, eef orientation as axis-angle 3, gripper fingers 2). B frame stacks (T = 1 frame, or 4 spanning the
last chunk) become the body of one request in either form the server speaks:
- "raw": the `libero_sim` keys at environment scale; the server crops, resizes, stitches, normalises, and answers
  LIBERO actions [B, H, 7] with the gripper already -1/+1;
- "normalised": what RLinf's DreamZero adapter sends: the stitched 256x512 canvas, the q99-normalised state padded
  to 64 with its mask, formatted prompts; the server answers normalised actions [B, H, 32] and we un-normalise them
  here with the same embodiment code the server would run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dreamzero.embodiments.libero_sim import LiberoSim
from dreamzero.errors import ConfigError, InvalidObservation

FORMS = ("raw", "normalised")
ACTION_DIM = 7  # OSC_POSE delta (dx, dy, dz, droll, dpitch, dyaw) + gripper (-1 open, +1 close)
STATE_DIM = 8
#: the projector id of libero_sim in the released checkpoints (RLinf sends it per row)
LIBERO_EMBODIMENT_ID = 21
IMAGE_KEY = "agentview_image"
WRIST_KEY = "robot0_eye_in_hand_image"
#: frames of a 4-frame stack, as offsets from the current step (the embodiment's: one definition)
FRAME_OFFSETS = LiberoSim.frame_offsets
HISTORY_LEN = -FRAME_OFFSETS[0] + 1
#: keep the gripper open and the arm still while objects settle after an init state is set (as openpi's LIBERO eval)
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1.0])


class ChunkError(ValueError):
    """The reply's actions cannot be executed (wrong shape, non-finite values)."""


@dataclass
class LiberoFrame:
    """What the policy and the records need from one LIBERO observation."""

    image: np.ndarray  # uint8 [H, W, 3], agent view, upright
    wrist_image: np.ndarray  # uint8 [H, W, 3], eye-in-hand view, upright
    state: np.ndarray  # float64 [8]: eef pos 3, eef axis-angle 3, gripper finger positions 2
    joint_position: np.ndarray  # float64 [7] (rad), for the records


def flip_upright(image: np.ndarray) -> np.ndarray:
    """Rotate an [H, W, 3] image by 180 degrees (flip both axes); returns a contiguous copy."""
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise InvalidObservation(f"image: expected [H, W, 3], got shape {list(image.shape)}", field="image")
    return np.ascontiguousarray(image[::-1, ::-1])


def quat_xyzw_to_axis_angle(quat: Sequence[float]) -> np.ndarray:
    """Unit quaternion (x, y, z, w) -> axis * angle [3] with the angle in [0, 2 pi); zeros for the identity."""
    q = np.asarray(quat, dtype=np.float64).reshape(-1)
    if q.shape != (4,) or not np.all(np.isfinite(q)):
        raise InvalidObservation(
            f"robot0_eef_quat: expected 4 finite values, got {q.tolist()}", field="robot0_eef_quat"
        )
    norm = np.linalg.norm(q)
    if norm == 0.0:
        raise InvalidObservation("robot0_eef_quat: zero quaternion", field="robot0_eef_quat")
    q = q / norm
    w = float(np.clip(q[3], -1.0, 1.0))
    sin_half = np.sqrt(max(0.0, 1.0 - w * w))
    if sin_half < 1e-8:  # no rotation: the axis is undefined and the product is zero
        return np.zeros(3)
    return q[:3] / sin_half * (2.0 * np.arccos(w))


def frame_from_obs(obs: dict[str, Any]) -> LiberoFrame:
    """robosuite's observation dict -> `LiberoFrame` (error naming the missing or malformed key)."""
    for key in (IMAGE_KEY, WRIST_KEY, "robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"):
        if key not in obs:
            raise InvalidObservation(f"{key}: missing from the LIBERO observation (keys: {sorted(obs)})", field=key)
    images = {}
    for key in (IMAGE_KEY, WRIST_KEY):
        img = np.asarray(obs[key])
        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] != 3:
            raise InvalidObservation(f"{key}: expected uint8 [H, W, 3], got {img.dtype} {list(img.shape)}", field=key)
        images[key] = flip_upright(img)
    pos = np.asarray(obs["robot0_eef_pos"], dtype=np.float64).reshape(-1)
    fingers = np.asarray(obs["robot0_gripper_qpos"], dtype=np.float64).reshape(-1)
    if pos.shape != (3,) or fingers.shape != (2,):
        raise InvalidObservation(
            f"robot0_eef_pos / robot0_gripper_qpos: expected 3 and 2 values, got {pos.shape} and {fingers.shape}",
            field="robot0_eef_pos",
        )
    state = np.concatenate([pos, quat_xyzw_to_axis_angle(obs["robot0_eef_quat"]), fingers])
    joints = np.asarray(obs.get("robot0_joint_pos", np.zeros(7)), dtype=np.float64).reshape(-1)
    return LiberoFrame(images[IMAGE_KEY], images[WRIST_KEY], state, joints)


def frame_stack(history: Sequence[LiberoFrame], size: int) -> list[LiberoFrame]:
    """The frames one row sends, oldest first: the current frame (size 1), or the frames at FRAME_OFFSETS, the
    oldest available one standing in for steps before the episode began (a fresh episode repeats its first frame)."""
    if not history:
        raise ValueError("history: expected at least the current frame")
    if size == 1:
        return [history[-1]]
    if size != len(FRAME_OFFSETS):
        raise ConfigError(f"frame_stack: expected 1 or {len(FRAME_OFFSETS)}, got {size}")
    return [history[max(0, len(history) - 1 + off)] for off in FRAME_OFFSETS]


def raw_observation(stacks: Sequence[Sequence[LiberoFrame]]) -> dict[str, np.ndarray]:
    """B frame stacks (T frames each, the current one last) -> the raw `libero_sim` observation, one row per env:
    images [B, T, H, W, 3] and the current state [B, 8]."""
    if not stacks or any(len(s) != len(stacks[0]) or not s for s in stacks):
        raise ValueError("stacks: expected one non-empty frame stack per environment, all of the same length")
    return {
        "video.image": np.stack([[f.image for f in s] for s in stacks]),
        "video.wrist_image": np.stack([[f.wrist_image for f in s] for s in stacks]),
        "state.state": np.stack([s[-1].state for s in stacks]),
    }


@dataclass
class PreparedRequest:
    """One request's parts (what `ActionClient.generate` takes) and what decoding its reply needs."""

    observation: dict[str, np.ndarray]
    prompts: list[str]
    negative_prompts: list[str] | None
    form: str
    context: Any = None  # the embodiment's PostprocessContext (normalised form)


class RequestCodec:
    """Builds B-row requests in one form and turns replies into LIBERO action chunks float64 [B, H, 7].

    The normalised form needs the `libero_sim` statistics the server's model was trained with (`metadata`: a
    metadata.json path, a checkpoint directory, a dict, or None for the shipped synthetic file).
    """

    def __init__(self, form: str = "raw", metadata: Any = None):
        if form not in FORMS:
            raise ConfigError(f"form: expected one of {list(FORMS)}, got {form!r}")
        self.form = form
        self.embodiment = None
        if form == "normalised":
            from dreamzero.embodiments import get_embodiment

            self.embodiment = get_embodiment("libero_sim", metadata)

    def build(self, stacks: Sequence[Sequence[LiberoFrame]], instructions: Sequence[str]) -> PreparedRequest:
        """One request from B frame stacks (see `frame_stack`) and B task instructions."""
        if len(instructions) != len(stacks):
            raise ValueError(f"instructions: expected {len(stacks)} (one per environment), got {len(instructions)}")
        raw = raw_observation(stacks)
        if self.embodiment is None:
            return PreparedRequest(raw, list(instructions), None, "raw")
        batch, context = self.embodiment.preprocess(raw, list(instructions), batched=True)
        b = len(stacks)
        observation = {
            "images": batch.images,  # uint8 [B, T, 256, 512, 3]
            "state": batch.state,  # float32 [B, 1, 64]
            "state_mask": batch.state_mask,  # bool [B, 1, 64]
            "embodiment_id": np.full((b,), LIBERO_EMBODIMENT_ID, dtype=np.int64),
        }
        return PreparedRequest(observation, list(batch.prompts), list(batch.negative_prompts), "normalised", context)

    def actions(self, reply_actions: Any, prepared: PreparedRequest) -> np.ndarray:
        """The reply's actions -> finite float64 [B, H, 7] in LIBERO's range [-1, 1]."""
        b = len(prepared.prompts)
        try:
            arr = np.asarray(reply_actions, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ChunkError(f"actions are not numeric: {exc}") from exc
        want_dim = ACTION_DIM if prepared.form == "raw" else None
        if arr.ndim != 3 or arr.shape[0] != b or arr.shape[1] < 1 or (want_dim and arr.shape[2] != want_dim):
            raise ChunkError(f"actions: expected [B={b}, H, {want_dim or '32'}], got shape {list(arr.shape)}")
        if not np.all(np.isfinite(arr)):
            raise ChunkError(f"actions: {int((~np.isfinite(arr)).sum())} non-finite values")
        if prepared.form == "normalised":
            if arr.shape[2] < ACTION_DIM:
                raise ChunkError(f"actions: expected >= {ACTION_DIM} normalised dims, got {arr.shape[2]}")
            arr = self.embodiment.postprocess(arr, prepared.context).astype(np.float64)
        # the OSC controller clips too; clipping here makes the recorded action the executed one
        return np.clip(arr, -1.0, 1.0)
