"""Scripted demonstrations of MuJoCo DROID scene 1: the expert's IK and layouts, and the recorded LeRobot v3.0 dataset
(read back by our LeRobot reader, the metadata generator and the DROID embodiment)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("mujoco")
pytest.importorskip("franky_sim")
pytest.importorskip("imageio_ffmpeg")

from dreamzero.embodiments import get_embodiment
from dreamzero.errors import ConfigError
from dreamzero.lerobot_dataset import LeRobotDataset, get_preset
from dreamzero.metadata_cli import compute_metadata, main
from dreamzero.train.data import read_video
from eval.mujoco_droid.expert import LAYOUT_X, LAYOUT_Y, LAYOUTS, MIN_SEPARATION_M, sample_layout
from eval.mujoco_droid.record import VIDEO_FEATURES, merge_datasets, read_episodes, record_demos

HW = (64, 112)


def _frames(root) -> pa.Table:
    """Every frame of a dataset as lerobot reads them: the data files concatenated in path order."""
    return pa.concat_tables([pq.read_table(f) for f in sorted((root / "data").glob("*/*.parquet"))])


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos") / "scene1"
    summary = record_demos(root, num_episodes=2, seed=0, image_size=HW, render_quality="fast")
    return root, summary


def test_layouts_cover_the_patch_and_keep_objects_apart():
    rng = np.random.default_rng(0)
    layouts = [sample_layout(rng) for _ in range(300)]
    pts = np.array([[*lay.object_xy, *lay.target_xy] for lay in layouts])
    for cols in ((0, 1), (2, 3)):
        xy = pts[:, cols]
        assert (xy[:, 0] >= LAYOUT_X[0]).all() and (xy[:, 0] <= LAYOUT_X[1]).all()
        assert (xy[:, 1] >= LAYOUT_Y[0]).all() and (xy[:, 1] <= LAYOUT_Y[1]).all()
    assert (np.linalg.norm(pts[:, :2] - pts[:, 2:], axis=1) >= MIN_SEPARATION_M).all()
    # the cube is sometimes left and sometimes right of the bowl: the images are needed to know which
    left = pts[:, 1] > pts[:, 3]
    assert 0.3 < left.mean() < 0.7


def test_compact_layouts_stay_in_their_boxes_and_still_vary():
    spec, rng = LAYOUTS["compact"], np.random.default_rng(1)
    pts = np.array([[*lay.object_xy, *lay.target_xy] for lay in (sample_layout(rng, "compact") for _ in range(300))])
    for cols, ((x0, y0), (x1, y1)) in (((0, 1), spec.object_box), ((2, 3), spec.target_box)):
        xy = pts[:, cols]
        assert (xy[:, 0] >= x0).all() and (xy[:, 0] <= x1).all() and (xy[:, 1] >= y0).all() and (xy[:, 1] <= y1).all()
        # spread over the box: a policy that ignores the images reaches a cube 5 cm wide only by luck
        assert np.ptp(xy[:, 0]) > 0.9 * (x1 - x0) and np.ptp(xy[:, 1]) > 0.9 * (y1 - y0)
    assert (np.linalg.norm(pts[:, :2] - pts[:, 2:], axis=1) >= spec.min_separation_m).all()
    with pytest.raises(ConfigError, match="layouts: expected one of"):
        sample_layout(rng, "narrow")


def test_expert_succeeds_and_dataset_is_written(demos):
    root, summary = demos
    assert summary["episodes"] == 2 and summary["attempts"] == 2, summary  # both expert attempts put the cube in
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 15 and info["total_episodes"] == 2
    data = _frames(root)
    assert data.num_rows == info["total_frames"] == summary["frames"]
    assert data.column("index").to_pylist() == list(range(data.num_rows))  # global index = position, as lerobot's
    episodes = pq.read_table(root / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    assert [e["episode_index"] for e in episodes] == [0, 1] and [e["success"] for e in episodes] == [True, True]
    assert sum(e["length"] for e in episodes) == data.num_rows
    assert episodes[1]["dataset_from_index"] == episodes[0]["length"]
    assert [(e["data/chunk_index"], e["data/file_index"]) for e in episodes] == [(0, 0), (0, 1)]  # one file each
    tasks = pq.read_table(root / "meta" / "tasks.parquet").to_pylist()
    assert tasks == [{"task_index": 0, "task": "put the cube in the bowl"}]
    for key in VIDEO_FEATURES.values():
        assert info["features"][key]["shape"] == [*HW, 3]
        for e in episodes:
            path = root / info["video_path"].format(
                video_key=key, chunk_index=e[f"videos/{key}/chunk_index"], file_index=e[f"videos/{key}/file_index"]
            )
            frames = read_video(path)
            assert frames.shape == (e["length"], *HW, 3)
            assert frames.std() > 5  # a rendered scene, not a blank
    # the gripper closes during the episode and opens again before the end
    state = np.array(data.column("observation.state").to_pylist())
    action = np.array(data.column("action").to_pylist())
    assert action[:, 7].max() == 1.0 and action[-1, 7] == 0.0
    assert state[:, 7].max() > 0.1  # the fingers stop on the cube: partly closed


def test_stats_json_matches_the_frames(demos):
    root, _ = demos
    stats = json.loads((root / "meta" / "stats.json").read_text())
    data = _frames(root)
    for key in ("observation.state", "action"):
        x = np.array(data.column(key).to_pylist(), np.float64)
        np.testing.assert_allclose(stats[key]["mean"], x.mean(0), atol=1e-5)
        np.testing.assert_allclose(stats[key]["std"], x.std(0), atol=1e-5)
        np.testing.assert_allclose(stats[key]["min"], x.min(0), atol=1e-6)
        np.testing.assert_allclose(stats[key]["max"], x.max(0), atol=1e-6)
        assert stats[key]["count"] == [len(x)]
    assert np.array(stats[VIDEO_FEATURES["wrist_image_left"]]["mean"]).shape == (3, 1, 1)


def test_metadata_generator_reads_the_demos(demos, tmp_path):
    root, _ = demos
    dataset = LeRobotDataset(root)
    assert dataset.major == 3 and dataset.episode_indices == [0, 1]
    meta = compute_metadata(dataset, get_preset("oxe_droid"), progress=False)["oxe_droid"]
    stats = meta["statistics"]
    assert len(stats["state"]["joint_position"]["mean"]) == 7
    assert len(stats["action"]["gripper_position"]["q99"]) == 1
    assert meta["modalities"]["action"]["joint_position"]["absolute"] is False  # relative deltas, as DROID
    assert meta["modalities"]["video"]["wrist_image_left"]["resolution"] == [HW[1], HW[0]]
    # the embodiment accepts these statistics, and so does the command line
    get_embodiment("oxe_droid", {"oxe_droid": meta})
    out = tmp_path / "metadata.json"
    assert main(["generate", str(root), "--preset", "oxe_droid", "-o", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["oxe_droid"]["statistics"] == json.loads(json.dumps(stats))


def test_merged_parts_hold_every_episode_and_layout(demos, tmp_path):
    root, _ = demos
    merged = merge_datasets(tmp_path / "merged", [root, root])
    info = json.loads((merged / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 4
    layouts = json.loads((merged / "meta" / "layouts.json").read_text())
    assert [r["episode_index"] for r in layouts] == [0, 1, 2, 3] and [r["seed"] for r in layouts] == [0, 1, 0, 1]
    first, again = read_episodes(root), read_episodes(merged)
    assert len(again) == 4
    np.testing.assert_array_equal(again[2].vectors["action"], first[0].vectors["action"])
    assert {k: v.shape for k, v in again[3].videos.items()} == {k: v.shape for k, v in first[1].videos.items()}
    compute_metadata(LeRobotDataset(merged), get_preset("oxe_droid"), progress=False)  # the generator reads it


def test_lossless_video_keeps_the_rendered_frames_and_survives_a_merge(tmp_path):
    from dreamzero_droid.lerobot import Episode, dataset_video_encoding, write_dataset

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (4, 16, 24, 3), dtype=np.uint8)  # noise: the hardest case for a lossy codec
    frames[:, :8] = 200  # and a flat area, as a table is
    vectors = {"observation.state": np.zeros((4, 8), np.float32), "action": np.zeros((4, 8), np.float32)}
    episode = Episode(task="t", vectors=vectors, videos={k: frames for k in VIDEO_FEATURES.values()})
    errors = {}
    for video in ("standard", "lossless"):
        root = write_dataset(tmp_path / video, [episode], fps=15, robot_type="r", video=video)
        assert dataset_video_encoding(root) == video
        key = next(iter(VIDEO_FEATURES.values()))
        back = read_video(root / "videos" / key / "chunk-000" / "file-000.mp4")
        errors[video] = np.abs(back.astype(int) - frames).max()
    assert errors["lossless"] <= 2 < errors["standard"]  # within RGB <-> YUV 4:4:4 rounding
    with pytest.raises(ConfigError, match="video: expected one of"):
        write_dataset(tmp_path / "bad", [episode], fps=15, robot_type="r", video="av1")
    # a merge writes in its parts' encoding
    (tmp_path / "lossless" / "meta" / "layouts.json").write_text(json.dumps([{"episode_index": 0, "seed": 0}]))
    merged = merge_datasets(tmp_path / "merged", [tmp_path / "lossless"])
    assert dataset_video_encoding(merged) == "lossless"
