"""Write episodes as a LeRobot v3.0 dataset (the layout `lerobot` writes) with pyarrow and imageio-ffmpeg only.

    meta/info.json                                  features, fps, totals, path templates
    meta/tasks.parquet                              task, task_index
    meta/episodes/chunk-000/file-000.parquet        one row per episode: length, data / video file and time range,
                                                    per-episode stats (`stats/<feature>/<stat>`)
    meta/stats.json                                 dataset stats per feature (min, max, mean, std, count, q01, q99)
    data/chunk-000/file-000.parquet                 every frame of every episode (rows tagged by episode_index)
    videos/<key>/chunk-000/file-<episode>.mp4       one H.264 file per episode and camera (from_timestamp 0)

Videos are H.264 in one of `VIDEO_ENCODINGS`: "standard" (yuv420p, lossy: what cameras' recordings look like) or
"lossless" (yuv444p at CRF 0: decoded frames within 2 levels of the rendered ones, about 2.5x the bytes), for a policy
that will see raw simulator frames at evaluation. info.json's `video.pix_fmt` says which.

lerobot packs several episodes per video file until a size limit; one file per episode is the same layout with the
limit never reached, so its readers and ours need nothing special. Image stats are per channel in [0, 1], shaped
[3, 1, 1] as lerobot stores them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dreamzero.errors import ConfigError

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
_INDEX_COLUMNS = ("frame_index", "episode_index", "index", "task_index")
#: name -> imageio-ffmpeg writer settings (libx264). Standard yuv420p halves the chroma resolution and shifts colours
#: by about half a level; lossless keeps full chroma and the pixels.
VIDEO_ENCODINGS = {
    "standard": {"pix_fmt_out": "yuv420p", "quality": 8},
    "lossless": {"pix_fmt_out": "yuv444p", "quality": None, "output_params": ["-crf", "0"]},
}


def video_encoding_name(encoding: str) -> str:
    if encoding not in VIDEO_ENCODINGS:
        raise ConfigError(f"video: expected one of {sorted(VIDEO_ENCODINGS)}, got {encoding!r}")
    return encoding


def dataset_video_encoding(root: str | Path) -> str:
    """The VIDEO_ENCODINGS name a dataset written here used (by its info.json pix_fmt)."""
    features = json.loads((Path(root) / "meta" / "info.json").read_text())["features"]
    fmts = {f["info"]["video.pix_fmt"] for f in features.values() if f.get("dtype") == "video"}
    names = [n for n, kw in VIDEO_ENCODINGS.items() if kw["pix_fmt_out"] in fmts]
    return names[0] if names else "standard"


@dataclass
class Episode:
    """One recorded episode: per-frame vectors and camera frames, equal lengths."""

    task: str
    vectors: dict[str, np.ndarray]  # feature key -> float32 [N, D]
    videos: dict[str, np.ndarray]  # feature key -> uint8 [N, H, W, 3]
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.vectors.values())))


def _vector_stats(x: np.ndarray) -> dict[str, list]:
    x = np.asarray(x, np.float64)
    return {
        "min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(), "std": x.std(0).tolist(),
        "count": [int(len(x))], "q01": np.quantile(x, 0.01, axis=0).tolist(),
        "q99": np.quantile(x, 0.99, axis=0).tolist(),
    }  # fmt: skip


def _image_stats(frames: np.ndarray, max_frames: int = 64) -> dict[str, list]:
    """Per-channel stats in [0, 1] over a subsample of frames, shaped [3, 1, 1]."""
    step = max(1, len(frames) // max_frames)
    px = frames[::step].reshape(-1, 3).astype(np.float64) / 255.0
    stats = _vector_stats(px)
    shaped = {k: [[[v]] for v in vals] for k, vals in stats.items() if k != "count"}
    return {**shaped, "count": [int(len(frames))]}


def _merge_stats(parts: list[dict[str, list]], counts: list[int]) -> dict[str, list]:
    """Dataset stats from per-episode ones: exact min / max / mean / std; quantiles as count-weighted means."""
    w = np.asarray(counts, np.float64)[:, None]
    stack = {k: np.asarray([p[k] for p in parts], np.float64).reshape(len(parts), -1) for k in parts[0] if k != "count"}
    shape = np.asarray(parts[0]["mean"]).shape
    mean = (stack["mean"] * w).sum(0) / w.sum()
    var = ((stack["std"] ** 2 + (stack["mean"] - mean) ** 2) * w).sum(0) / w.sum()
    out = {
        "min": stack["min"].min(0), "max": stack["max"].max(0), "mean": mean, "std": np.sqrt(var),
        "q01": (stack["q01"] * w).sum(0) / w.sum(), "q99": (stack["q99"] * w).sum(0) / w.sum(),
    }  # fmt: skip
    return {**{k: v.reshape(shape).tolist() for k, v in out.items()}, "count": [int(sum(counts))]}


def _write_video(path: Path, frames: np.ndarray, fps: float, encoding: str = "standard") -> None:
    import imageio_ffmpeg

    n, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ConfigError(f"video {path.name}: H.264 here needs even sizes, got {h}x{w}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # macro_block_size=1: keep the size as is (imageio would otherwise pad to a multiple of 16)
    writer = imageio_ffmpeg.write_frames(
        str(path), (w, h), fps=fps, codec="libx264", macro_block_size=1, **VIDEO_ENCODINGS[encoding]
    )
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def write_dataset(
    root: str | Path, episodes: list[Episode], fps: float, robot_type: str, video: str = "standard"
) -> Path:
    """Write `episodes` under `root` (must not exist yet), videos in encoding `video` (VIDEO_ENCODINGS); returns
    root."""
    video_encoding_name(video)
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"output: {root} exists and is not empty; pick a new directory")
    if not episodes:
        raise ConfigError("episodes: nothing to write")
    vector_keys, video_keys = list(episodes[0].vectors), list(episodes[0].videos)
    tasks = list(dict.fromkeys(e.task for e in episodes))
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    (root / "data" / "chunk-000").mkdir(parents=True)

    # 1. frames (one data file) and videos (one file per episode and camera)
    columns: dict[str, list] = {k: [] for k in (*vector_keys, "timestamp", *_INDEX_COLUMNS)}
    episode_rows: list[dict] = []
    per_episode_stats: list[dict[str, dict]] = []
    index = 0
    for e, ep in enumerate(episodes):
        n = len(ep)
        for key in vector_keys:
            if ep.vectors[key].shape[0] != n:
                raise ConfigError(f"episode {e}: {key} has {ep.vectors[key].shape[0]} rows, expected {n}")
            columns[key] += [row.tolist() for row in np.asarray(ep.vectors[key], np.float32)]
        columns["timestamp"] += (np.arange(n) / fps).tolist()
        columns["frame_index"] += list(range(n))
        columns["episode_index"] += [e] * n
        columns["index"] += list(range(index, index + n))
        columns["task_index"] += [tasks.index(ep.task)] * n
        stats = {key: _vector_stats(ep.vectors[key]) for key in vector_keys}
        row = {
            "episode_index": e, "tasks": [ep.task], "length": n,
            "data/chunk_index": 0, "data/file_index": 0, "dataset_from_index": index, "dataset_to_index": index + n,
            "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
        }  # fmt: skip
        for key in video_keys:
            frames = ep.videos[key]
            if len(frames) != n:
                raise ConfigError(f"episode {e}: video {key} has {len(frames)} frames, expected {n}")
            _write_video(root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=e), frames, fps, video)
            row |= {f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": e,
                    f"videos/{key}/from_timestamp": 0.0, f"videos/{key}/to_timestamp": n / fps}  # fmt: skip
            stats[key] = _image_stats(frames)
        for key, s in stats.items():
            row |= {f"stats/{key}/{name}": value for name, value in s.items()}
        episode_rows.append(row)
        per_episode_stats.append(stats)
        index += n
    arrays = {k: pa.array(columns[k], pa.list_(pa.float32())) for k in vector_keys}
    arrays["timestamp"] = pa.array(columns["timestamp"], pa.float32())
    arrays |= {k: pa.array(columns[k], pa.int64()) for k in _INDEX_COLUMNS}
    pq.write_table(pa.table(arrays), root / DATA_PATH.format(chunk_index=0, file_index=0))

    # 2. meta: episodes, tasks, stats, info
    pq.write_table(pa.Table.from_pylist(episode_rows), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    pq.write_table(pa.table({"task_index": list(range(len(tasks))), "task": tasks}), root / "meta" / "tasks.parquet")
    counts = [len(e) for e in episodes]
    stats = {k: _merge_stats([s[k] for s in per_episode_stats], counts) for k in (*vector_keys, *video_keys)}
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=1))
    features = {k: {"dtype": "float32", "shape": [episodes[0].vectors[k].shape[1]], "names": None} for k in vector_keys}
    for key in video_keys:
        h, w = episodes[0].videos[key].shape[1:3]
        features[key] = {
            "dtype": "video", "shape": [int(h), int(w), 3], "names": ["height", "width", "channels"],
            "info": {"video.height": int(h), "video.width": int(w), "video.codec": "h264",
                     "video.pix_fmt": VIDEO_ENCODINGS[video]["pix_fmt_out"],
                     "video.is_depth_map": False, "video.fps": float(fps), "video.channels": 3, "has_audio": False},
        }  # fmt: skip
    features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    features |= {k: {"dtype": "int64", "shape": [1], "names": None} for k in _INDEX_COLUMNS}
    info = {
        "codebase_version": "v3.0", "robot_type": robot_type, "total_episodes": len(episodes),
        "total_frames": int(sum(counts)), "total_tasks": len(tasks), "chunks_size": 1000,
        "data_files_size_in_mb": 100, "video_files_size_in_mb": 500,
        "fps": int(fps) if float(fps).is_integer() else fps,
        "splits": {"train": f"0:{len(episodes)}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH,
        "features": features,
    }  # fmt: skip
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    return root
