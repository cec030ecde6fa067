"""DROID (`oxe_droid`, the 14B checkpoint): three 180x320 cameras, 7 joints + gripper, relative joint actions."""

from __future__ import annotations

import numpy as np

from dreamzero.embodiments.base import Embodiment
from dreamzero.embodiments.canvas import Slot
from dreamzero.embodiments.transforms import AddCurrentState, BinariseGripper, PromptTemplate, stitch_droid
from dreamzero_client.wire.openpi import OPENPI_CARTESIAN_KEY, OPENPI_DROID_KEY_MAP

EXTERIOR_1 = "video.exterior_image_1_left"
EXTERIOR_2 = "video.exterior_image_2_left"
WRIST = "video.wrist_image_left"


class OxeDroid(Embodiment):
    tag = "oxe_droid"
    action_horizon = 24
    video_keys = (EXTERIOR_1, EXTERIOR_2, WRIST)
    wrist_key = WRIST
    state_keys = ("state.joint_position", "state.gripper_position")
    action_keys = ("action.joint_position", "action.gripper_position")
    known_widths = {
        "state.joint_position": 7, "state.gripper_position": 1,
        "action.joint_position": 7, "action.gripper_position": 1,
    }  # fmt: skip
    view_hw = (176, 320)
    canvas_hw = (352, 640)
    canvas_slots = {WRIST: Slot(0, 0, width_repeat=2), EXTERIOR_1: Slot(176, 0), EXTERIOR_2: Slot(176, 320)}
    wire_image_hw = (180, 320)
    # a 4-frame block spread over the 24-step chunk just executed; the DROID client runtime sends the same
    # (`dreamzero_droid.droid.FRAME_OFFSETS`, a robot-side copy: the client cannot import the server)
    frame_offsets = (-23, -16, -8, 0)
    language_key = "annotation.language.language_instruction"  # the GR00T / RLDX-1 DROID name
    prompt_template = PromptTemplate(
        prefix="A multi-view video shows that a robot ",
        middle=(
            " The video is split into three views: The top view shows the camera view from the robot's wrist, the "
            "bottom-left view shows the camera view from the left exterior camera, and the bottom-right view shows "
            "the camera view from the right exterior camera. During training, one of the two bottom exterior views "
            "may be a black screen (dropped view). The robot "
        ),
    )
    # the model predicts joint deltas from the current joints; the gripper is absolute in [0, 1] (1 closed)
    relative_actions = (AddCurrentState("action.joint_position", "state.joint_position"),)
    gripper_rules = (BinariseGripper("action.gripper_position", index=0, threshold=0.5, low=0.0, high=1.0),)
    # OpenPI/RoboArena wire names: exterior 0 is the bottom-left view, exterior 1 the bottom-right
    openpi_key_map = OPENPI_DROID_KEY_MAP
    openpi_ignored_keys = (OPENPI_CARTESIAN_KEY,)
    openpi_action_space = "joint_position"

    def stitch(self, views: dict[str, np.ndarray]) -> np.ndarray:
        return stitch_droid(views[WRIST], views[EXTERIOR_1], views[EXTERIOR_2])
