"""`resize_with_pad` in plain numpy, pixel for pixel what openpi-client's PIL version returns.

DROID clients (openpi's and DreamZero's) resize camera frames with `openpi_client.image_tools.resize_with_pad`, i.e.
PIL's bilinear resize. The model was evaluated on those pixels, so the sim evaluation and the robot must send exactly
them, without PIL in this package. PIL's bilinear filter is a separable convolution whose triangle widens with the
downscale factor (so it antialiases), computed with 22-bit fixed-point weights: a horizontal pass rounded to uint8,
then a vertical pass. The code below re-derives those steps; `tests/unit/droid_runtime/test_image_tools.py` checks it
bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

from dreamzero_client.errors import InvalidObservation

_PRECISION_BITS = 22  # PIL: 32 - 8 - 2, so 255 * weight sums never overflow int32


def resize_with_pad(images: np.ndarray, height: int, width: int, field: str = "image") -> np.ndarray:
    """Fit uint8 [..., H, W, 3] images inside (height, width) keeping the aspect ratio, centred on black.

    The fitted size is (int(H / r), int(W / r)) with r = max(W / width, H / height); images already at the target
    size come back unchanged (the same object, as openpi's does).
    """
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim < 3 or images.shape[-1] != 3:
        raise InvalidObservation(
            f"{field}: expected uint8 RGB images [..., H, W, 3], got {images.dtype} {list(images.shape)}", field=field
        )
    if images.shape[-3:-1] == (height, width):
        return images
    flat = images.reshape((-1,) + images.shape[-3:])
    out = np.stack([_resize_one(img, height, width, field) for img in flat])
    return out.reshape(images.shape[:-3] + (height, width, 3))


def _resize_one(img: np.ndarray, height: int, width: int, field: str) -> np.ndarray:
    cur_h, cur_w = img.shape[:2]
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    if new_h < 1 or new_w < 1:
        raise InvalidObservation(f"{field}: a {cur_h}x{cur_w} image would shrink to {new_h}x{new_w}", field=field)
    resized = img
    if new_w != cur_w:  # PIL skips a pass whose size does not change
        resized = _resample_axis(resized, new_w, axis=1)
    if new_h != cur_h:
        resized = _resample_axis(resized, new_h, axis=0)
    canvas = np.zeros((height, width, 3), dtype=np.uint8)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas[top : top + new_h, left : left + new_w] = resized
    return canvas


def _resample_axis(img: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One separable pass along `axis` (1: columns, 0: rows) -> uint8, rounded and clipped as PIL does."""
    index, weights = _bilinear_taps(img.shape[axis], out_size)
    used = np.flatnonzero(weights.any(axis=0))  # the widest windows' outer taps often weigh 0 everywhere
    src = np.ascontiguousarray(np.moveaxis(img, axis, 0))
    rows = src.reshape(src.shape[0], -1)  # [in, rest]: each tap gathers whole contiguous rows
    acc = np.full((out_size, rows.shape[1]), 1 << (_PRECISION_BITS - 1), dtype=np.int32)
    term = np.empty_like(acc)
    for tap in used:  # integer sums are exact, so the order of the taps does not matter
        np.multiply(rows[index[:, tap]], weights[:, tap, None], out=term)
        acc += term
    out = np.clip(acc >> _PRECISION_BITS, 0, 255).astype(np.uint8).reshape((out_size,) + src.shape[1:])
    return np.moveaxis(out, 0, axis)


def _bilinear_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Source indices [out, taps] and fixed-point weights [out, taps] of PIL's bilinear filter (support 1).

    The order of the float operations follows PIL's, so the weights round to the same integers.
    """
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = 1.0 * filter_scale
    n_taps = int(math.ceil(support)) * 2 + 1
    centre = (np.arange(out_size) + 0.5) * scale
    first = np.maximum(np.trunc(centre - support + 0.5).astype(np.int64), 0)
    count = np.minimum(np.trunc(centre + support + 0.5).astype(np.int64), in_size) - first
    taps = np.arange(n_taps)
    source = taps[None, :] + first[:, None]
    x = np.abs((source.astype(np.float64) - centre[:, None] + 0.5) * (1.0 / filter_scale))
    w = np.where((x < 1.0) & (taps[None, :] < count[:, None]), 1.0 - x, 0.0)
    total = np.zeros(out_size)
    for tap in range(n_taps):  # summed left to right like PIL (np.sum's pairwise order rounds differently)
        total += w[:, tap]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    fixed = np.floor(0.5 + w * (1 << _PRECISION_BITS)).astype(np.int32)
    return np.minimum(source, in_size - 1), fixed
