"""Validation and shape normalisation of raw observations, before any transform runs.

Accepted forms (every error names the key as the caller sent it, the expected and the received shape/dtype):
- images: [H,W,3] or [T,H,W,3] unbatched, [B,H,W,3] or [B,T,H,W,3] batched; channel-first ([..., 3, H, W]) too;
  uint8, or float in [0, 1];
- state: [D] unbatched, [B,D] or [B,T,D] batched (the last row is the current state); a scalar when D == 1.
Whether an observation is batched is decided by the state (its ndim), since a 4-D image is ambiguous on its own:
[T,H,W,3] unbatched or [B,H,W,3] batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dreamzero.errors import InvalidObservation

_FLOAT_TOLERANCE = 1e-3  # float images may overshoot [0, 1] by rounding noise; more than this is a client bug


@dataclass
class ParsedObservation:
    """A validated observation under the embodiment's own keys."""

    views: dict[str, np.ndarray]  # video key -> [B, T, H, W, 3], uint8 or float32 in [0, 1], channel-last
    state: dict[str, np.ndarray]  # state key -> float64 [B, D] (the current state)
    instructions: list[str] | None  # from the observation itself (rollout `task_descriptions`, openpi `prompt`)
    batched: bool

    @property
    def batch_size(self) -> int:
        return next(iter(self.state.values())).shape[0]


def _describe(value: np.ndarray) -> str:
    return f"shape {tuple(value.shape)} dtype {value.dtype}"


def as_array(value, field: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise InvalidObservation(f"{field}: cannot be read as an array ({exc})", field=field) from exc
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise InvalidObservation(f"{field}: expected a numeric array, received dtype {arr.dtype}", field=field)
    return arr


def batch_mode_from_state(value: np.ndarray, field: str) -> bool:
    """True if a state array is batched ([B,D] / [B,T,D]), False for [D] or a scalar."""
    if value.ndim <= 1:
        return False
    if value.ndim in (2, 3):
        return True
    raise InvalidObservation(f"{field}: expected (D,), (B, D) or (B, T, D), received {_describe(value)}", field=field)


def parse_state(value, field: str, width: int, batched: bool) -> np.ndarray:
    """One state key -> float64 [B, width] (current state = last row)."""
    arr = as_array(value, field)
    expected = f"({width},)" if not batched else f"(B, {width}) or (B, T, {width})"
    if arr.dtype.kind == "b":
        raise InvalidObservation(f"{field}: expected a float array {expected}, received {_describe(arr)}", field=field)
    if not batched and arr.ndim == 0 and width == 1:
        arr = arr.reshape(1)
    if not batched and arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]  # [1, D] sent for one observation
    if batched and arr.ndim == 1 and width == 1:
        arr = arr[:, None]  # one scalar per row (e.g. a gripper position)
    ok = (arr.ndim == 1) if not batched else arr.ndim in (2, 3)
    if not ok or arr.shape[-1] != width or (batched and arr.ndim == 3 and arr.shape[1] == 0):
        raise InvalidObservation(f"{field}: expected shape {expected}, received {_describe(arr)}", field=field)
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise InvalidObservation(f"{field}: holds NaN or inf values", field=field)
    if not batched:
        return arr[None, :]
    return arr[:, -1, :] if arr.ndim == 3 else arr


def parse_frames(value, field: str, batched: bool) -> np.ndarray:
    """One camera -> [B, T, H, W, 3] channel-last, uint8 or float32 in [0, 1]."""
    arr = as_array(value, field)
    single, stack = (3, 4) if not batched else (4, 5)
    expected = (
        "(H, W, 3) or (T, H, W, 3)" if not batched else "(B, H, W, 3) or (B, T, H, W, 3)"
    ) + " uint8 or float in [0, 1], channel-last or channel-first"
    if arr.ndim not in (single, stack):
        raise InvalidObservation(f"{field}: expected {expected}, received {_describe(arr)}", field=field)
    if arr.shape[-1] != 3:
        if arr.shape[-3] != 3:
            raise InvalidObservation(f"{field}: expected {expected}, received {_describe(arr)}", field=field)
        arr = np.moveaxis(arr, -3, -1)  # channel-first -> channel-last
    if arr.ndim == single:
        arr = arr[None] if not batched else arr[:, None]  # add T
    if not batched:
        arr = arr[None]  # add B
    if min(arr.shape) == 0:
        raise InvalidObservation(f"{field}: empty image, received {_describe(arr)}", field=field)
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype.kind in "iu":  # JSON carries pixels as int64 lists: accept 0..255 integers as uint8
        if arr.min() < 0 or arr.max() > 255:
            raise InvalidObservation(
                f"{field}: integer images must lie in 0..255, received values in [{arr.min()}, {arr.max()}]",
                field=field,
            )
        return arr.astype(np.uint8)
    if arr.dtype.kind != "f":
        raise InvalidObservation(f"{field}: expected uint8 or float in [0, 1], received {_describe(arr)}", field=field)
    if not np.isfinite(arr).all():
        raise InvalidObservation(f"{field}: holds NaN or inf values", field=field)
    lo, hi = float(arr.min()), float(arr.max())
    if lo < -_FLOAT_TOLERANCE or hi > 1.0 + _FLOAT_TOLERANCE:
        raise InvalidObservation(
            f"{field}: float images must lie in [0, 1] (send uint8 for 0..255), received values in [{lo:g}, {hi:g}]",
            field=field,
        )
    return np.clip(arr, 0.0, 1.0).astype(np.float32)


def parse_instructions(value, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    arr = np.asarray(value, dtype=object).reshape(-1)
    out = []
    for item in arr:
        if isinstance(item, bytes):
            item = item.decode("utf-8", "replace")
        if not isinstance(item, str):
            raise InvalidObservation(f"{field}: expected strings, received {type(item).__name__}", field=field)
        out.append(item)
    return out
