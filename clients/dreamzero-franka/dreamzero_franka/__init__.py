"""The Franka deployment app (`dreamzero-franka`): what both embodiments share in `common` (device contracts and
backends, the arm's limits, the command gate and watchdog, the episode loop's tick, the operator, the step log), DROID
joint control in `droid` (oxe_droid: joint positions, 15 Hz) and `pnp` (franka_pnp: Cartesian deltas, 10 Hz); the
policy for a server (`connect`), recording (`recording`), the franky backend and the CLI on top.

Hardware libraries (franky-control, pyrealsense2) are imported only when a device connects; importing this package
needs numpy, msgpack and websockets/httpx only. See docs/franka.md.
"""

from dreamzero_franka.common.contracts import ArmState, Camera, DeviceError, Gripper, Robot, RobotFault
from dreamzero_franka.common.guards import Watchdog
from dreamzero_franka.common.loop import EpisodeResult, EpisodeRunner, LoopConfig
from dreamzero_franka.connect import (
    Chunk,
    ChunkRejected,
    DroidPolicy,
    PnpPolicy,
    PolicyCallError,
    advertised_embodiment,
    connect_policy,
)
from dreamzero_franka.droid.loop import DroidEpisodeRunner
from dreamzero_franka.droid.safety import SafetyConfig, SafetyFilter

__all__ = [
    "ArmState",
    "Camera",
    "Chunk",
    "ChunkRejected",
    "DeviceError",
    "DroidEpisodeRunner",
    "DroidPolicy",
    "EpisodeResult",
    "EpisodeRunner",
    "Gripper",
    "LoopConfig",
    "PnpPolicy",
    "PolicyCallError",
    "Robot",
    "RobotFault",
    "SafetyConfig",
    "SafetyFilter",
    "Watchdog",
    "advertised_embodiment",
    "connect_policy",
]
