"""Franka client pieces for RLinf's `franka_pnp` DreamZero policies (Cartesian delta actions, two cameras).

Self-contained: task poses (`task_poses`), the action-space converter (`actions`), the observation builder
(`observation`), the Cartesian robot contract and its simulation (`cartesian`), the safety filter (`safety`) and
the reset move (`reset_move`).
See docs/franka.md (section 8) for the action/observation definitions; `loop.PnpEpisodeRunner` runs them.
"""

from dreamzero_franka.pnp.actions import PnpActionSpace, PoseTarget, action_to_target, preview_chunk
from dreamzero_franka.pnp.cartesian import CartesianRobot, SimCartesianRobot, TcpState, franky_external_wrench
from dreamzero_franka.pnp.observation import PnpObservationBuilder, PnpObservationConfig
from dreamzero_franka.pnp.reset_move import go_to_pose
from dreamzero_franka.pnp.safety import (
    PnpChunkRejected,
    PnpCommand,
    PnpSafetyConfig,
    PnpSafetyFilter,
    command_violations,
)
from dreamzero_franka.pnp.task_poses import TaskPoses, add_task_pose_args, task_poses_from_args

__all__ = [
    "CartesianRobot",
    "PnpActionSpace",
    "PnpChunkRejected",
    "PnpCommand",
    "PnpObservationBuilder",
    "PnpObservationConfig",
    "PnpSafetyConfig",
    "PnpSafetyFilter",
    "PoseTarget",
    "SimCartesianRobot",
    "TaskPoses",
    "TcpState",
    "action_to_target",
    "add_task_pose_args",
    "command_violations",
    "franky_external_wrench",
    "go_to_pose",
    "preview_chunk",
    "task_poses_from_args",
]
