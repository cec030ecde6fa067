"""franka_pnp observation: two 128x128 views (centre square + resize) and RLinf's 19-number state."""

from __future__ import annotations

import numpy as np
import pytest

from dreamzero_client.errors import ConfigError, InvalidObservation
from dreamzero_franka.pnp.cartesian import TcpState
from dreamzero_franka.pnp.observation import (
    STATE_LAYOUT,
    WIRE_IMAGE,
    WIRE_STATE,
    WIRE_WRIST,
    PnpObservationBuilder,
    PnpObservationConfig,
    centre_square,
    resize_bilinear,
)
from dreamzero_franka.pnp.rotations import pose_from_xyz_euler, rlinf_adjoint

RESET = pose_from_xyz_euler([0.45, 0.0, 0.30, np.pi, 0.0, 0.0])


def tcp(pose=RESET, twist=None, wrench=None) -> TcpState:
    return TcpState(
        pose=pose,
        twist=np.zeros(6) if twist is None else np.asarray(twist, float),
        wrench=np.zeros(6) if wrench is None else np.asarray(wrench, float),
        joint_positions=np.zeros(7),
    )


def builder() -> PnpObservationBuilder:
    b = PnpObservationBuilder()
    b.start_episode(RESET)
    return b


def test_state_at_the_reset_pose_is_zero_pose_and_open_gripper():
    state = builder().state(tcp(), gripper_closure=0.0)
    assert state.shape == (19,) and state.dtype == np.float32
    np.testing.assert_allclose(state[STATE_LAYOUT["tcp_pose"]], 0.0, atol=1e-7)
    assert state[STATE_LAYOUT["gripper_position"]][0] == pytest.approx(0.08)


def test_state_pose_is_relative_to_the_reset_frame():
    moved = RESET.copy()
    moved[:3, 3] += [0.01, 0.02, 0.03]  # base frame; the reset TCP frame has y and z flipped
    state = builder().state(tcp(moved), gripper_closure=1.0)
    np.testing.assert_allclose(state[STATE_LAYOUT["tcp_pose"]], [0.01, -0.02, -0.03, 0, 0, 0], atol=1e-6)
    assert state[STATE_LAYOUT["gripper_position"]][0] == pytest.approx(0.0)


def test_force_torque_and_velocity_slots():
    twist = np.array([0.1, -0.2, 0.05, 0.3, 0.0, -0.1])
    state = builder().state(tcp(twist=twist, wrench=[1, 2, 3, 4, 5, 6]), gripper_closure=0.5)
    np.testing.assert_allclose(state[STATE_LAYOUT["tcp_force"]], [1, 2, 3])
    np.testing.assert_allclose(state[STATE_LAYOUT["tcp_torque"]], [4, 5, 6])
    # RLinf maps the base-frame twist into the TCP frame with the inverse of its 6x6 matrix
    np.testing.assert_allclose(rlinf_adjoint(RESET) @ state[STATE_LAYOUT["tcp_vel"]], twist, atol=1e-6)
    assert state[STATE_LAYOUT["gripper_position"]][0] == pytest.approx(0.04)


def test_layout_covers_nineteen_numbers_in_sorted_key_order():
    keys = list(STATE_LAYOUT)
    assert keys == sorted(keys)
    covered = np.concatenate([np.arange(19)[s] for s in STATE_LAYOUT.values()])
    np.testing.assert_array_equal(covered, np.arange(19))


def test_centre_square_of_a_realsense_frame_is_columns_80_to_560():
    frame = np.zeros((480, 640, 3), np.uint8)
    frame[:, :80] = 255
    frame[:, 560:] = 255
    crop = centre_square(frame)
    assert crop.shape == (480, 480, 3) and crop.max() == 0


def test_resize_keeps_a_flat_image_flat_and_matches_sizes():
    flat = np.full((480, 480, 3), 77, np.uint8)
    np.testing.assert_array_equal(resize_bilinear(flat, 128, 128), np.full((128, 128, 3), 77, np.uint8))
    ramp = np.tile(np.linspace(0, 255, 480).astype(np.uint8)[None, :, None], (480, 1, 3))
    small = resize_bilinear(ramp, 128, 128)
    assert np.all(np.diff(small[0, :, 0].astype(int)) >= 0)  # still a left-to-right ramp


def test_build_gives_the_wire_keys():
    b = builder()
    ext = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)
    obs = b.build(ext, ext[:, ::-1].copy(), tcp(), 0.0, "put the cube in the bowl")
    assert obs[WIRE_IMAGE].shape == (128, 128, 3) and obs[WIRE_WRIST].shape == (128, 128, 3)
    assert obs[WIRE_STATE].shape == (19,)
    assert obs["prompt"] == "put the cube in the bowl"


def test_errors_name_the_field():
    with pytest.raises(InvalidObservation, match="start_episode"):
        PnpObservationBuilder().state(tcp(), 0.0)
    b = builder()
    with pytest.raises(InvalidObservation, match="exterior must be a uint8"):
        b.build(np.zeros((480, 640, 3), np.float32), np.zeros((480, 640, 3), np.uint8), tcp(), 0.0, "x")
    with pytest.raises(InvalidObservation, match="tcp.twist"):
        b.state(tcp(twist=[np.nan, 0, 0, 0, 0, 0]), 0.0)
    with pytest.raises(InvalidObservation, match="gripper closure"):
        b.state(tcp(), 1.5)
    with pytest.raises(InvalidObservation, match="prompt"):
        b.build(np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4, 3), np.uint8), tcp(), 0.0, " ")
    with pytest.raises(ConfigError, match="image_hw"):
        PnpObservationConfig(image_hw=(8, 8))
