"""Franka deployment client: contracts, backends (franky, RealSense, simulated), safety layer, episode loop, CLI,
for the oxe_droid embodiment (joint positions, 15 Hz) and franka_pnp (`franka.pnp`: Cartesian deltas, 10 Hz).

Hardware libraries (franky-control, pyrealsense2) are imported only when a device connects; importing this package
needs numpy, msgpack and websockets/httpx only. See docs/franka.md.
"""

from dreamzero_client.franka.contracts import ArmState, Camera, DeviceError, Gripper, Robot, RobotFault
from dreamzero_client.franka.loop import EpisodeResult, EpisodeRunner, LoopConfig
from dreamzero_client.franka.policy import (
    Chunk,
    ChunkRejected,
    DroidPolicy,
    PnpPolicy,
    PolicyCallError,
    advertised_embodiment,
    connect_policy,
)
from dreamzero_client.franka.safety import SafetyConfig, SafetyFilter, Watchdog

__all__ = [
    "ArmState",
    "Camera",
    "Chunk",
    "ChunkRejected",
    "DeviceError",
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
