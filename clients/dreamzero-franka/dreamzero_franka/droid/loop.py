"""DROID joint control at 15 Hz: the hooks of the shared tick (`common.loop.EpisodeRunner`) for the oxe_droid
embodiment. The three DROID cameras, the joints and the gripper are observed; every row is a joint target through the
joint safety filter (`droid/safety.py`), the gripper follows DROID's rule; the step log and the dataset get the views
and the state as the policy keeps this tick's frame (`dreamzero_droid.droid`).
"""

from __future__ import annotations

import numpy as np

from dreamzero_droid import droid
from dreamzero_droid.policy import DroidPolicy
from dreamzero_franka.common.contracts import Camera, Gripper, Robot
from dreamzero_franka.common.guards import CommandGate, Watchdog
from dreamzero_franka.common.loop import EpisodeRunner, LoopConfig
from dreamzero_franka.common.operator import Operator
from dreamzero_franka.droid.safety import SafetyFilter

#: the dataset's columns (recording.py): the DROID cameras -> the oxe_droid preset's video features (from 1)
DROID_VIDEO = dict(
    zip(
        droid.CAMERAS,
        (
            "observation.images.exterior_image_1_left",
            "observation.images.exterior_image_2_left",
            "observation.images.wrist_image_left",
        ),
    )
)


class DroidEpisodeRunner(EpisodeRunner):
    """Runs oxe_droid episodes. `cameras` maps the DROID camera names (`droid.CAMERAS`) to cameras."""

    policy: DroidPolicy
    safety: SafetyFilter

    def __init__(
        self,
        robot: Robot,
        gripper: Gripper,
        cameras: dict[str, Camera],
        policy: DroidPolicy,
        safety: SafetyFilter | None = None,
        config: LoopConfig | None = None,
        operator: Operator | None = None,
        dataset=None,
    ):
        super().__init__(robot, gripper, cameras, policy, safety or SafetyFilter(), config, operator, dataset=dataset)

    # the hooks of `EpisodeRunner`'s tick ----------------------------------------------------------------------------
    def go_home(self, gate: CommandGate) -> None:
        """Before the first tick: move to the start pose, open the gripper, start the safety filter afresh."""
        self.robot.move_to(np.asarray(self.config.home, dtype=np.float64), timeout_s=self.config.home_timeout_s)
        self.gripper.open(timeout_s=self.config.gripper_timeout_s)
        self.safety.reset()
        gate.was_held()

    def read_devices(self, record: dict) -> tuple[dict, tuple]:
        """Observe the devices: (the policy's observation of this tick, the reading `execute_row` and `log_entry` get
        back); may add fields to the tick's `record`. DROID: the cameras by DROID name, joints and gripper."""
        arm = self.robot.observe()
        gripper_pos = self.gripper.observe()
        obs = {name: cam.observe() for name, cam in self.cameras.items()}
        obs.update(joint_position=arm.joint_positions, gripper_position=[gripper_pos])
        return obs, (arm, gripper_pos)

    def execute_row(
        self, action: np.ndarray, row: int, reading: tuple, gate: CommandGate, watchdog: Watchdog, record: dict
    ) -> tuple[str, ...]:
        """Pass one row through the safety filter, command the arm (through `gate`; feed `watchdog` when a command
        went out) and the gripper (`send_gripper`), note it in `record`; returns the names of the limits that
        changed the command. DROID: a joint target, the gripper by DROID's rule."""
        arm, _ = reading
        cmd = self.safety.filter(action[:7], arm.joint_positions)
        gate.send(cmd.joint_targets)
        watchdog.feed()
        closed = droid.binarize_gripper(action[7], self.safety.config.gripper_threshold) == 1.0
        self.send_gripper(closed)
        record.update(chunk_row=row, action=action, command=cmd.joint_targets, clamped=list(cmd.clamped))
        record["gripper_command"] = closed
        return cmd.clamped

    def log_entry(self, obs: dict, reading: tuple) -> tuple[dict, list[np.ndarray]]:
        """(the measured fields of the step log, the views of the episode video). DROID: joints and gripper; the
        three views as the policy keeps this tick's frame."""
        arm, gripper_pos = reading
        newest = self.policy.history.select(first_call=True)[0]  # this tick's frame, as the policy sees it
        views = [newest.images[name] for name in droid.CAMERAS]
        return {"joint_position": arm.joint_positions, "gripper_position": gripper_pos}, views

    def dataset_frame(self, obs: dict, reading: tuple, record: dict) -> tuple[dict, dict]:
        """(images, vectors) of the tick for `dataset` (columns: franka/recording.py). DROID: the views and state as
        the policy keeps this tick's frame, the joint targets sent (a hold: the measured joints) and the gripper
        command (1 closed, 0 open)."""
        arm, _ = reading
        newest = self.policy.history.select(first_call=True)[0]
        images = {DROID_VIDEO[name]: newest.images[name] for name in droid.CAMERAS}
        state = np.concatenate([newest.joint_position, newest.gripper_position])
        action = np.append(record.get("command", arm.joint_positions), 1.0 if self._gripper_closed else 0.0)
        return images, {"observation.state": state, "action": action}
