"""Image helpers of the DROID client: `resize_with_pad` (what the DROID sim sends) and the side-by-side video frame."""

from __future__ import annotations

import numpy as np
from PIL import Image

from dreamzero.errors import InvalidObservation

DROID_IMAGE_SIZE = (180, 320)  # (H, W) on the wire


def resize_with_pad(images: np.ndarray, height: int = 180, width: int = 320) -> np.ndarray:
    """Aspect-preserving bilinear resize of uint8 [..., H, W, 3] images onto a black (height, width) canvas, centred.

    ratio = max(W / width, H / height); the image becomes (int(H / ratio), int(W / ratio)). A no-op at the target size.
    """
    images = np.asarray(images)
    if images.ndim < 3 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise InvalidObservation(
            f"image: expected uint8 [..., H, W, 3], got {images.dtype} {images.shape}", field="image"
        )
    if images.shape[-3:-1] == (height, width):
        return images
    lead = images.shape[:-3]
    flat = images.reshape((-1,) + images.shape[-3:])
    out = np.stack([_resize_one(img, height, width) for img in flat])
    return out.reshape(lead + (height, width, 3))


def _resize_one(img: np.ndarray, height: int, width: int) -> np.ndarray:
    cur_h, cur_w = img.shape[:2]
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    resized = np.asarray(Image.fromarray(img).resize((new_w, new_h), resample=Image.BILINEAR))
    canvas = np.zeros((height, width, 3), dtype=np.uint8)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas[top : top + new_h, left : left + new_w] = resized
    return canvas


def side_by_side(views: list[np.ndarray], height: int = 180, width: int = 320) -> np.ndarray:
    """One video frame: each view padded to (height, width), left to right -> uint8 [height, n * width, 3]."""
    return np.concatenate([resize_with_pad(v, height, width) for v in views], axis=1)
