"""Recording what a robot does as a LeRobot v3.0 dataset (the `record` extra: pyarrow, imageio-ffmpeg)."""

from dreamzero_client.recording.dataset import OUTCOMES, DatasetRecorder, episode_marks, require_record_extra

__all__ = ["OUTCOMES", "DatasetRecorder", "episode_marks", "require_record_extra"]
