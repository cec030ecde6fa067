"""Real Franka pick-and-place (`franka_pnp`): LIBERO's layout and gripper rule with a 24-step horizon.

The state/action widths are whatever the dataset's metadata.json says (not fixed here).
"""

from __future__ import annotations

from dreamzero.embodiments.libero_sim import LiberoSim
from dreamzero.embodiments.transforms import BinariseGripper


class FrankaPnp(LiberoSim):
    tag = "franka_pnp"
    action_horizon = 24
    known_widths = {}
    # the gripper is the last action dim, binarised like LIBERO (> 0 -> +1 else -1)
    gripper_rules = (BinariseGripper("action.actions", index=-1, threshold=0.0, low=-1.0, high=1.0),)
    openpi_action_space = "eef_delta"
