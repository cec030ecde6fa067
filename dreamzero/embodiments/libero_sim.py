"""LIBERO simulation (`libero_sim`, the 5B checkpoint): two 256x256 views side by side, eef state, delta eef actions."""

from __future__ import annotations

import numpy as np

from dreamzero.embodiments.base import Embodiment
from dreamzero.embodiments.canvas import Slot
from dreamzero.embodiments.transforms import BinariseGripper, PromptTemplate, stitch_side_by_side

TWO_VIEW_TEMPLATE = PromptTemplate(
    prefix="A multi-view video shows that a robot ",
    middle=(
        " The video is split into two horizontal views: the left view shows the exterior camera and the right view "
        "shows the wrist camera. The robot "
    ),
)


class LiberoSim(Embodiment):
    tag = "libero_sim"
    action_horizon = 16
    video_keys = ("video.image", "video.wrist_image")
    wrist_key = "video.wrist_image"
    state_keys = ("state.state",)  # eef position 3, axis-angle 3, gripper fingers 2
    action_keys = ("action.actions",)  # delta eef 6 + gripper
    known_widths = {"state.state": 8, "action.actions": 7}
    view_hw = (256, 256)
    canvas_hw = (256, 512)
    canvas_slots = {"video.image": Slot(0, 0), "video.wrist_image": Slot(0, 256)}
    wire_image_hw = (256, 256)
    # the first frame at the start of the 16-step chunk just executed, evenly spaced to the current one
    frame_offsets = (-15, -10, -5, 0)
    language_key = "annotation.human.action.task_description"  # GR00T's LIBERO datasets
    prompt_template = TWO_VIEW_TEMPLATE
    # LIBERO's gripper command is -1 (open) / +1 (close)
    gripper_rules = (BinariseGripper("action.actions", index=6, threshold=0.0, low=-1.0, high=1.0),)
    openpi_key_map = {
        "observation/image": "video.image",
        "observation/wrist_image": "video.wrist_image",
        "observation/state": "state.state",
    }
    openpi_action_space = "eef_delta"

    def stitch(self, views: dict[str, np.ndarray]) -> np.ndarray:
        return stitch_side_by_side([views["video.image"], views["video.wrist_image"]])
