"""Franka deployment client: contracts, backends (franky, RealSense, simulated), safety layer, 15 Hz loop, CLI.

Hardware libraries (franky-control, pyrealsense2) are imported only when a device connects; importing this package
needs numpy, msgpack and websockets/httpx only. See docs/franka.md.
"""

from dreamzero_client.franka.contracts import ArmState, Camera, DeviceError, Gripper, Robot, RobotFault
from dreamzero_client.franka.loop import EpisodeResult, EpisodeRunner, LoopConfig
from dreamzero_client.franka.policy import Chunk, ChunkRejected, DroidPolicy, PolicyCallError, connect_policy
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
    "PolicyCallError",
    "Robot",
    "RobotFault",
    "SafetyConfig",
    "SafetyFilter",
    "Watchdog",
    "connect_policy",
]
