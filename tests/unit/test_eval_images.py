"""resize_with_pad (the DROID client's image transform) and the side-by-side video frame."""

import numpy as np
import pytest

from dreamzero.errors import InvalidObservation
from eval.images import resize_with_pad, side_by_side


def test_720p_fills_the_canvas_exactly():
    img = np.full((720, 1280, 3), 200, dtype=np.uint8)
    out = resize_with_pad(img, 180, 320)
    assert out.shape == (180, 320, 3) and out.dtype == np.uint8
    assert (out == 200).all()  # same aspect ratio: no padding anywhere


def test_480x640_gets_black_side_bars():
    img = np.full((480, 640, 3), 255, dtype=np.uint8)
    out = resize_with_pad(img, 180, 320)
    # ratio = max(640/320, 480/180) = 2.667 -> 180 x 240 image, centred: 40 px bars left and right
    assert (out[:, :40] == 0).all() and (out[:, 280:] == 0).all()
    assert (out[:, 41:279] == 255).all()


def test_noop_at_target_size_and_batched_leading_dims():
    img = np.random.default_rng(0).integers(0, 255, (180, 320, 3), dtype=np.uint8)
    assert resize_with_pad(img) is img
    batch = np.zeros((2, 4, 90, 160, 3), dtype=np.uint8)
    batch[1, 2] = 77
    out = resize_with_pad(batch)
    assert out.shape == (2, 4, 180, 320, 3)
    assert (out[1, 2] == 77).all() and (out[0] == 0).all()


def test_bilinear_keeps_a_gradient_monotonic():
    ramp = np.tile(np.linspace(0, 255, 1280, dtype=np.uint8)[None, :, None], (720, 1, 3))
    row = resize_with_pad(ramp)[90, :, 0].astype(int)
    assert (np.diff(row) >= 0).all() and row[0] < 10 and row[-1] > 245


@pytest.mark.parametrize("bad", [np.zeros((180, 320), np.uint8), np.zeros((180, 320, 3), np.float32)])
def test_bad_images_name_the_field(bad):
    with pytest.raises(InvalidObservation) as err:
        resize_with_pad(bad)
    assert err.value.field == "image"


def test_side_by_side_frame():
    views = [np.full((720, 1280, 3), v, np.uint8) for v in (10, 20, 30)]
    frame = side_by_side(views)
    assert frame.shape == (180, 960, 3)
    assert frame[0, 0, 0] == 10 and frame[0, 320, 0] == 20 and frame[0, 959, 0] == 30
