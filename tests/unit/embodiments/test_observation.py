"""Observation forms users actually send (single frames, stacks, channel-first, float, batched, OpenPI, RLinf
rollouts) and the errors for wrong keys, shapes, dtypes and non-finite values."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero.embodiments import get_embodiment
from dreamzero.errors import InvalidObservation
from tests.support.embodiments import JOINTS, droid_metadata, droid_observation, libero_metadata


@pytest.fixture(scope="module")
def droid():
    return get_embodiment("oxe_droid", droid_metadata())


@pytest.fixture(scope="module")
def libero():
    return get_embodiment("libero_sim", libero_metadata())


@pytest.mark.parametrize(
    ("batch", "frames", "expected"),
    [(None, 1, (1, 1)), (None, 4, (1, 4)), (3, 1, (3, 1)), (2, 4, (2, 4))],
)
def test_frame_and_batch_forms(droid, batch, frames, expected):
    obs = droid_observation(batch=batch, frames=frames, hw=(90, 160))
    b, ctx = droid.preprocess(obs, "x")
    assert b.images.shape == (*expected, 352, 640, 3)
    assert b.state.shape == (expected[0], 1, 64) and len(b.prompts) == expected[0]
    assert ctx.batched is (batch is not None)


def test_batched_single_frames_without_time_axis(droid):
    obs = droid_observation(batch=2)
    for key in ("video.exterior_image_1_left", "video.exterior_image_2_left", "video.wrist_image_left"):
        obs[key] = obs[key][:, 0]  # [B, H, W, 3]
    b, _ = droid.preprocess(obs, ["a", "b"])
    assert b.images.shape == (2, 1, 352, 640, 3)
    assert b.prompts[0] != b.prompts[1]


def test_channel_first_and_float_inputs_match_uint8_channel_last(droid):
    obs = droid_observation(seed=5)
    ref, _ = droid.preprocess(obs, "x")
    alt = dict(obs)
    alt["video.wrist_image_left"] = np.moveaxis(obs["video.wrist_image_left"], -1, 0)  # [3, H, W]
    alt["video.exterior_image_1_left"] = obs["video.exterior_image_1_left"].astype(np.float64) / 255.0
    alt["video.exterior_image_2_left"] = obs["video.exterior_image_2_left"].astype(np.int64)  # JSON pixel lists
    got, _ = droid.preprocess(alt, "x")
    np.testing.assert_array_equal(got.images, ref.images)


def test_batched_state_with_time_axis_uses_the_last_row(droid):
    obs = droid_observation(batch=1)
    obs["state.joint_position"] = np.stack([np.zeros(7), JOINTS])[None]  # [1, 2, 7]
    _, ctx = droid.preprocess(obs, None)
    np.testing.assert_array_equal(ctx.state["state.joint_position"], JOINTS[None])


def test_openpi_keys_and_prompt(droid):
    obs = droid_observation()
    wire = {
        "observation/exterior_image_0_left": obs["video.exterior_image_1_left"],
        "observation/exterior_image_1_left": obs["video.exterior_image_2_left"],
        "observation/wrist_image_left": obs["video.wrist_image_left"],
        "observation/joint_position": obs["state.joint_position"],
        "observation/gripper_position": obs["state.gripper_position"],
        "observation/cartesian_position": np.zeros(6),
        "prompt": "Wave",
        "session_id": "s",
    }
    got, _ = droid.preprocess(wire)
    ref, _ = droid.preprocess(obs, "wave")
    np.testing.assert_array_equal(got.images, ref.images)
    assert got.prompts == ref.prompts


def test_rlinf_rollout_dict_maps_views_states_and_tasks(droid):
    rng = np.random.default_rng(7)
    main = rng.integers(0, 256, (2, 90, 160, 3), dtype=np.uint8)
    wrist = rng.integers(0, 256, (2, 90, 160, 3), dtype=np.uint8)
    extra = rng.integers(0, 256, (2, 1, 90, 160, 3), dtype=np.uint8)
    states = np.concatenate([np.tile(JOINTS, (2, 1)), [[0.0], [1.0]]], axis=1)  # [2, 8]
    rollout = {"main_images": main, "wrist_images": wrist, "extra_view_images": extra, "states": states,
               "task_descriptions": ["Open drawer", "Close drawer"]}  # fmt: skip
    got, ctx = droid.preprocess(rollout)
    own = {"video.exterior_image_1_left": main, "video.exterior_image_2_left": extra[:, 0],
           "video.wrist_image_left": wrist, "state.joint_position": states[:, :7],
           "state.gripper_position": states[:, 7:]}  # fmt: skip
    ref, _ = droid.preprocess(own, ["open drawer", "close drawer"])
    np.testing.assert_array_equal(got.images, ref.images)
    np.testing.assert_array_equal(got.state, ref.state)
    assert got.prompts == ref.prompts
    np.testing.assert_array_equal(ctx.state["state.gripper_position"], [[0.0], [1.0]])


def test_rollout_missing_view_is_black(droid):
    rng = np.random.default_rng(8)
    rollout = {"main_images": rng.integers(0, 256, (1, 90, 160, 3), dtype=np.uint8),
               "wrist_images": rng.integers(0, 256, (1, 90, 160, 3), dtype=np.uint8),
               "states": np.zeros((1, 8))}  # fmt: skip
    got, _ = droid.preprocess(rollout)
    assert not got.images[0, 0, 176:, 320:].any()  # bottom-right (exterior 2) zero-filled
    assert got.images[0, 0, 176:, :320].any()


@pytest.mark.parametrize(
    ("mutate", "field", "pattern"),
    [
        (lambda o: o.pop("video.wrist_image_left"), "video.wrist_image_left", "missing"),
        (lambda o: o.update({"video.top": np.zeros((4, 4, 3))}), "video.top", "unknown observation key"),
        (
            lambda o: o.update({"state.joint_position": np.zeros(6)}),
            "state.joint_position",
            r"expected shape \(7,\), received shape \(6,\)",
        ),
        (
            lambda o: o.update({"video.exterior_image_1_left": np.zeros((180, 320), np.uint8)}),
            "video.exterior_image_1_left",
            r"expected \(H, W, 3\) or \(T, H, W, 3\).*received shape \(180, 320\)",
        ),
        (
            lambda o: o.update({"video.exterior_image_2_left": np.zeros((180, 320, 4), np.uint8)}),
            "video.exterior_image_2_left",
            r"received shape \(180, 320, 4\)",
        ),
        (
            lambda o: o.update({"video.wrist_image_left": np.full((180, 320, 3), 256, np.int64)}),
            "video.wrist_image_left",
            r"0\.\.255",
        ),
        (
            lambda o: o.update({"video.wrist_image_left": np.zeros((180, 320, 3), bool)}),
            "video.wrist_image_left",
            "uint8 or float",
        ),
        (
            lambda o: o.update({"video.wrist_image_left": np.full((180, 320, 3), 200.0)}),
            "video.wrist_image_left",
            r"\[0, 1\]",
        ),
        (
            lambda o: o.update({"video.wrist_image_left": np.full((180, 320, 3), np.nan)}),
            "video.wrist_image_left",
            "NaN",
        ),
        (lambda o: o.update({"state.gripper_position": np.array([np.inf])}), "state.gripper_position", "NaN or inf"),
        (lambda o: o.update({"state.gripper_position": np.array(["a"])}), "state.gripper_position", "numeric"),
    ],
)
def test_bad_observations_name_the_field(droid, mutate, field, pattern):
    obs = droid_observation()
    mutate(obs)
    with pytest.raises(InvalidObservation, match=pattern) as info:
        droid.preprocess(obs, None)
    assert info.value.field == field
    assert field in str(info.value)


def test_batch_size_mismatch_names_the_key(droid):
    obs = droid_observation(batch=2)
    obs["video.wrist_image_left"] = obs["video.wrist_image_left"][:1]
    with pytest.raises(InvalidObservation, match="batch size 1 differs") as info:
        droid.preprocess(obs, None)
    assert info.value.field == "video.wrist_image_left"


def test_instruction_count_must_match_rows(droid):
    with pytest.raises(InvalidObservation, match="expected 2 strings"):
        droid.preprocess(droid_observation(batch=2), ["a", "b", "c"])


def test_libero_openpi_state_key(libero):
    obs = {"observation/image": np.zeros((64, 64, 3), np.uint8), "observation/wrist_image": np.zeros((64, 64, 3)),
           "observation/state": np.ones(8)}  # fmt: skip
    b, ctx = libero.preprocess(obs, "x")
    assert b.images.shape == (1, 1, 256, 512, 3)
    np.testing.assert_allclose(b.state[0, 0, :8], -0.5)  # 1 in [0, 4] -> -0.5


def test_one_row_state_next_to_single_images_is_unbatched(droid):
    obs = droid_observation()
    obs["state.joint_position"] = obs["state.joint_position"][None]  # [1, 7]
    obs["state.gripper_position"] = np.float64(0.25)  # a scalar gripper
    b, ctx = droid.preprocess(obs, None)
    ref, _ = droid.preprocess(droid_observation(), None)
    assert ctx.batched is False
    np.testing.assert_array_equal(b.state, ref.state)


def test_batched_scalar_per_row_for_one_dim_keys(droid):
    obs = droid_observation(batch=2)
    obs["state.gripper_position"] = np.array([0.0, 1.0])  # [B] for a 1-dim key
    _, ctx = droid.preprocess(obs, None, batched=True)
    np.testing.assert_array_equal(ctx.state["state.gripper_position"], [[0.0], [1.0]])
