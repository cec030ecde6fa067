"""Real Franka pick-and-place (`franka_pnp`, RLinf's real-world DreamZero embodiment): LIBERO's two-view layout.

Keys (RLinf's data transform): `video.image` = the fixed exterior camera, `video.wrist_image` = the second camera,
`state.state` = the real-world env's 19 numbers (gripper opening, TCP force, TCP pose relative to the reset pose as
xyz + Euler xyz, TCP torque, TCP twist), `action.actions` = 7 TCP-frame deltas normalised to [-1, 1] (1 = 0.03 m /
0.1 rad per 10 Hz step) + the gripper, where +1 OPENS and -1 closes (the opposite of LIBERO's sign). Widths come
from the checkpoint's metadata.json (the shipped synthetic statistics have 19 / 7). docs/franka.md has the sources.
"""

from __future__ import annotations

from typing import Any

from dreamzero.embodiments.libero_sim import LiberoSim
from dreamzero.embodiments.transforms import BinariseGripper


class FrankaPnp(LiberoSim):
    tag = "franka_pnp"
    action_horizon = 24  # RLinf's transform default; its franka_pnp SFT / eval configs use 12
    state_keys = ("state.state",)  # gripper_position 1, tcp_force 3, tcp_pose 6, tcp_torque 3, tcp_vel 6
    action_keys = ("action.actions",)  # TCP-frame delta 6 (normalised) + gripper
    known_widths = {}
    # RLinf's DreamZero policy binarises the last action dim: > 0 -> +1 (open) else -1 (close)
    gripper_rules = (BinariseGripper("action.actions", index=-1, threshold=0.0, low=-1.0, high=1.0),)
    openpi_action_space = "eef_delta"
    # the Franka pnp app spreads its 4 frames over the rows it executed (`dreamzero_franka.pnp.policy.frame_offsets`);
    # these are its spread over one whole chunk of `action_horizon` rows
    frame_offsets = (-18, -12, -6, 0)

    def openpi_server_config(self) -> dict[str, Any]:
        # "eef_delta" with one exterior view is also LIBERO's handshake: name the embodiment so a client can tell
        return {**super().openpi_server_config(), "embodiment": self.tag}
