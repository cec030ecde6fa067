"""Per-episode outputs: an mp4 of the three views side by side (15 fps) and a JSON record with one entry per step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dreamzero_droid.image_tools import resize_with_pad
from eval.env_contract import IMAGE_KEYS


def configure_ffmpeg() -> None:
    """Point mediapy at the ffmpeg binary bundled with imageio-ffmpeg (no system ffmpeg needed)."""
    import imageio_ffmpeg
    import mediapy

    mediapy.set_ffmpeg(imageio_ffmpeg.get_ffmpeg_exe())


def to_jsonable(value: Any) -> Any:
    """numpy arrays / scalars -> lists / floats, recursively (json.dumps cannot take them)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value


class EpisodeRecorder:
    """Streams video frames to `<out_dir>/videos/<name>.mp4` and collects step records for `<out_dir>/episodes/`."""

    def __init__(
        self,
        out_dir: Path,
        name: str,
        fps: float = 15.0,
        record_video: bool = True,
        frame_size: tuple[int, int] = (180, 320),
    ):
        self.out_dir = Path(out_dir)
        self.name = name
        self.steps: list[dict] = []
        self.frame_size = frame_size
        self.video_path: Path | None = None
        self._writer = None
        if record_video:
            import mediapy

            configure_ffmpeg()
            self.video_path = self.out_dir / "videos" / f"{name}.mp4"
            self.video_path.parent.mkdir(parents=True, exist_ok=True)
            h, w = frame_size
            self._writer = mediapy.VideoWriter(self.video_path, shape=(h, w * len(IMAGE_KEYS)), fps=fps)
            self._writer.__enter__()
        self.frames_written = 0

    def add_frame(self, observation: dict) -> None:
        if self._writer is None:
            return
        # the views as the policy sees them (resize_with_pad), left to right
        frame = np.concatenate([resize_with_pad(observation[k], *self.frame_size) for k in IMAGE_KEYS], axis=1)
        self._writer.add_image(frame)
        self.frames_written += 1

    def add_step(self, record: dict) -> None:
        self.steps.append(to_jsonable(record))

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.__exit__(None, None, None)

    def write_json(self, episode: dict) -> Path:
        path = self.out_dir / "episodes" / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_jsonable({**episode, "steps": self.steps}), indent=1))
        return path


def open_dataset(root: Path, fps: float):
    """A DatasetRecorder writing the DROID scene's episodes with the column names of our MuJoCo demos (`oxe_droid`:
    observation.state = 7 joints + gripper, action = 7 joint targets + gripper, three cameras), so
    `dreamzero-make-metadata --preset oxe_droid` and `dreamzero-train` read it as it is."""
    from dreamzero_droid.lerobot import DatasetRecorder
    from eval.mujoco_droid.record import MODALITY

    return DatasetRecorder(root, fps=fps, robot_type="droid_sim", modality=MODALITY)


def dataset_frame(obs: dict, action: np.ndarray, frame_size: tuple[int, int]) -> tuple[dict, dict]:
    """(images, vectors) of one step: the views as the policy saw them (resize_with_pad to `frame_size`), the state
    before the step and the action executed (joint targets, binarised gripper)."""
    from eval.mujoco_droid.record import VIDEO_FEATURES

    images = {VIDEO_FEATURES[k]: resize_with_pad(obs[k], *frame_size) for k in IMAGE_KEYS}
    state = np.concatenate([np.ravel(obs["joint_position"]), np.ravel(obs["gripper_position"])])
    return images, {"observation.state": state, "action": np.asarray(action, np.float32)}
