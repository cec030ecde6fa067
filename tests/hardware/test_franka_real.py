"""The Franka backends against real hardware: run only where `DREAMZERO_FRANKA_HOST` names the arm's FCI address
(and `DREAMZERO_REALSENSE_SERIAL` a camera); everywhere else they are skipped with that reason. They read state and
hold still: nothing here moves the arm. The same backends run against franky-sim in tests/e2e and tests/unit."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.hardware


def test_arm_and_gripper_report_their_state_without_moving():
    from dreamzero_franka.franky_backend import FrankyConfig, FrankyGripper, FrankyRobot

    config = FrankyConfig(host=os.environ["DREAMZERO_FRANKA_HOST"])
    with FrankyRobot(config) as robot, FrankyGripper(config) as gripper:
        before = robot.observe()
        robot.hold()
        after = robot.observe()
        assert before.joint_positions.shape == (7,) and np.isfinite(after.joint_positions).all()
        assert np.abs(after.joint_positions - before.joint_positions).max() < 1e-2  # held still
        assert 0.0 <= gripper.observe() <= 1.0


@pytest.mark.skipif(not os.environ.get("DREAMZERO_REALSENSE_SERIAL"), reason="DREAMZERO_REALSENSE_SERIAL is not set")
def test_realsense_camera_delivers_colour_frames():
    from dreamzero_franka.common.realsense import RealSenseCamera

    with RealSenseCamera("exterior_image_1_left", os.environ["DREAMZERO_REALSENSE_SERIAL"]) as camera:
        frame = camera.observe()
    assert frame.dtype == np.uint8 and frame.shape == (480, 640, 3)
