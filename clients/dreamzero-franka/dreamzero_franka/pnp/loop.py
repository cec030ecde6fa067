"""The franka_pnp episode loop: the shared tick (`common.loop.EpisodeRunner`: sessions, operator keys, prefetch,
watchdog, holds, logs) with franka_pnp's observation, action space and safety filter filled into its hooks.

Per episode (`EpisodeRunner.run_episode` does the session reset, the operator label and the logs):
1. start (`go_home`): a fresh session id; optionally the joint home (`TaskPoses.home_joints`), the gripper opens, the
   slow Cartesian move to the reset pose through the safety filter, then the reset TCP pose becomes the reference of
   the state's relative pose (RLinf measures it after its reset move);
2. every tick (1 / control_hz, 10 Hz): operator keys, observe TCP + gripper + both cameras, build the 19-number
   observation (`read_devices`); query when the executed part of the chunk is used up (or take the prefetched
   chunk); every chunk passes `PnpSafetyFilter.check_chunk` (`accept_chunk`; a rejected one is not executed: the arm
   holds); each row goes through `PnpSafetyFilter.step` from the measured pose and the result is sent as a TCP pose
   (or the arm holds); the gripper follows RLinf's +-0.5 rule (`execute_row`);
3. on server loss the arm holds and the episode fails with the reason; after any hold or pause the filter restarts
   from the measured pose.
"""

from __future__ import annotations

import numpy as np

from dreamzero_droid.policy import Chunk, ChunkRejected
from dreamzero_franka.common.contracts import Camera, Gripper
from dreamzero_franka.common.guards import CommandGate, Watchdog
from dreamzero_franka.common.loop import EpisodeRunner, LoopConfig
from dreamzero_franka.common.operator import Operator
from dreamzero_franka.pnp.actions import executed_action
from dreamzero_franka.pnp.cartesian import CartesianRobot, TcpState
from dreamzero_franka.pnp.observation import WIRE_IMAGE, WIRE_STATE, WIRE_WRIST, PnpObservationBuilder
from dreamzero_franka.pnp.policy import PnpPolicy, frame_offsets
from dreamzero_franka.pnp.reset_move import go_to_pose
from dreamzero_franka.pnp.safety import PnpChunkRejected, PnpSafetyFilter

#: camera names of a franka_pnp rig, in RLinf's order (first serial = main image = the fixed exterior view)
PNP_CAMERAS = ("exterior", "wrist")
#: the dataset's columns (recording.py): franka_pnp's two views (wire keys) -> the franka_pnp preset's video features
PNP_VIDEO = {WIRE_IMAGE: "observation.images.image", WIRE_WRIST: "observation.images.wrist_image"}
PNP_STATE, PNP_ACTION = "state", "actions"


def pnp_loop_config(**overrides) -> LoopConfig:
    """RLinf's franka_pnp timing: 10 Hz, whole 12-row chunks (its eval config), 240 steps per episode."""
    return LoopConfig(**{"control_hz": 10.0, "open_loop_horizon": 12, "max_steps": 240, **overrides})


