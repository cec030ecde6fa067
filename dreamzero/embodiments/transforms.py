"""Small composable transforms shared by every embodiment: images, state normalisation, actions, prompts.

Each transform is a pure function of its inputs (plus statistics fixed at construction), so the same objects run in
the Preprocess / Postprocess deployments, in the embedded policy and in the tests.
Shapes: B = batch rows, T = frames, H/W = pixels, D = dims of one state/action key, A = action horizon.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dreamzero.metadata import KeyStats

# ---------------------------------------------------------------------------------------------------------------------
# 1. Images
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CropResize:
    """Centre crop to (int(scale H), int(scale W)), bilinear resize with antialias, truncate back to uint8.

    This is the eval-time image transform the checkpoints were trained with; truncation (not rounding) is deliberate.
    """

    out_hw: tuple[int, int]
    scale: float = 0.95

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """frames: uint8 or float in [0, 1], [N, H, W, 3] -> uint8 [N, out_h, out_w, 3]."""
        frames = np.ascontiguousarray(frames)
        if not frames.flags.writeable:  # decoded wire arrays are read-only views; torch wants writable memory
            frames = frames.copy()
        x = torch.from_numpy(frames)
        h, w = x.shape[1:3]
        ch, cw = int(self.scale * h), int(self.scale * w)
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        # crop first, then one copy into planar [N, 3, h, w] before the float conversion: the antialiased resize is
        # faster on CPU in that layout than on the channels-last view, same numbers (docs/benchmarks.md)
        x = x[:, top : top + ch, left : left + cw].permute(0, 3, 1, 2).contiguous()
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        if (ch, cw) != tuple(self.out_hw):
            x = F.interpolate(x, size=tuple(self.out_hw), mode="bilinear", align_corners=False, antialias=True)
        x = (x.clamp(0.0, 1.0) * 255.0).to(torch.uint8)  # truncation, as in training
        return x.permute(0, 2, 3, 1).contiguous().numpy()


def stitch_side_by_side(views: list[np.ndarray]) -> np.ndarray:
    """[..., H, W, 3] views of equal height -> [..., H, sum(W), 3], left to right (LIBERO: exterior | wrist)."""
    return np.concatenate(views, axis=-2)


def stitch_droid(wrist: np.ndarray, exterior_1: np.ndarray, exterior_2: np.ndarray) -> np.ndarray:
    """DROID canvas: top row = wrist with every pixel repeated twice along width; bottom = exterior 1 | exterior 2.

    [..., h, w, 3] x 3 -> [..., 2h, 2w, 3] (176x320 views -> 352x640 canvas).
    """
    top = np.repeat(wrist, 2, axis=-2)  # [..., h, 2w, 3]
    bottom = np.concatenate([exterior_1, exterior_2], axis=-2)  # [..., h, 2w, 3]
    return np.concatenate([top, bottom], axis=-3)


# ---------------------------------------------------------------------------------------------------------------------
# 2. State / action normalisation (q99)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Q99Normaliser:
    """`2 (x - q01) / (q99 - q01) - 1` clamped to [-1, 1]; constant dims (q01 == q99) pass through, then clamp.

    `q01` / `q99` are the bounds mapped to -1 / +1: the 1st and 99th percentiles (upstream), or the minimum and
    maximum when the metadata's `normalisation_bounds` asks for "min_max"."""

    q01: np.ndarray
    q99: np.ndarray

    @classmethod
    def from_stats(cls, stats: KeyStats, bounds: str = "q01_q99") -> Q99Normaliser:
        low, high = stats.bounds(bounds)
        return cls(q01=np.asarray(low, np.float64), q99=np.asarray(high, np.float64))

    @property
    def dim(self) -> int:
        return int(self.q01.shape[0])

    def normalise(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        span = self.q99 - self.q01
        constant = span == 0
        safe_span = np.where(constant, 1.0, span)  # avoid 0/0; those dims are replaced below
        y = np.where(constant, x, 2.0 * (x - self.q01) / safe_span - 1.0)
        return np.clip(y, -1.0, 1.0)

    def unnormalise(self, y: np.ndarray) -> np.ndarray:
        """`(y + 1) / 2 (q99 - q01) + q01`, no clamp (a constant dim comes back as its constant)."""
        y = np.asarray(y, np.float64)
        return (y + 1.0) / 2.0 * (self.q99 - self.q01) + self.q01


def pad_with_mask(x: np.ndarray, width: int, field: str = "state") -> tuple[np.ndarray, np.ndarray]:
    """[B, D] -> zero padded float32 [B, 1, width] and bool mask [B, 1, width] of the real dims."""
    b, d = x.shape
    if d > width:
        raise ValueError(f"{field}: {d} dims do not fit the model's max_state_dim {width}")
    out = np.zeros((b, 1, width), np.float32)
    out[:, 0, :d] = x
    mask = np.zeros((b, 1, width), bool)
    mask[:, 0, :d] = True
    return out, mask


# ---------------------------------------------------------------------------------------------------------------------
# 3. Actions
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddCurrentState:
    """Relative -> absolute: add the current state (one row per batch row) to every row of the action chunk."""

    action_key: str
    state_key: str

    def __call__(self, actions: np.ndarray, current_state: np.ndarray) -> np.ndarray:
        """actions [B, A, D] + current_state [B, D] -> [B, A, D]."""
        return actions + current_state[:, None, :]


@dataclass(frozen=True)
class BinariseGripper:
    """Gripper rule on the way out: `high if x > threshold else low`, applied to one dim of one action key."""

    action_key: str
    index: int = -1  # dim inside the key
    threshold: float = 0.5
    low: float = 0.0
    high: float = 1.0

    def __call__(self, actions: np.ndarray) -> np.ndarray:
        """actions [B, A, D] of `action_key` -> same shape with dim `index` binarised."""
        out = actions.copy()
        out[..., self.index] = np.where(out[..., self.index] > self.threshold, self.high, self.low)
        return out


# ---------------------------------------------------------------------------------------------------------------------
# 4. Prompts
# ---------------------------------------------------------------------------------------------------------------------

DEFAULT_INSTRUCTION = "Perform the default behavior."

NEGATIVE_PROMPT = (
    "Vibrant colors, overexposed, static, blurry details, text, subtitles, style, artwork, painting, image, still, "
    "grayscale, dull, worst quality, low quality, JPEG artifacts, ugly, mutilated, extra fingers, bad hands, bad face, "
    "deformed, disfigured, mutated limbs, fused fingers, stagnant image, cluttered background, three legs, many people "
    "in the background, walking backwards."
)


def clean_instruction(instruction: str | None) -> str:
    """Lower-cased instruction; a Python-literal list/tuple string (some datasets store tasks so) gives item 0."""
    text = (instruction or "").strip()
    if text[:1] in "[(" and text:
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            parsed = None
        if isinstance(parsed, (list, tuple)) and parsed:
            text = str(parsed[0]).strip()
    return (text or DEFAULT_INSTRUCTION).lower()


@dataclass(frozen=True)
class PromptTemplate:
    """`prefix + i + middle + i` where i is the cleaned instruction (the trained template repeats it)."""

    prefix: str
    middle: str

    def __call__(self, instruction: str | None) -> str:
        i = clean_instruction(instruction)
        return self.prefix + i + self.middle + i
