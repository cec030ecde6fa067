"""`dreamzero_droid.image_tools.resize_with_pad` is bit for bit openpi-client's PIL `resize_with_pad`."""

import numpy as np
import pytest

from dreamzero_client.errors import InvalidObservation
from dreamzero_droid.image_tools import resize_with_pad

openpi_image_tools = pytest.importorskip(
    "openpi_client.image_tools", reason="scripts/install.sh installs openpi-client"
)

SOURCES = [(180, 320), (720, 1280), (480, 640), (1080, 1920), (181, 321), (97, 203), (333, 777), (17, 5), (1, 7)]
TARGETS = [(180, 320), (224, 224), (97, 131), (360, 640)]


def _noise(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("target", TARGETS)
def test_equal_to_openpi_pixel_for_pixel(source, target):
    img = _noise(*source, seed=source[0] * 7 + target[1])
    ours, theirs = resize_with_pad(img, *target), openpi_image_tools.resize_with_pad(img, *target)
    assert ours.shape == theirs.shape == (*target, 3) and ours.dtype == np.uint8
    assert np.array_equal(ours, theirs)


def test_smooth_images_and_upscaling_match_too():
    # noise hides systematic rounding bias: a ramp and a 2x upscale exercise the fractional weights
    ramp = np.tile(np.linspace(0, 255, 1280, dtype=np.uint8)[None, :, None], (720, 1, 3))
    small = _noise(45, 80, seed=3)
    for img, (h, w) in ((ramp, (180, 320)), (ramp, (719, 1279)), (small, (180, 320)), (small, (181, 400))):
        assert np.array_equal(resize_with_pad(img, h, w), openpi_image_tools.resize_with_pad(img, h, w))


def test_batches_and_the_no_op_at_target_size():
    batch = np.stack([_noise(90, 160, seed=s) for s in range(6)]).reshape(2, 3, 90, 160, 3)
    ours = resize_with_pad(batch, 180, 320)
    assert ours.shape == (2, 3, 180, 320, 3)
    assert np.array_equal(ours, openpi_image_tools.resize_with_pad(batch, 180, 320))
    img = _noise(180, 320, seed=0)
    assert resize_with_pad(img, 180, 320) is img


def test_aspect_ratio_is_kept_with_centred_black_bars():
    out = resize_with_pad(np.full((480, 640, 3), 255, np.uint8), 180, 320)
    # ratio = max(640/320, 480/180) = 2.667 -> a 180 x 240 image with 40 px bars left and right
    assert (out[:, :40] == 0).all() and (out[:, 280:] == 0).all() and (out[:, 40:280] == 255).all()


@pytest.mark.parametrize(
    "bad", [np.zeros((180, 320), np.uint8), np.zeros((180, 320, 3), np.float32), np.zeros((180, 320, 4), np.uint8)]
)
def test_bad_images_name_the_field(bad):
    with pytest.raises(InvalidObservation, match="wrist: expected uint8 RGB") as err:
        resize_with_pad(bad, 180, 320, field="wrist")
    assert err.value.field == "wrist"


def test_an_image_too_thin_to_fit_is_refused():
    with pytest.raises(InvalidObservation, match="would shrink to 180x0"):
        resize_with_pad(np.zeros((2000, 1, 3), np.uint8), 180, 320)