class PnpEpisodeRunner(EpisodeRunner):
    """Runs franka_pnp episodes. `cameras` maps PNP_CAMERAS to cameras; `robot` is a `CartesianRobot`."""

    robot: CartesianRobot
    safety: PnpSafetyFilter
    policy: PnpPolicy
    #: the policy's check of the reply, then the safety filter's chunk check (`accept_chunk`)
    rejections = (ChunkRejected, PnpChunkRejected)
    gripper_after_home = False  # `go_home` opened it

    def __init__(
        self,
        robot: CartesianRobot,
        gripper: Gripper,
        cameras: dict[str, Camera],
        policy: PnpPolicy,
        safety: PnpSafetyFilter,
        config: LoopConfig | None = None,
        operator: Operator | None = None,
        builder: PnpObservationBuilder | None = None,
        joint_reset: bool = True,
        dataset=None,
    ):
        missing = [name for name in PNP_CAMERAS if name not in cameras]
        if missing:
            raise ValueError(f"cameras: franka_pnp needs {list(PNP_CAMERAS)}, missing {missing}")
        config = config or pnp_loop_config()
        if abs(config.control_hz - safety.space.control_hz) > 1e-9:
            raise ValueError(
                f"loop.control_hz ({config.control_hz}) must be the action space's rate ({safety.space.control_hz} Hz):"
                " each row is one step of that length"
            )
        super().__init__(robot, gripper, cameras, policy, safety, config, operator, dataset=dataset)
        # `PnpPolicy` has no real-time chunking: franka_pnp executes whole chunks (with or without prefetch), and a
        # `loop.rtc` is left unused
        self.rtc = None
        policy.set_frame_offsets(frame_offsets(config.open_loop_horizon))
        self.builder = builder or PnpObservationBuilder()
        self.joint_reset = joint_reset

    # the hooks of `EpisodeRunner`'s tick ----------------------------------------------------------------------------
    def go_home(self, gate: CommandGate) -> None:
        cfg, poses = self.config, self.safety.poses
        if self.joint_reset:
            self.robot.move_to(np.asarray(poses.home_joints, dtype=np.float64), timeout_s=cfg.home_timeout_s)
        self.gripper.open(timeout_s=cfg.gripper_timeout_s)
        go_to_pose(self.robot, self.safety, poses.reset_pose, timeout_s=cfg.home_timeout_s)
        self.builder.start_episode(self.robot.observe_tcp().pose)
        self.safety.reset()
        gate.was_held()

    def read_devices(self, record: dict) -> tuple[dict, tuple[TcpState, float]]:
        tcp = self.robot.observe_tcp()
        closure = self.gripper.observe()
        frames = {name: self.cameras[name].observe() for name in PNP_CAMERAS}
        obs = self.builder.build(frames["exterior"], frames["wrist"], tcp, closure, self.policy.prompt)
        record["state"] = obs[WIRE_STATE]
        return obs, (tcp, closure)

    def accept_chunk(self, chunk: Chunk) -> np.ndarray:
        # from the freshly measured pose; the jump check follows only the rows that will run
        return self.safety.check_chunk(chunk.actions, self.robot.observe_tcp(), self.config.min_chunk_rows)

    @staticmethod
    def describe_rejection(exc: Exception) -> str:
        return f"{exc.field}: {exc}"  # both kinds of refusal carry the field they name

    def execute_row(
        self, action: np.ndarray, row: int, reading: tuple, gate: CommandGate, watchdog: Watchdog, record: dict
    ) -> tuple[str, ...]:
        tcp, _ = reading
        cmd = self.safety.step(action, tcp)
        if cmd.hold:
            gate.hold()
            record["held"] = True
        else:
            gate.send_pose(cmd.pose, cmd.joints)
            watchdog.feed()
        gripper_closed = self.send_gripper(cmd.gripper_closed)
        record.update(chunk_row=row, action=action, clamped=list(cmd.clamped), gripper_command=gripper_closed)
        if cmd.pose is not None:
            record.update(command_pose=cmd.pose, command_joints=cmd.joints)
        record["tcp"] = tcp.pose
        return cmd.clamped

    def log_entry(self, obs: dict, reading: tuple) -> tuple[dict, list[np.ndarray]]:
        _, closure = reading
        return {"gripper_position": closure}, [obs[WIRE_IMAGE], obs[WIRE_WRIST]]  # the views the server receives

    def dataset_frame(self, obs: dict, reading: tuple, record: dict) -> tuple[dict, dict]:
        """The two views and the state sent, and the row the arm executed (`executed_action`: from the command pose
        and the measured one; a hold or a refused chunk: no motion)."""
        tcp, _ = reading
        action = executed_action(record.get("command_pose"), tcp.pose, self._gripper_closed, self.safety.space)
        images = {feature: obs[key] for key, feature in PNP_VIDEO.items()}
        return images, {PNP_STATE: obs[WIRE_STATE], PNP_ACTION: action}
