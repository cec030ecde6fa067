"""The LeRobot v3.0 layout on disk, shared by the writer and the reader: paths, where an episode's files go, the tasks
table, and the lazy imports of the `record` extra (pyarrow, imageio-ffmpeg).

    meta/info.json                                   features, fps, totals, the two path templates below
    meta/tasks.parquet                               task_index, task (the task strings are the pandas index, as
                                                     lerobot writes it, so its `tasks.iloc[i].name` is the text)
    meta/stats.json                                  per feature: min, max, mean, std, count, q01, q99
    meta/episodes/chunk-000/file-000.parquet         one row per episode: length, file addresses, time ranges,
                                                     per-episode stats, our marks (success, outcome, note)
    meta/modality.json                               GR00T-style slices of the vectors (when given)
    data/chunk-CCC/file-FFF.parquet                  the frames of one episode
    videos/<feature>/chunk-CCC/file-FFF.mp4          one H.264 file per episode and camera (from_timestamp 0)

An episode's files are at chunk `e // 1000`, file `e % 1000` (lerobot's `chunks_size`), so a file is written once and
never touched again and the files sort in episode order (lerobot concatenates the data files sorted by path).
lerobot packs several episodes per file up to a size; one per episode is the same layout with that limit never
reached. The reader also reads datasets written before this layout (every episode in data file 0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dreamzero_client.errors import ConfigError

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_FILE = "meta/episodes/chunk-000/file-000.parquet"
TASKS_FILE = "meta/tasks.parquet"
CHUNKS_SIZE = 1000
INDEX_COLUMNS = ("frame_index", "episode_index", "index", "task_index")
EXTRA_HINT = "pip install 'dreamzero-droid[record]'"


def episode_file(episode_index: int) -> tuple[int, int]:
    """(chunk_index, file_index) of an episode's data and video files."""
    return divmod(int(episode_index), CHUNKS_SIZE)


def require_record_extra() -> None:
    """Raise `ConfigError` naming the `record` extra unless pyarrow and imageio-ffmpeg import."""
    try:
        import imageio_ffmpeg  # noqa: F401
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"record_dataset: recording needs the `record` extra ({EXTRA_HINT}): {exc}") from None


def arrow():
    """(pyarrow, pyarrow.parquet), or `ConfigError` naming the extra."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"LeRobot datasets need pyarrow, in the `record` extra ({EXTRA_HINT}): {exc}") from None
    return pa, pq


def replace(path: Path, write) -> None:
    """Write through a temporary file and rename it into place (a reader sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def tasks_table(tasks: list[str]):
    """The tasks table as lerobot writes it with pandas: a task_index column, the task strings as the index."""
    pa, _ = arrow()
    pandas_meta = {
        "index_columns": ["task"], "column_indexes": [],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
    }  # fmt: skip
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())})
    return table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})


def read_tasks(root: str | Path) -> dict[int, str]:
    """{task_index: task} of a dataset: v3's tasks.parquet (the strings as a `task` column, or as the pandas index
    lerobot writes, `__index_level_0__` or named in the pandas metadata), or v2's tasks.jsonl."""
    root = Path(root)
    jsonl = root / "meta" / "tasks.jsonl"
    if not (root / TASKS_FILE).is_file() and jsonl.is_file():
        rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        return {int(r["task_index"]): str(r["task"]) for r in rows}
    _, pq = arrow()
    if not (root / TASKS_FILE).is_file():
        raise ConfigError(f"{root}: {TASKS_FILE} is missing")
    table = pq.read_table(root / TASKS_FILE)
    names = ["task", "__index_level_0__"]
    meta = (table.schema.metadata or {}).get(b"pandas")
    if meta:
        names += [c for c in json.loads(meta).get("index_columns", []) if isinstance(c, str)]
    column = next((n for n in names if n in table.column_names), None)
    if column is None or "task_index" not in table.column_names:
        raise ConfigError(f"{root / TASKS_FILE}: expected task_index and the task strings, has {table.column_names}")
    d = table.to_pydict()
    return {int(i): str(t) for i, t in zip(d["task_index"], d[column])}
