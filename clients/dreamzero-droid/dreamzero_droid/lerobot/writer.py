"""Write episodes as a LeRobot v3.0 dataset (layout: `layout.py`), one frame at a time on the caller's thread.

    writer = DatasetWriter("demos/", fps=15, robot_type="franka", modality=...)
    writer.begin_episode("put the cube in the bowl")
    writer.add_frame({"observation.images.wrist": rgb, ...}, {"observation.state": s, "action": a})  # per step
    writer.end_episode(success=True)        # writes the episode's data file, then the meta files

Frames stream to H.264 (imageio-ffmpeg) as they come; the vectors are kept and written with the meta files at
`end_episode` (each file to a temporary name, then renamed). The meta files list finished episodes only, so a writer
stopped mid-episode, even killed, leaves a valid dataset of the episodes before, and the next writer on the same folder
appends after them. `DatasetRecorder` (recorder.py) runs this off a control loop's thread; `write_dataset` writes
whole episodes at once (the sim demos).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_droid.lerobot.layout import (
    CHUNKS_SIZE,
    DATA_PATH,
    EPISODES_FILE,
    INDEX_COLUMNS,
    TASKS_FILE,
    VIDEO_PATH,
    arrow,
    episode_file,
    read_tasks,
    replace,
    require_record_extra,
    tasks_table,
)
from dreamzero_droid.lerobot.stats import image_stats, merge_stats, vector_stats

log = logging.getLogger(__name__)

#: an episode's end: the task succeeded / failed, it was stopped (operator, Ctrl+C), the run failed (a fault: server
#: lost, device error), or it ran to its end without a verdict
OUTCOMES = ("success", "failure", "aborted", "failed", "done")
#: name -> imageio-ffmpeg writer settings (libx264). Standard yuv420p halves the chroma resolution and shifts colours
#: by about half a level (what cameras' recordings look like); lossless keeps full chroma and the pixels (decoded
#: frames within 2 levels of the rendered ones, about 2.5x the bytes), for a policy that sees raw simulator frames.
VIDEO_ENCODINGS = {
    "standard": {"pix_fmt_out": "yuv420p", "quality": 8},
    "lossless": {"pix_fmt_out": "yuv444p", "quality": None, "output_params": ["-crf", "0"]},
}
_IMAGE_STAT_EVERY = 8  # every 8th frame of an episode (at a quarter of its size) feeds its image statistics


def video_encoding_name(encoding: str) -> str:
    if encoding not in VIDEO_ENCODINGS:
        raise ConfigError(f"video: expected one of {sorted(VIDEO_ENCODINGS)}, got {encoding!r}")
    return encoding


class _Episode:
    def __init__(self, index: int, task: str):
        self.index, self.task = index, task
        self.vectors: dict[str, list[np.ndarray]] = {}
        self.videos: dict[str, object] = {}  # camera -> imageio-ffmpeg writer generator
        self.sizes: dict[str, tuple[int, int]] = {}
        self.stat_frames: dict[str, list[np.ndarray]] = {}
        self.length = 0

    def close_videos(self) -> None:
        for writer in self.videos.values():
            writer.close()


class DatasetWriter:
    """Episodes into a LeRobot v3.0 dataset at `root`, appending to one already there. Vector features are float32
    rows (their widths fixed by the first episode), image features uint8 [H, W, 3] with even H and W, encoded as
    `video` (VIDEO_ENCODINGS)."""

    def __init__(
        self,
        root: str | Path,
        fps: float,
        robot_type: str = "unknown",
        modality: dict | None = None,
        video: str = "standard",
    ):
        require_record_extra()
        if not fps > 0:
            raise ConfigError(f"fps: expected > 0, got {fps}")
        self.root, self.fps, self.robot_type = Path(root), float(fps), robot_type
        self.video = video_encoding_name(video)
        self.root.mkdir(parents=True, exist_ok=True)
        if modality is not None:
            (self.root / "meta").mkdir(exist_ok=True)
            (self.root / "meta" / "modality.json").write_text(json.dumps(modality, indent=1))
        self._rows, self._tasks, self._features = self._existing()
        self._episode: _Episode | None = None
        self._defer_meta = False  # write_dataset writes the meta files once, after its last episode

    @property
    def episodes_written(self) -> int:
        return len(self._rows)

    def begin_episode(self, task: str) -> None:
        """Start an episode (an open one is dropped unwritten). Its index is the count of episodes written before it,
        so an episode without frames leaves no gap."""
        self.discard_episode()
        self._episode = _Episode(len(self._rows), str(task))

    def add_frame(self, images: dict[str, np.ndarray], vectors: dict[str, np.ndarray]) -> None:
        import imageio_ffmpeg

        ep = self._episode
        if ep is None:
            raise ConfigError("add_frame: no episode is open (call begin_episode first)")
        images = {k: np.asarray(v, np.uint8) for k, v in images.items()}
        for key, frame in images.items():  # all checked before any is written, so a refused frame writes nothing
            check_image(key, frame.shape)
            if key in ep.sizes and ep.sizes[key] != frame.shape[:2]:
                raise ConfigError(f"images[{key!r}]: one camera keeps one size, {ep.sizes[key]} then {frame.shape[:2]}")
        for key, frame in images.items():
            h, w = frame.shape[:2]
            if key not in ep.videos:
                chunk, file = episode_file(ep.index)
                path = self.root / VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file)
                path.parent.mkdir(parents=True, exist_ok=True)
                # macro_block_size=1: keep the size as is (imageio would otherwise pad to a multiple of 16)
                writer = imageio_ffmpeg.write_frames(str(path), (w, h), fps=self.fps, codec="libx264",
                                                     macro_block_size=1, ffmpeg_log_level="error",
                                                     **VIDEO_ENCODINGS[self.video])  # fmt: skip
                writer.send(None)
                ep.videos[key], ep.sizes[key], ep.stat_frames[key] = writer, (h, w), []
            ep.videos[key].send(np.ascontiguousarray(frame))
            if ep.length % _IMAGE_STAT_EVERY == 0:
                ep.stat_frames[key].append(frame[::4, ::4])
        for key, value in vectors.items():
            ep.vectors.setdefault(key, []).append(np.asarray(value, np.float32).ravel())
        ep.length += 1

    def end_episode(self, success: bool | None, outcome: str | None = None, note: str | None = None) -> None:
        """Finish the open episode, marked: success True / False / None (unknown); outcome one of OUTCOMES (default:
        from success); note: free text (a failure's reason). An episode without frames is not written."""
        outcome = outcome or {True: "success", False: "failure", None: "done"}[success]
        if outcome not in OUTCOMES:
            raise ConfigError(f"outcome: expected one of {OUTCOMES}, got {outcome!r}")
        ep, self._episode = self._episode, None
        if ep is None:
            return
        ep.close_videos()
        if ep.length == 0:
            log.info("dataset writer: episode %d has no frames; not written", ep.index)
            return
        self._write_episode(ep, success, outcome, note)

    def discard_episode(self) -> None:
        """Drop the open episode unwritten (its video files are written over by the next one)."""
        ep, self._episode = self._episode, None
        if ep is not None:
            ep.close_videos()

    # -- files --------------------------------------------------------------------------------------------------------

    def _write_episode(self, ep: _Episode, success: bool | None, outcome: str, note: str | None) -> None:
        pa, pq = arrow()
        n, start = ep.length, sum(int(r["length"]) for r in self._rows)
        vectors = {k: np.stack(v) for k, v in ep.vectors.items()}
        lengths = {k: len(v) for k, v in vectors.items()}
        if any(m != n for m in lengths.values()):
            raise ConfigError(f"episode {ep.index}: every frame needs every vector, got {lengths} of {n} frames")
        self._check_features(vectors, ep)
        if ep.task not in self._tasks:
            self._tasks.append(ep.task)
        columns = {k: _list_column(pa, v) for k, v in vectors.items()}
        columns["timestamp"] = pa.array((np.arange(n) / self.fps).tolist(), pa.float32())
        columns["frame_index"] = pa.array(range(n), pa.int64())
        columns["episode_index"] = pa.array([ep.index] * n, pa.int64())
        columns["index"] = pa.array(range(start, start + n), pa.int64())
        columns["task_index"] = pa.array([self._tasks.index(ep.task)] * n, pa.int64())
        chunk, file = episode_file(ep.index)
        data_path = self.root / DATA_PATH.format(chunk_index=chunk, file_index=file)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        replace(data_path, lambda p: pq.write_table(pa.table(columns), p))
        row = {
            "episode_index": ep.index, "tasks": [ep.task], "length": n,
            "data/chunk_index": chunk, "data/file_index": file, "dataset_from_index": start,
            "dataset_to_index": start + n, "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
            "success": success, "outcome": outcome, "note": note,
        }  # fmt: skip
        stats = {k: vector_stats(v) for k, v in vectors.items()}
        for key in ep.videos:
            row |= {f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                    f"videos/{key}/from_timestamp": 0.0, f"videos/{key}/to_timestamp": n / self.fps}  # fmt: skip
            stats[key] = image_stats(ep.stat_frames[key], n)
        for key, s in stats.items():
            row |= {f"stats/{key}/{name}": value for name, value in s.items()}
        self._rows.append(row)
        if not self._defer_meta:
            self._write_meta()

    def _check_features(self, vectors: dict[str, np.ndarray], ep: _Episode) -> None:
        features = {k: {"dtype": "float32", "shape": [int(v.shape[1])], "names": None} for k, v in vectors.items()}
        for key, (h, w) in ep.sizes.items():
            features[key] = {
                "dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                "info": {"video.height": h, "video.width": w, "video.codec": "h264",
                         "video.pix_fmt": VIDEO_ENCODINGS[self.video]["pix_fmt_out"], "video.is_depth_map": False,
                         "video.fps": self.fps, "video.channels": 3, "has_audio": False},
            }  # fmt: skip
        features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
        features |= {k: {"dtype": "int64", "shape": [1], "names": None} for k in INDEX_COLUMNS}
        if self._features is not None and self._features != features:
            raise ConfigError(
                f"episode {ep.index}: its features differ from the dataset's ({self.root}/meta/info.json)"
            )
        self._features = features

    def _write_meta(self) -> None:
        pa, pq = arrow()
        meta = self.root / "meta"
        (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
        replace(self.root / TASKS_FILE, lambda p: pq.write_table(tasks_table(self._tasks), p))
        keys = [k for k in self._features if k not in ("timestamp", *INDEX_COLUMNS)]
        stats = {k: merge_stats([_row_stats(r, k) for r in self._rows]) for k in keys}
        replace(meta / "stats.json", lambda p: p.write_text(json.dumps(stats, indent=1)))
        replace(self.root / EPISODES_FILE, lambda p: pq.write_table(pa.Table.from_pylist(self._rows), p))
        info = {
            "codebase_version": "v3.0", "robot_type": self.robot_type, "total_episodes": len(self._rows),
            "total_frames": int(sum(int(r["length"]) for r in self._rows)), "total_tasks": len(self._tasks),
            "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": 100, "video_files_size_in_mb": 500,
            "fps": int(self.fps) if self.fps.is_integer() else self.fps,
            "splits": {"train": f"0:{len(self._rows)}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH,
            "features": self._features,
        }  # fmt: skip
        replace(meta / "info.json", lambda p: p.write_text(json.dumps(info, indent=2)))

    def _existing(self) -> tuple[list[dict], list[str], dict | None]:
        """Episodes, tasks and features of a dataset this writer appends to (none for a new folder)."""
        info_path = self.root / "meta" / "info.json"
        if not info_path.is_file():
            return [], [], None
        _, pq = arrow()
        info = json.loads(info_path.read_text())
        if (info.get("data_path"), info.get("video_path")) != (DATA_PATH, VIDEO_PATH):
            raise ConfigError(f"record_dataset: {self.root} uses other path templates; record to a new folder")
        rows = pq.read_table(self.root / EPISODES_FILE).to_pylist()
        if [int(r["episode_index"]) for r in rows] != list(range(len(rows))):
            raise ConfigError(f"record_dataset: {self.root} holds episodes that are not 0..N-1; record to a new folder")
        tasks = read_tasks(self.root)
        return rows, [tasks[i] for i in sorted(tasks)], info.get("features")


def check_image(key: str, shape: tuple) -> None:
    """ConfigError naming the feature unless `shape` is [H, W, 3] with even H and W (H.264 in 4:2:0 needs them)."""
    if len(shape) != 3 or shape[2] != 3 or shape[0] % 2 or shape[1] % 2:
        raise ConfigError(f"images[{key!r}]: expected uint8 [H, W, 3] with even H and W, got {tuple(shape)}")


def _list_column(pa, rows: np.ndarray):
    """float32 [N, D] -> a list<float32> column (lerobot's Sequence), without a Python list per row."""
    n, d = rows.shape
    offsets = pa.array(np.arange(0, n * d + 1, d, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(rows, np.float32).ravel()))


def _row_stats(row: dict, key: str) -> dict[str, list]:
    prefix = f"stats/{key}/"
    return {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}


@dataclass
class Episode:
    """One whole episode for `write_dataset`: per-frame vectors and camera frames, equal lengths."""

    task: str
    vectors: dict[str, np.ndarray]  # feature key -> float32 [N, D]
    videos: dict[str, np.ndarray]  # feature key -> uint8 [N, H, W, 3]
    extra: dict = field(default_factory=dict)  # the caller's own record (not written here)
    success: bool | None = None

    def __len__(self) -> int:
        return len(next(iter(self.vectors.values())))


def write_dataset(
    root: str | Path,
    episodes: list[Episode],
    fps: float,
    robot_type: str,
    video: str = "standard",
    modality: dict | None = None,
) -> Path:
    """Write `episodes` as a new dataset at `root` (absent or empty), videos in encoding `video`; returns root."""
    video_encoding_name(video)
    root = Path(root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"output: {root} exists and is not empty; pick a new directory")
    if not episodes:
        raise ConfigError("episodes: nothing to write")
    writer = DatasetWriter(root, fps, robot_type, modality=modality, video=video)
    writer._defer_meta = True
    for e, ep in enumerate(episodes):
        n = len(ep)
        for key, value in (*ep.vectors.items(), *ep.videos.items()):
            if len(value) != n:
                raise ConfigError(f"episode {e}: {key} has {len(value)} rows, expected {n}")
        writer.begin_episode(ep.task)
        for i in range(n):
            writer.add_frame({k: v[i] for k, v in ep.videos.items()}, {k: v[i] for k, v in ep.vectors.items()})
        writer.end_episode(ep.success)
    writer._write_meta()
    return root
