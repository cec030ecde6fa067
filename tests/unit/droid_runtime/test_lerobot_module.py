"""The one LeRobot v3.0 module (`dreamzero_droid.lerobot`): its files follow lerobot's own reading rules (data files
concatenated in path order, the tasks table's index), datasets written before it (every episode in data file 0, a
plain `task` column) and lerobot's own tasks table still load, its statistics merge exactly, and a missing extra is
named in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("imageio_ffmpeg")
pytest.importorskip("pyarrow")

import pyarrow as pa
import pyarrow.parquet as pq

from dreamzero.errors import ConfigError
from dreamzero.lerobot_dataset import LeRobotDataset, get_preset
from dreamzero_droid.lerobot import (
    DatasetWriter,
    Episode,
    episode_marks,
    merge_stats,
    read_tasks,
    vector_stats,
    write_dataset,
)
from dreamzero_droid.lerobot.layout import DATA_PATH, EPISODES_FILE, episode_file
from tests.support.lerobot import random_episodes, write_v3

CAM = "observation.images.front"


def _episodes(n: int = 3, seed: int = 0) -> list[Episode]:
    rng = np.random.default_rng(seed)
    out = []
    for e in range(n):
        length = 5 + 2 * e
        out.append(
            Episode(
                task=("reach", "grasp")[e % 2],
                vectors={"observation.state": rng.normal(size=(length, 3)).astype(np.float32),
                         "action": rng.normal(size=(length, 2)).astype(np.float32)},
                videos={CAM: rng.integers(0, 255, (length, 16, 24, 3), dtype=np.uint8)},
            )
        )  # fmt: skip
    return out


def _to_old_layout(root) -> None:
    """Rewrite a dataset as the sim writer wrote it before this module: every episode in data file 0, no marks in the
    episode table, a tasks table with a plain `task` column and no pandas index."""
    files = sorted((root / "data").glob("*/*.parquet"))
    frames = pa.concat_tables([pq.read_table(f) for f in files])
    for f in files:
        f.unlink()
    pq.write_table(frames, root / DATA_PATH.format(chunk_index=0, file_index=0))
    rows = pq.read_table(root / EPISODES_FILE).to_pylist()
    rows = [{k: v for k, v in r.items() if k not in ("success", "outcome", "note")} | {"data/file_index": 0}
            for r in rows]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), root / EPISODES_FILE)
    tasks = read_tasks(root)
    plain = pa.table({"task_index": list(tasks), "task": list(tasks.values())})
    pq.write_table(plain, root / "meta" / "tasks.parquet")


def test_files_follow_lerobots_reading_rules(tmp_path):
    pd = pytest.importorskip("pandas")
    episodes = _episodes()
    root = write_dataset(tmp_path / "ds", episodes, fps=10, robot_type="test")
    # lerobot concatenates the data files sorted by path and indexes the result by each episode's from / to index
    frames = pa.concat_tables([pq.read_table(f) for f in sorted((root / "data").glob("*/*.parquet"))])
    assert frames.column("index").to_pylist() == list(range(frames.num_rows))
    for row in pq.read_table(root / EPISODES_FILE).to_pylist():
        part = frames.slice(row["dataset_from_index"], row["dataset_to_index"] - row["dataset_from_index"])
        assert set(part.column("episode_index").to_pylist()) == {row["episode_index"]}
        assert part.column("frame_index").to_pylist() == list(range(row["length"]))
    # lerobot reads the task of a frame as `tasks.iloc[task_index].name`: the strings are the pandas index
    tasks = pd.read_parquet(root / "meta" / "tasks.parquet")
    assert [tasks.iloc[i].name for i in range(len(tasks))] == ["reach", "grasp"]
    assert int(tasks.loc["grasp", "task_index"]) == 1
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["total_frames"] == frames.num_rows and info["total_tasks"] == 2 and info["chunks_size"] == 1000


def test_episode_files_roll_over_to_the_next_chunk_and_sort_in_episode_order():
    assert [episode_file(e) for e in (0, 999, 1000, 2501)] == [(0, 0), (0, 999), (1, 0), (2, 501)]
    paths = [DATA_PATH.format(chunk_index=c, file_index=f) for c, f in map(episode_file, (0, 5, 999, 1000, 1001))]
    assert sorted(paths) == paths


def test_datasets_written_before_this_module_still_load_and_append(tmp_path):
    episodes = _episodes()
    new = write_dataset(tmp_path / "new", episodes, fps=10, robot_type="test")
    old = write_dataset(tmp_path / "old", episodes, fps=10, robot_type="test")
    _to_old_layout(old)
    a, b = LeRobotDataset(new), LeRobotDataset(old)
    assert a.episode_indices == b.episode_indices == [0, 1, 2]
    assert a.tasks() == b.tasks() == {0: "reach", 1: "grasp"}
    for e in a.episode_indices:
        cols = ["observation.state", "action", "task_index"]
        got, want = b.episode_columns(e, cols), a.episode_columns(e, cols)
        for key in cols:
            np.testing.assert_array_equal(got[key], want[key])
        np.testing.assert_allclose(want["action"], episodes[e].vectors["action"], atol=1e-7)
    assert [m["success"] for m in episode_marks(old)] == [None] * 3
    # a recorder appends to an old dataset without touching its data file
    writer = DatasetWriter(old, fps=10, robot_type="test")
    writer.begin_episode("place")
    for i in range(4):
        writer.add_frame({CAM: np.zeros((16, 24, 3), np.uint8)}, {"observation.state": [i, 0, 0], "action": [i, 1]})
    writer.end_episode(success=True)
    ds = LeRobotDataset(old)
    assert ds.episode_indices == [0, 1, 2, 3] and ds.tasks()[2] == "place"
    np.testing.assert_array_equal(ds.episode_columns(3, ["action"])["action"][:, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(
        ds.episode_columns(0, ["action"])["action"], a.episode_columns(0, ["action"])["action"]
    )


def test_training_reads_the_old_layout_and_lerobots_tasks_table(tmp_path):
    import torch

    from dreamzero.embodiments import get_embodiment
    from dreamzero.metadata_cli import compute_metadata
    from dreamzero.train.data import load_episodes
    from tests.support.train_data import TASK, write_synthetic_dataset

    torch.set_num_threads(1)
    root = write_synthetic_dataset(tmp_path / "ds", n_episodes=2, length=30)
    meta = compute_metadata(LeRobotDataset(root), get_preset("oxe_droid"), progress=False)
    embodiment = get_embodiment("oxe_droid", meta)
    before = load_episodes(root, embodiment)
    _to_old_layout(root)
    after = load_episodes(root, embodiment)
    assert [e.task for e in after] == [TASK, TASK]
    for x, y in zip(before, after):
        for key in x.action:
            np.testing.assert_array_equal(x.action[key], y.action[key])
        assert {k: v.shape for k, v in x.views.items()} == {k: v.shape for k, v in y.views.items()}
    # lerobot's own tasks table: the strings as an unnamed pandas index (`__index_level_0__`)
    fixture = write_v3(tmp_path / "lerobot", random_episodes(2, {"observation.state": 3}))
    assert read_tasks(fixture) == {0: "do it"}


def test_merged_stats_equal_the_stats_of_the_union():
    rng = np.random.default_rng(3)
    parts = [rng.normal(i, 1 + i, size=(10 + 5 * i, 4)) for i in range(3)]
    merged, whole = merge_stats([vector_stats(p) for p in parts]), vector_stats(np.concatenate(parts))
    for name in ("min", "max", "mean", "std", "count"):
        np.testing.assert_allclose(merged[name], whole[name], rtol=1e-12)


def test_bad_input_is_named(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="output: .* not empty"):
        write_dataset(tmp_path / "full", _episodes(1), fps=10, robot_type="t")
    with pytest.raises(ConfigError, match="video: expected one of"):
        DatasetWriter(tmp_path / "v", fps=10, video="av1")
    writer = DatasetWriter(tmp_path / "w", fps=10)
    writer.begin_episode("t")
    writer.add_frame({CAM: np.zeros((16, 24, 3), np.uint8)}, {"action": [0.0]})
    with pytest.raises(ConfigError, match=r"images\['observation.images.front'\]: one camera keeps one size"):
        writer.add_frame({CAM: np.zeros((18, 24, 3), np.uint8)}, {"action": [0.0]})
    with pytest.raises(ConfigError, match="outcome: expected one of"):
        writer.end_episode(success=None, outcome="crashed")


def test_without_the_record_extra_the_error_names_it():
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from dreamzero_droid.lerobot import DatasetRecorder\n"
        "from dreamzero_client.errors import ConfigError\n"
        "try:\n    DatasetRecorder('/nonexistent/ds', fps=10)\n"
        "except ConfigError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "pip install 'dreamzero-droid[record]'" in out.stdout, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1
