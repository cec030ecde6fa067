"""LeRobot v3.0 datasets: one writer (the robot's recorder, the eval recorder and the sim demos), one reader (training,
the metadata generator, replay), one set of statistics. The files: `layout.py`. pyarrow and imageio-ffmpeg (the
`record` extra) are imported only when a dataset is written or read."""

from dreamzero_droid.lerobot.layout import CHUNKS_SIZE, read_tasks, require_record_extra
from dreamzero_droid.lerobot.reader import LeRobotDataset, column_to_array, dataset_video_encoding, episode_marks
from dreamzero_droid.lerobot.recorder import DatasetRecorder
from dreamzero_droid.lerobot.stats import image_stats, merge_stats, vector_stats
from dreamzero_droid.lerobot.writer import (
    OUTCOMES,
    VIDEO_ENCODINGS,
    DatasetWriter,
    Episode,
    video_encoding_name,
    write_dataset,
)

__all__ = [
    "CHUNKS_SIZE",
    "OUTCOMES",
    "VIDEO_ENCODINGS",
    "DatasetRecorder",
    "DatasetWriter",
    "Episode",
    "LeRobotDataset",
    "column_to_array",
    "dataset_video_encoding",
    "episode_marks",
    "image_stats",
    "merge_stats",
    "read_tasks",
    "require_record_extra",
    "vector_stats",
    "video_encoding_name",
    "write_dataset",
]
