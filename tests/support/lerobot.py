"""Write small LeRobot datasets in the real v2.1 / v3.0 on-disk layouts (parquet frames + meta/ files)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DROID_MODALITY = {
    "state": {"joint_position": {"start": 0, "end": 7}, "gripper_position": {"start": 7, "end": 8}},
    "action": {"joint_position": {"start": 0, "end": 7}, "gripper_position": {"start": 7, "end": 8}},
    "video": {"exterior_image_1_left": {"original_key": "observation.images.exterior_image_1_left"}},
}


def random_episodes(n_episodes: int, columns: dict[str, int], seed: int = 0, lengths=None) -> list[dict]:
    """[{column: float32 [N, D]}] with episode lengths varying."""
    rng = np.random.default_rng(seed)
    lengths = lengths or [int(rng.integers(20, 40)) for _ in range(n_episodes)]
    return [
        {c: rng.normal(size=(n, d)).astype(np.float32) * (i + 1) for i, (c, d) in enumerate(columns.items())}
        for n in lengths
    ]


def _features(columns: dict[str, int], videos: dict[str, tuple[int, int]]) -> dict:
    feats = {c: {"dtype": "float32", "shape": [d], "names": None} for c, d in columns.items()}
    for key, (h, w) in videos.items():
        feats[key] = {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                      "info": {"video.fps": 15.0}}  # fmt: skip
    for c in ("timestamp",):
        feats[c] = {"dtype": "float32", "shape": [1], "names": None}
    for c in ("frame_index", "episode_index", "index", "task_index"):
        feats[c] = {"dtype": "int64", "shape": [1], "names": None}
    return feats


def _frame_table(episodes: list[dict], first_episode: int, first_index: int) -> pa.Table:
    cols: dict[str, list] = {}
    index = first_index
    for e, ep in enumerate(episodes, start=first_episode):
        n = len(next(iter(ep.values())))
        for c, v in ep.items():
            cols.setdefault(c, []).extend(list(row) for row in v)
        cols.setdefault("timestamp", []).extend((np.arange(n) / 15.0).tolist())
        cols.setdefault("frame_index", []).extend(range(n))
        cols.setdefault("episode_index", []).extend([e] * n)
        cols.setdefault("index", []).extend(range(index, index + n))
        cols.setdefault("task_index", []).extend([0] * n)
        index += n
    arrays = {}
    for c, v in cols.items():
        if c in ("timestamp",):
            arrays[c] = pa.array(v, pa.float32())
        elif c in ("frame_index", "episode_index", "index", "task_index"):
            arrays[c] = pa.array(v, pa.int64())
        else:
            arrays[c] = pa.array(v, pa.list_(pa.float32()))
    return pa.table(arrays)


def write_v2(root: Path, episodes: list[dict], videos=None, modality=None, fps=15) -> Path:
    columns = {c: v.shape[1] for c, v in episodes[0].items()}
    (root / "meta").mkdir(parents=True)
    info = {
        "codebase_version": "v2.1", "robot_type": "test", "fps": fps, "chunks_size": 1000,
        "total_episodes": len(episodes), "total_frames": sum(len(next(iter(e.values()))) for e in episodes),
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
        "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
        "features": _features(columns, videos or {}),
    }  # fmt: skip
    (root / "meta" / "info.json").write_text(json.dumps(info))
    lines = [json.dumps({"episode_index": i, "tasks": ["do it"], "length": len(next(iter(e.values())))})
             for i, e in enumerate(episodes)]  # fmt: skip
    (root / "meta" / "episodes.jsonl").write_text("\n".join(lines) + "\n")
    (root / "meta" / "tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "do it"}) + "\n")
    if modality is not None:
        (root / "meta" / "modality.json").write_text(json.dumps(modality))
    (root / "data" / "chunk-000").mkdir(parents=True)
    index = 0
    for i, ep in enumerate(episodes):
        pq.write_table(_frame_table([ep], i, index), root / "data" / "chunk-000" / f"episode_{i:06d}.parquet")
        index += len(next(iter(ep.values())))
    return root


def write_v3(root: Path, episodes: list[dict], videos=None, modality=None, episodes_per_file: int = 2) -> Path:
    """v3.0: several episodes per data file; the episode table says which file holds which episode."""
    columns = {c: v.shape[1] for c, v in episodes[0].items()}
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    info = {
        "codebase_version": "v3.0", "robot_type": "test", "fps": 15, "chunks_size": 1000,
        "data_files_size_in_mb": 100, "video_files_size_in_mb": 500, "total_episodes": len(episodes),
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
        "features": _features(columns, videos or {}),
    }  # fmt: skip
    (root / "meta" / "info.json").write_text(json.dumps(info))
    if modality is not None:
        (root / "meta" / "modality.json").write_text(json.dumps(modality))
    (root / "data" / "chunk-000").mkdir(parents=True)
    rows = {k: [] for k in ("episode_index", "length", "data/chunk_index", "data/file_index", "dataset_from_index",
                            "dataset_to_index", "tasks")}  # fmt: skip
    index = 0
    for f, start in enumerate(range(0, len(episodes), episodes_per_file)):
        group = episodes[start : start + episodes_per_file]
        table = _frame_table(group, start, index)
        # shuffle rows: readers must select by episode_index and order by frame_index
        table = table.take(pa.array(np.random.default_rng(f).permutation(table.num_rows)))
        pq.write_table(table, root / "data" / "chunk-000" / f"file-{f:03d}.parquet")
        for e, ep in enumerate(group, start=start):
            n = len(next(iter(ep.values())))
            for k, v in (
                ("episode_index", e),
                ("length", n),
                ("data/chunk_index", 0),
                ("data/file_index", f),
                ("dataset_from_index", index),
                ("dataset_to_index", index + n),
                ("tasks", ["do it"]),
            ):
                rows[k].append(v)  # fmt: skip
            index += n
    pq.write_table(pa.table(rows), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    pq.write_table(pa.table({"task_index": [0], "__index_level_0__": ["do it"]}), root / "meta" / "tasks.parquet")
    return root
