"""Embodiment transforms with hand-computed expected values: q99 normalisation, canvas layouts, actions, prompts."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero.embodiments import get_embodiment, known_tags, register_embodiment
from dreamzero.embodiments.libero_sim import LiberoSim
from dreamzero.embodiments.transforms import (
    DEFAULT_INSTRUCTION,
    NEGATIVE_PROMPT,
    BinariseGripper,
    CropResize,
    Q99Normaliser,
    clean_instruction,
    stitch_droid,
)
from dreamzero.errors import ConfigError
from tests.support.embodiments import JOINTS, droid_metadata, droid_observation, libero_metadata

# ---------------------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------------------


def test_registry_knows_three_tags_and_suggests_the_closest():
    assert {"oxe_droid", "libero_sim", "franka_pnp"} <= set(known_tags())
    with pytest.raises(ConfigError, match=r"known tags: .*Did you mean 'oxe_droid'"):
        get_embodiment("oxe_droide")


def test_register_a_new_robot():
    class TwoCamArm(LiberoSim):
        tag = "two_cam_arm_test"
        known_widths = {}

    register_embodiment(TwoCamArm)
    emb = get_embodiment("two_cam_arm_test", libero_metadata("two_cam_arm_test"))
    assert emb.action_dim == 7 and emb.canvas_hw == (256, 512)
    with pytest.raises(ConfigError, match="already registered"):

        class Other(LiberoSim):
            tag = "two_cam_arm_test"

        register_embodiment(Other)


def test_shipped_synthetic_metadata_loads_for_every_tag():
    for tag, dim, horizon in (("oxe_droid", 8, 24), ("libero_sim", 7, 16), ("franka_pnp", 7, 24)):
        emb = get_embodiment(tag)
        assert emb.metadata.synthetic
        assert (emb.action_dim, emb.action_horizon) == (dim, horizon)


def test_metadata_width_mismatch_names_the_key():
    meta = droid_metadata()
    del meta["oxe_droid"]["modalities"]  # else the modalities' own shape check fires first
    meta["oxe_droid"]["statistics"]["state"]["joint_position"] = {k: [0.0] * 6 for k in ("min", "max", "mean", "std")}
    meta["oxe_droid"]["statistics"]["state"]["joint_position"].update(q01=[-1.0] * 6, q99=[1.0] * 6)
    with pytest.raises(ConfigError, match=r"state\.joint_position has 6 dims, oxe_droid needs 7"):
        get_embodiment("oxe_droid", meta)


# ---------------------------------------------------------------------------------------------------------------------
# q99 normalisation
# ---------------------------------------------------------------------------------------------------------------------


def test_q99_normalise_clamps_and_passes_constant_dims_through():
    norm = Q99Normaliser(q01=np.array([0.0, -1.0, 2.0]), q99=np.array([10.0, 1.0, 2.0]))
    x = np.array([[5.0, 0.5, 0.3], [12.0, -3.0, 1.5], [2.5, 1.0, 7.0]])
    expected = np.array([[0.0, 0.5, 0.3], [1.0, -1.0, 1.0], [-0.5, 1.0, 1.0]])  # dim 3 constant: x, then clamp
    np.testing.assert_allclose(norm.normalise(x), expected, atol=1e-12)


def test_q99_unnormalise_inverts_in_range_values():
    norm = Q99Normaliser(q01=np.array([0.0, -1.0, 2.0]), q99=np.array([10.0, 1.0, 2.0]))
    y = np.array([-0.5, 0.5, 0.3])
    np.testing.assert_allclose(norm.unnormalise(y), [2.5, 0.5, 2.0])  # constant dim -> its constant
    x = np.array([7.5, -0.25, 2.0])
    np.testing.assert_allclose(norm.unnormalise(norm.normalise(x))[:2], x[:2])
    assert norm.unnormalise(np.array([3.0, 0.0, 0.0]))[0] == 20.0  # no clamp on the way out


def test_state_is_normalised_in_key_order_padded_and_masked():
    emb = get_embodiment("oxe_droid", droid_metadata())
    batch, ctx = emb.preprocess(droid_observation(), "go")
    # joints 1-6 in [-2, 2] -> x / 2; joint 7 constant 0.5 -> passes through; gripper in [0, 1] -> 2 g - 1
    expected = [0.0, -0.3, 0.0, -1.0, 0.0, 0.95, 0.5, -0.5]
    assert batch.state.shape == (1, 1, 64) and batch.state.dtype == np.float32
    np.testing.assert_allclose(batch.state[0, 0, :8], expected, atol=1e-6)
    assert not batch.state[0, 0, 8:].any()
    assert batch.state_mask[0, 0, :8].all() and not batch.state_mask[0, 0, 8:].any()
    np.testing.assert_array_equal(ctx.state["state.joint_position"][0], JOINTS)
    assert ctx.batched is False


# ---------------------------------------------------------------------------------------------------------------------
# images and canvas layouts
# ---------------------------------------------------------------------------------------------------------------------


def test_centre_crop_offsets_without_resize_are_exact():
    img = np.random.default_rng(1).integers(0, 256, (1, 20, 40, 3), dtype=np.uint8)
    # crop (int(0.95*20), int(0.95*40)) = (19, 38); top = round(0.5) = 0, left = round(1.0) = 1
    out = CropResize(out_hw=(19, 38))(img)
    np.testing.assert_array_equal(out, img[:, 0:19, 1:39])


@pytest.mark.parametrize("hw", [(180, 320), (720, 1280)])
def test_crop_resize_equals_the_training_transform_written_out(hw):
    """Planar layout before the resize (a speed-up) leaves every byte as the plain training transform makes it:
    float in [0, 1], centre crop, antialiased bilinear resize, clamp, x255, truncation."""
    import torch
    import torch.nn.functional as F

    img = np.random.default_rng(5).integers(0, 256, (3, *hw, 3), dtype=np.uint8)
    img.flags.writeable = False  # as decoded from the wire
    x = torch.from_numpy(img.copy()).float().permute(0, 3, 1, 2) / 255.0
    ch, cw = int(0.95 * hw[0]), int(0.95 * hw[1])
    top, left = int(round((hw[0] - ch) / 2.0)), int(round((hw[1] - cw) / 2.0))
    x = F.interpolate(x[:, :, top : top + ch, left : left + cw], size=(176, 320), mode="bilinear", antialias=True)
    want = (x.clamp(0.0, 1.0) * 255.0).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    np.testing.assert_array_equal(CropResize(out_hw=(176, 320))(img), want)


def test_float_images_equal_uint8_images():
    img = np.random.default_rng(2).integers(0, 256, (2, 30, 50, 3), dtype=np.uint8)
    t = CropResize(out_hw=(16, 32))
    np.testing.assert_array_equal(t(img), t(img.astype(np.float32) / 255.0))


def test_stitch_droid_pixel_by_pixel():
    rng = np.random.default_rng(3)
    wrist, ext1, ext2 = (rng.integers(0, 256, (176, 320, 3), dtype=np.uint8) for _ in range(3))
    canvas = stitch_droid(wrist, ext1, ext2)
    assert canvas.shape == (352, 640, 3)
    for j in range(320):  # every wrist pixel twice along width on the top row
        np.testing.assert_array_equal(canvas[:176, 2 * j], wrist[:, j])
        np.testing.assert_array_equal(canvas[:176, 2 * j + 1], wrist[:, j])
    np.testing.assert_array_equal(canvas[176:, :320], ext1)
    np.testing.assert_array_equal(canvas[176:, 320:], ext2)


def _solid(colour, hw=(180, 320)):
    return np.broadcast_to(np.array(colour, np.uint8), (*hw, 3)).copy()


def test_droid_canvas_from_raw_views():
    emb = get_embodiment("oxe_droid", droid_metadata())
    wrist = _solid((0, 0, 255))
    wrist[:, 160:] = 0  # left half blue, right half black: checks the wrist is not mirrored or shifted
    obs = droid_observation()
    obs.update({
        "video.exterior_image_1_left": _solid((255, 0, 0)),
        "video.exterior_image_2_left": _solid((0, 255, 0)),
        "video.wrist_image_left": wrist,
    })  # fmt: skip
    batch, _ = emb.preprocess(obs, None)
    canvas = batch.images[0, 0]
    assert batch.images.shape == (1, 1, 352, 640, 3) and batch.images.dtype == np.uint8
    assert (canvas[176:, :320] == (255, 0, 0)).all()  # bottom-left: exterior 1
    assert (canvas[176:, 320:] == (0, 255, 0)).all()  # bottom-right: exterior 2
    assert (canvas[:176, :300] == (0, 0, 255)).all()  # top: wrist, 320 -> 640 wide
    assert (canvas[:176, 340:] == 0).all()
    np.testing.assert_array_equal(canvas[:176, 0::2], canvas[:176, 1::2])


def test_libero_canvas_is_exterior_then_wrist():
    emb = get_embodiment("libero_sim", libero_metadata())
    obs = {"video.image": _solid((10, 20, 30), (256, 256)), "video.wrist_image": _solid((200, 100, 0), (256, 256)),
           "state.state": np.full(8, 2.0)}  # fmt: skip
    batch, _ = emb.preprocess(obs, "x")
    assert batch.images.shape == (1, 1, 256, 512, 3)
    assert (batch.images[0, 0, :, :256] == (10, 20, 30)).all()
    assert (batch.images[0, 0, :, 256:] == (200, 100, 0)).all()
    np.testing.assert_allclose(batch.state[0, 0, :8], 0.0)  # mid-range state -> 0


# ---------------------------------------------------------------------------------------------------------------------
# actions
# ---------------------------------------------------------------------------------------------------------------------


def test_droid_actions_add_current_joints_and_binarise_gripper():
    emb = get_embodiment("oxe_droid", droid_metadata())
    _, ctx = emb.preprocess(droid_observation(), None)
    y = np.zeros((1, 3, 32))
    y[0, :, :7] = [[0.1] * 7, [-0.2] * 7, [0.0] * 7]  # joint deltas (stats [-1, 1]: un-normalised = y)
    y[0, :, 7] = [0.2, 0.0, -0.9]  # gripper: (y + 1) / 2 = 0.6, 0.5, 0.05 -> 1, 0 (not > 0.5), 0
    y[0, :, 8:] = 99.0  # padding is ignored
    out = emb.postprocess(y, ctx)
    assert out.shape == (1, 3, 8) and out.dtype == np.float32
    np.testing.assert_allclose(out[0, 0, :7], JOINTS + 0.1, atol=1e-6)
    np.testing.assert_allclose(out[0, 1, :7], JOINTS - 0.2, atol=1e-6)
    np.testing.assert_allclose(out[0, 2, :7], JOINTS, atol=1e-6)
    np.testing.assert_array_equal(out[0, :, 7], [1.0, 0.0, 0.0])
    split = emb.split_actions(out)
    assert split["action.joint_position"].shape == (1, 3, 7) and split["action.gripper_position"].shape == (1, 3, 1)


def test_libero_actions_unnormalise_without_state_and_gripper_is_plus_minus_one():
    emb = get_embodiment("libero_sim", libero_metadata())
    obs = {"video.image": _solid((0, 0, 0), (64, 64)), "video.wrist_image": _solid((0, 0, 0), (64, 64)),
           "state.state": np.full(8, 3.0)}  # fmt: skip
    _, ctx = emb.preprocess(obs, None)
    y = np.zeros((1, 2, 32))
    y[0, 0, :7] = [0.5, -0.5, 0.25, 0, 0, 0, 0.01]  # gripper un-normalised 0.02 > 0 -> +1
    y[0, 1, :7] = [1.5, 0, 0, 0, 0, 0, 0.0]  # gripper 0 -> -1 (not > 0); 1.5 -> 3.0 (no clamp)
    out = emb.postprocess(y, ctx)
    np.testing.assert_allclose(out[0, 0], [1.0, -1.0, 0.5, 0, 0, 0, 1.0])
    np.testing.assert_allclose(out[0, 1], [3.0, 0, 0, 0, 0, 0, -1.0])


def test_franka_pnp_binarises_its_last_action_dim():
    emb = get_embodiment("franka_pnp", libero_metadata("franka_pnp"))
    assert emb.action_horizon == 24
    rule = BinariseGripper("action.actions", index=-1, threshold=0.0, low=-1.0, high=1.0)
    assert rule.action_key == emb.gripper_rules[0].action_key and emb.gripper_rules[0].index == -1


def test_postprocess_rejects_wrong_shapes():
    emb = get_embodiment("oxe_droid", droid_metadata())
    _, ctx = emb.preprocess(droid_observation(), None)
    with pytest.raises(ValueError, match=r"expected \(B=1, A, >= 8\)"):
        emb.postprocess(np.zeros((2, 24, 32)), ctx)


# ---------------------------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------------------------

DROID_MIDDLE = (
    " The video is split into three views: The top view shows the camera view from the robot's wrist, the bottom-left "
    "view shows the camera view from the left exterior camera, and the bottom-right view shows the camera view from "
    "the right exterior camera. During training, one of the two bottom exterior views may be a black screen (dropped "
    "view). The robot "
)


def test_droid_prompt_text():
    emb = get_embodiment("oxe_droid", droid_metadata())
    text = "A multi-view video shows that a robot pick up the cup" + DROID_MIDDLE + "pick up the cup"
    assert emb.format_prompt("Pick up the Cup") == text
    assert emb.negative_prompt == NEGATIVE_PROMPT and NEGATIVE_PROMPT.endswith("walking backwards.")


def test_libero_prompt_text_and_default_instruction():
    emb = get_embodiment("libero_sim", libero_metadata())
    i = "perform the default behavior."
    assert emb.format_prompt(None) == (
        "A multi-view video shows that a robot " + i + " The video is split into two horizontal views: the left view "
        "shows the exterior camera and the right view shows the wrist camera. The robot " + i
    )
    assert clean_instruction("") == DEFAULT_INSTRUCTION.lower()


def test_literal_list_instruction_takes_its_first_element():
    assert clean_instruction("['Open the Drawer', 'close it']") == "open the drawer"
    assert clean_instruction("('Stack blocks',)") == "stack blocks"
    assert clean_instruction("[not a literal") == "[not a literal"


def test_openpi_server_config_for_droid():
    cfg = get_embodiment("oxe_droid", droid_metadata()).openpi_server_config()
    assert cfg == {
        "image_resolution": [180, 320], "n_external_cameras": 2, "needs_wrist_camera": True,
        "needs_stereo_camera": False, "needs_session_id": True, "action_space": "joint_position",
        "action_horizon": 24, "action_dim": 8,
    }  # fmt: skip


def test_inconsistent_robot_definitions_fail_at_construction():
    from dreamzero.embodiments.oxe_droid import OxeDroid
    from dreamzero.embodiments.transforms import AddCurrentState

    class BadGripper(OxeDroid):
        gripper_rules = (BinariseGripper("action.gripper_position", index=3),)

    class BadRelative(OxeDroid):
        relative_actions = (AddCurrentState("action.joint_position", "state.gripper_position"),)

    with pytest.raises(ConfigError, match="gripper dim 3 is outside action.gripper_position"):
        BadGripper(droid_metadata())
    with pytest.raises(ConfigError, match=r"relative action action.joint_position \(7 dims\)"):
        BadRelative(droid_metadata())
