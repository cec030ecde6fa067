"""What a batch must hold (`validate_batch`, before any session is touched) and its frames as the model reads them
(`model_frames`: uint8 canvas -> [-1, 1] at the model's input size)."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from dreamzero import rtc
from dreamzero.config import DiTConfig
from dreamzero.errors import InvalidObservation
from dreamzero.types import ROW_OPTIONS, ModelBatch


def validate_batch(batch: ModelBatch, dit_cfg: DiTConfig, action_horizon: int, max_action_dim: int) -> None:
    """Raise InvalidObservation naming the field for a batch the model cannot run: ids, images, state, prompts,
    per-row lists, seeds and the real-time chunking options."""
    n = len(batch.session_ids)
    if n == 0:
        raise InvalidObservation("session_ids is empty: a batch needs at least one row", field="session_ids")
    if any(not isinstance(s, str) or not s for s in batch.session_ids):
        raise InvalidObservation("every session id must be a non-empty string", field="session_ids")
    if len(set(batch.session_ids)) != n:
        dup = sorted({s for s in batch.session_ids if batch.session_ids.count(s) > 1})
        raise InvalidObservation(f"session ids must be unique within a batch; repeated: {dup}", field="session_ids")
    img = batch.images
    if not isinstance(img, np.ndarray) or img.ndim != 5 or img.shape[-1] != 3 or img.dtype != np.uint8:
        got = f"{getattr(img, 'dtype', type(img).__name__)} {getattr(img, 'shape', '')}"
        raise InvalidObservation(f"images must be uint8 [B, T, H, W, 3], got {got}", field="images")
    if img.shape[0] != n:
        raise InvalidObservation(f"images has {img.shape[0]} rows, session_ids has {n}", field="images")
    block = 2 * dit_cfg.num_frame_per_block  # new frames per chunk (4 on DROID)
    if img.shape[1] not in (1, block):
        raise InvalidObservation(f"images must hold 1 or {block} frames per row, got {img.shape[1]}", field="images")
    want = (n, 1, dit_cfg.max_state_dim)
    if not isinstance(batch.state, np.ndarray) or tuple(batch.state.shape) != want:
        raise InvalidObservation(
            f"state must be float [B, 1, {want[2]}], got {getattr(batch.state, 'shape', None)}", field="state"
        )
    if not np.isfinite(batch.state).all():
        raise InvalidObservation("state holds NaN or inf", field="state")
    for name in ("prompts", "negative_prompts"):
        value = getattr(batch, name)
        if (value is not None or name == "prompts") and (
            not isinstance(value, (list, tuple)) or any(not isinstance(p, str) for p in value)
        ):
            raise InvalidObservation(f"{name} must be a list of {n} strings", field=name)
    for name in ("prompts", *ROW_OPTIONS):  # every per-row option, a new one included
        value = getattr(batch, name)
        if value is None:
            continue
        entries = len(value) if hasattr(value, "__len__") and not isinstance(value, (str, bytes)) else None
        if entries != n:
            got = type(value).__name__ if entries is None else f"{entries} entries"
            raise InvalidObservation(f"{name} has {got}, the batch has {n} rows", field=name)
    if batch.seeds is not None and any(not isinstance(s, (int, np.integer)) or s < 0 for s in batch.seeds):
        raise InvalidObservation("seeds must be non-negative integers", field="seeds")
    rtc.requests(batch, action_horizon, max_action_dim)  # real-time chunking options


def model_frames(images: np.ndarray, device: torch.device, model_input_hw) -> torch.Tensor:
    """uint8 [B, T, H, W, 3] -> [B, T, 3, H', W'] in [-1, 1] at the model's input size (bilinear resize)."""
    images = np.ascontiguousarray(images)
    with warnings.catch_warnings():
        # read-only arrays (decoded wire bytes, Ray's object store) are only read: `.float()` below makes new
        # memory before anything could write, so no copy is taken here
        warnings.simplefilter("ignore", UserWarning)
        x = torch.from_numpy(images)
    b, t, h, w, _ = x.shape
    hw = None if model_input_hw is None or tuple(model_input_hw) == (h, w) else tuple(model_input_hw)
    if hw is not None and device.type == "cpu" and hw[0] * hw[1] * SMALL_OUTPUT <= h * w:
        return _bilinear_gathered(x, hw)
    x = x.to(device)
    x = x.permute(0, 1, 4, 2, 3).reshape(b * t, 3, h, w).float() / 127.5 - 1.0
    if hw is not None:
        x = F.interpolate(x, size=hw, mode="bilinear", align_corners=False)
    return x.reshape(b, t, 3, x.shape[-2], x.shape[-1])


#: on CPU, an output at most 1/16 of the canvas's pixels (the tiny preset's 32x64 and the small default's 64x128 from
#: DROID's 352x640) is computed from the four pixels bilinear reads per output pixel instead of converting the whole
#: canvas to float first: 8 DROID rows of 4 frames, one thread, 150 -> 19 ms at 32x64, 186 -> 41 ms at 64x128; the
#: values equal F.interpolate's to one float32 ulp. Larger outputs (a real checkpoint's 160x320) keep F.interpolate,
#: which is faster there and whose values stay bit for bit
SMALL_OUTPUT = 16


@functools.lru_cache(maxsize=16)
def _source_taps(n_in: int, n_out: int):
    """Bilinear's two source indices and weights per output index, as F.interpolate computes them: read off its
    resize of a one-hot row per source index (so rounding and clamping at the edges are its own)."""
    eye = torch.eye(n_in).reshape(1, n_in, 1, n_in)
    dense = F.interpolate(eye, size=(1, n_out), mode="bilinear", align_corners=False)[0, :, 0, :]  # [n_in, n_out]
    i0 = (dense != 0).int().argmax(dim=0)
    i1 = (i0 + 1).clamp(max=n_in - 1)
    cols = torch.arange(n_out)
    w0, w1 = dense[i0, cols], torch.where(i1 != i0, dense[i1, cols], 0.0)
    return i0, i1, w0, w1


def _bilinear_gathered(x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """uint8 [B, T, H, W, 3] -> float [B, T, 3, H', W'] in [-1, 1], reading only the pixels bilinear weighs."""
    r0, r1, a0, a1 = _source_taps(x.shape[2], hw[0])
    c0, c1, b0, b1 = _source_taps(x.shape[3], hw[1])
    a0, a1, b0, b1 = a0[:, None, None], a1[:, None, None], b0[:, None], b1[:, None]

    def pixels(rows, cols):
        return x[:, :, rows][:, :, :, cols].float() / 127.5 - 1.0

    out = a0 * (b0 * pixels(r0, c0) + b1 * pixels(r0, c1)) + a1 * (b0 * pixels(r1, c0) + b1 * pixels(r1, c1))
    return out.permute(0, 1, 4, 2, 3).contiguous()
