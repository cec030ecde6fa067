"""`model_frames`: the canvas as the model reads it. On CPU a strong downscale reads only the pixels bilinear weighs
(dreamzero/pipeline/inputs.py); its values must be F.interpolate's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dreamzero.pipeline.inputs import SMALL_OUTPUT, model_frames


def reference(images: np.ndarray, hw) -> torch.Tensor:
    x = torch.from_numpy(images)
    b, t, h, w, _ = x.shape
    x = x.permute(0, 1, 4, 2, 3).reshape(b * t, 3, h, w).float() / 127.5 - 1.0
    if hw is not None:
        x = F.interpolate(x, size=tuple(hw), mode="bilinear", align_corners=False)
    return x.reshape(b, t, 3, x.shape[-2], x.shape[-1])


@pytest.mark.parametrize(
    "canvas, hw",
    [((352, 640), (32, 64)), ((352, 640), (64, 128)), ((176, 320), (40, 72)), ((352, 640), (160, 320)),
     ((64, 128), (64, 128)), ((64, 128), None), ((48, 50), (7, 9))],
)  # fmt: skip
def test_frames_equal_f_interpolate(canvas, hw):
    images = np.random.default_rng(0).integers(0, 256, (2, 3, *canvas, 3), dtype=np.uint8)
    got = model_frames(images, torch.device("cpu"), hw)
    want = reference(images, hw)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=2.5e-7)  # one float32 ulp of [-1, 1]
    if hw is None or hw[0] * hw[1] * SMALL_OUTPUT > canvas[0] * canvas[1]:
        assert torch.equal(got, want)  # F.interpolate itself


def test_read_only_wire_arrays_are_read_not_copied_or_warned():
    images = np.full((1, 1, 352, 640, 3), 255, np.uint8)
    images.flags.writeable = False
    with warnings.catch_warnings(record=True) as with_warnings:
        warnings.simplefilter("always")
        out = model_frames(images, torch.device("cpu"), (32, 64))
    assert not with_warnings
    assert torch.all(out == 1.0)
