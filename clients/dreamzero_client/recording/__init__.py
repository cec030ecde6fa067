"""Recording what a robot does as a LeRobot v3.0 dataset (the `record` extra: pyarrow, imageio-ffmpeg)."""

from dreamzero_client.recording.dataset import DatasetRecorder, episode_marks

__all__ = ["DatasetRecorder", "episode_marks"]
