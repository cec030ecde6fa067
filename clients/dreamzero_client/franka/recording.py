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

Writing needs the client's `record` extra (pyarrow, imageio-ffmpeg); nothing here imports it.
"""

from __future__ import annotations

from pathlib import Path

from dreamzero_client import droid
from dreamzero_client.franka.pnp.observation import WIRE_IMAGE, WIRE_WRIST

#: the DROID cameras (wire names) -> the oxe_droid preset's video features (DROID's datasets count from 1)
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
#: franka_pnp's two views (wire keys) -> the franka_pnp preset's video features
PNP_VIDEO = {WIRE_IMAGE: "observation.images.image", WIRE_WRIST: "observation.images.wrist_image"}
PNP_STATE, PNP_ACTION = "state", "actions"

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
    from dreamzero_client.recording import require_record_extra

    require_record_extra()


def open_dataset(root: str | Path, embodiment: str, control_hz: float):
    """A `DatasetRecorder` at `root` (appending to a dataset already there) for `embodiment`'s columns."""
    from dreamzero_client.recording import DatasetRecorder

    return DatasetRecorder(root, fps=control_hz, robot_type=f"franka ({embodiment})", modality=MODALITY[embodiment])


def episode_marks(status: str, reason: str | None, label: str | None) -> dict:
    """`end_episode`'s arguments for an episode result: success from the operator's label (None: not asked or
    skipped, unknown); outcome from it for an episode that ran to its end or was labelled, else "failed" for a fault
    (server lost, device error, too many refused chunks) or "aborted" for a stop (operator, Ctrl+C), the reason as
    the note."""
    success = {"success": True, "failure": False}.get(label)
    if status == "completed":
        return {"success": success, "outcome": None, "note": None}
    return {"success": success, "outcome": "failed" if status == "failed" else "aborted", "note": reason}
