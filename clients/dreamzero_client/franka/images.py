"""Image helpers in plain numpy (clients stay free of OpenCV / PIL)."""

from __future__ import annotations

import numpy as np

from dreamzero_client.errors import InvalidObservation


def _bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Bilinear resize of float (H, W, C) with pixel-centre alignment."""
    h, w = img.shape[:2]
    ys = np.clip((np.arange(out_h) + 0.5) * h / out_h - 0.5, 0, h - 1)
    xs = np.clip((np.arange(out_w) + 0.5) * w / out_w - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    top = img[y0][:, x0] * (1 - wx) + img[y0][:, x1] * wx
    bottom = img[y1][:, x0] * (1 - wx) + img[y1][:, x1] * wx
    return top * (1 - wy) + bottom * wy


def resize_with_pad(img: np.ndarray, height: int, width: int, field: str = "image") -> np.ndarray:
    """DROID's resize: keep the aspect ratio, fit inside (height, width), centre on black. No-op at the target size.

    Downscaling by 2x or more first averages integer blocks, so 720x1280 -> 180x320 does not alias.
    """
    if not (isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3):
        shape = getattr(img, "shape", None)
        raise InvalidObservation(f"{field} must be uint8 (H, W, 3) RGB, got {shape}", field=field)
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    src = img.astype(np.float32)
    block = int(ratio)
    if block >= 2:  # box pre-filter
        hh, ww = (h // block) * block, (w // block) * block
        src = src[:hh, :ww].reshape(hh // block, block, ww // block, block, 3).mean(axis=(1, 3))
    resized = np.clip(np.rint(_bilinear(src, new_h, new_w)), 0, 255).astype(np.uint8)
    canvas = np.zeros((height, width, 3), dtype=np.uint8)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas[top : top + new_h, left : left + new_w] = resized
    return canvas
