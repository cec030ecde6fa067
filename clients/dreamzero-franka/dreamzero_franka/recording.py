"""`dreamzero-franka --record-dataset DIR`: every episode the loop runs, appended to a LeRobot v3.0 dataset under the
column names of the server's embodiment, so `dreamzero-make-metadata generate DIR --preset <tag>` and
`dreamzero-train --embodiment <tag>` read it as it is.

Per control tick (the loop's `dataset_frame` hook, then `DatasetRecorder.add_frame`, which only queues):
  oxe_droid   observation.images.{exterior_image_1_left, exterior_image_2_left, wrist_image_left}: the 180x320 views
              as the policy keeps them; observation.state: 7 measured joints + gripper closure; action: the 7 joint
              targets the safety filter sent + the gripper command (1 closed, 0 open); meta/modality.json slices them
  franka_pnp  observation.images.image / observation.images.wrist_image: the 128x128 views sent to the server;
              state: the 19 numbers sent; actions: the row the arm executed after the safety filter
              (`pnp.actions.executed_action`), gripper +1 open / -1 closed
A tick whose chunk was refused (the arm held) is kept as a hold: DROID's action is the measured joints, franka_pnp's
no motion. The instruction is the episode's task; the marks (`episode_marks`) come from its result.

Writing is `dreamzero_droid.lerobot`'s and needs its `record` extra (pyarrow, imageio-ffmpeg); nothing here imports it.
"""

from __future__ import annotations

from pathlib import Path

from dreamzero_franka.droid.loop import DROID_VIDEO
from dreamzero_franka.pnp.loop import PNP_ACTION, PNP_STATE, PNP_VIDEO

MODALITY = {
    "oxe_droid": {
        "state": {"joint_position": {"start": 0, "end": 7}, "gripper_position": {"start": 7, "end": 8}},
        "action": {"joint_position": {"start": 0, "end": 7}, "gripper_position": {"start": 7, "end": 8}},
        "video": {key.rsplit(".", 1)[-1]: {"original_key": key} for key in DROID_VIDEO.values()},
    },
    "franka_pnp": {
        "state": {"state": {"start": 0, "end": 19, "original_key": PNP_STATE}},
        "action": {"actions": {"start": 0, "end": 7, "original_key": PNP_ACTION}},
        "video": {key.rsplit(".", 1)[-1]: {"original_key": key} for key in PNP_VIDEO.values()},
    },
}


def require_extra() -> None:
    """Raise `ConfigError` naming the `record` extra when it is not installed (checked before anything connects)."""
    from dreamzero_droid.lerobot import require_record_extra

    require_record_extra()


def open_dataset(root: str | Path, embodiment: str, control_hz: float):
    """A `DatasetRecorder` at `root` (appending to a dataset already there) for `embodiment`'s columns."""
    from dreamzero_droid.lerobot import DatasetRecorder

    return DatasetRecorder(root, fps=control_hz, robot_type=f"franka ({embodiment})", modality=MODALITY[embodiment])
