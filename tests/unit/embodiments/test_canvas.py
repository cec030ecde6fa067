"""The one-pass canvas writer gives the bytes of `CropResize` + stitch (the training transform), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero.embodiments import canvas as canvas_mod
from dreamzero.embodiments.canvas import CanvasWriter, Slot
from dreamzero.embodiments.libero_sim import LiberoSim
from dreamzero.embodiments.oxe_droid import EXTERIOR_1, EXTERIOR_2, WRIST, OxeDroid
from dreamzero.embodiments.transforms import CropResize, stitch_droid, stitch_side_by_side
from tests.support.embodiments import droid_metadata, libero_metadata

needs_numba = pytest.mark.skipif(canvas_mod.numba is None, reason="numba is not installed: only the torch path runs")


def _old_droid(views: dict[str, np.ndarray]) -> np.ndarray:
    crop = CropResize(out_hw=OxeDroid.view_hw)
    resized = {}
    for key, frames in views.items():
        b, t = frames.shape[:2]
        resized[key] = crop(frames.reshape(b * t, *frames.shape[2:])).reshape(b, t, *OxeDroid.view_hw, 3)
    return stitch_droid(resized[WRIST], resized[EXTERIOR_1], resized[EXTERIOR_2])


def _views(keys, shape, seed, readonly=True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for key in keys:
        arr = rng.integers(0, 256, shape, dtype=np.uint8)
        arr.flags.writeable = not readonly  # decoded wire arrays are read-only views
        out[key] = arr
    return out


@pytest.mark.parametrize(
    "shape",
    [(2, 4, 180, 320, 3), (1, 1, 720, 1280, 3), (1, 2, 480, 640, 3), (1, 3, 181, 323, 3), (2, 1, 97, 151, 3)],
)
def test_droid_canvas_equals_crop_resize_and_stitch(shape):
    emb = OxeDroid(droid_metadata())
    views = _views((EXTERIOR_1, EXTERIOR_2, WRIST), shape, seed=sum(shape))
    got = emb.render_canvas(views)
    assert got.shape == (*shape[:2], 352, 640, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, _old_droid(views))


@needs_numba
@pytest.mark.parametrize("hw", [(180, 320), (181, 323), (97, 151), (256, 256)])
def test_the_kernel_serves_upscales_and_small_downscales(hw):
    """Sizes near the model's view go through the kernel (not the torch fallback) and still match on new images."""
    emb = OxeDroid(droid_metadata())
    assert emb.canvas_writer.plan(hw) is not None
    views = _views((EXTERIOR_1, EXTERIOR_2, WRIST), (1, 2, *hw, 3), seed=hw[0])
    np.testing.assert_array_equal(emb.render_canvas(views), _old_droid(views))


@pytest.mark.parametrize("hw", [(256, 256), (255, 257), (480, 640)])
def test_libero_canvas_equals_crop_resize_and_side_by_side(hw):
    emb = LiberoSim(libero_metadata())
    views = _views(("video.image", "video.wrist_image"), (2, 2, *hw, 3), seed=hw[1], readonly=False)
    crop = CropResize(out_hw=LiberoSim.view_hw)
    old = [crop(views[k].reshape(4, *hw, 3)).reshape(2, 2, 256, 256, 3) for k in ("video.image", "video.wrist_image")]
    np.testing.assert_array_equal(emb.render_canvas(views), stitch_side_by_side(old))


def test_float_and_strided_frames_give_the_same_bytes():
    emb = OxeDroid(droid_metadata())
    views = _views((EXTERIOR_1, EXTERIOR_2, WRIST), (1, 2, 180, 320, 3), seed=7)
    want = _old_droid(views)
    as_float = {k: v.astype(np.float32) / 255.0 for k, v in views.items()}  # torch path
    np.testing.assert_array_equal(emb.render_canvas(as_float), want)
    channel_first = {k: np.moveaxis(np.ascontiguousarray(np.moveaxis(v, -1, -3)), -3, -1) for k, v in views.items()}
    assert not next(iter(channel_first.values())).flags.c_contiguous
    np.testing.assert_array_equal(emb.render_canvas(channel_first), want)


def test_preprocess_uses_the_same_canvas():
    emb = OxeDroid(droid_metadata())
    views = _views((EXTERIOR_1, EXTERIOR_2, WRIST), (1, 4, 180, 320, 3), seed=11)
    obs = {**views, "state.joint_position": np.zeros((1, 7)), "state.gripper_position": np.zeros((1, 1))}
    batch, _ = emb.preprocess(obs, "pick", batched=True)
    np.testing.assert_array_equal(batch.images, _old_droid(views))


def test_slots_must_tile_the_canvas():
    crop = CropResize(out_hw=(4, 6))
    with pytest.raises(ValueError, match="do not tile"):
        CanvasWriter(crop, {"a": Slot(0, 0)}, (4, 12))
    with pytest.raises(ValueError, match="leaves the"):
        CanvasWriter(crop, {"a": Slot(0, 0), "b": Slot(0, 8)}, (4, 12))


@needs_numba
def test_a_size_the_kernel_cannot_reproduce_falls_back(monkeypatch):
    """When the probe disagrees with torch (forced here), the writer keeps CropResize's bytes."""
    writer = CanvasWriter(CropResize(out_hw=(8, 10)), {"a": Slot(0, 0, width_repeat=2)}, (8, 20))
    monkeypatch.setattr(canvas_mod, "_reference_floats", lambda frames, crop: np.full((1,), -1.0, np.float32))
    frames = np.random.default_rng(0).integers(0, 256, (1, 1, 12, 15, 3), dtype=np.uint8)
    assert writer.plan((12, 15)) is None
    want = np.repeat(CropResize(out_hw=(8, 10))(frames[0]), 2, axis=-2)[None]
    np.testing.assert_array_equal(writer.render({"a": frames}), want)


def test_the_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(canvas_mod.KERNEL_ENV, "0")
    emb = OxeDroid(droid_metadata())
    assert emb.canvas_writer.plan((180, 320)) is None
    views = _views((EXTERIOR_1, EXTERIOR_2, WRIST), (1, 1, 180, 320, 3), seed=3)
    np.testing.assert_array_equal(emb.render_canvas(views), _old_droid(views))


def test_rendering_on_several_threads_gives_each_request_its_own_canvas():
    """The front door renders raw requests on a thread pool (deployments/stages.py): new sizes are planned once and
    concurrent renders never mix their canvases."""
    from concurrent.futures import ThreadPoolExecutor

    emb = OxeDroid(droid_metadata())
    shapes = [(1, 4, 180, 320, 3), (1, 1, 190, 330, 3), (2, 2, 180, 320, 3), (1, 1, 200, 300, 3)] * 3
    requests = [_views((EXTERIOR_1, EXTERIOR_2, WRIST), shape, seed=i) for i, shape in enumerate(shapes)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(emb.render_canvas, requests))
    for views, canvas in zip(requests, got):
        np.testing.assert_array_equal(canvas, _old_droid(views))
    assert {(190, 330), (200, 300), (180, 320)} <= set(emb.canvas_writer._plans)
