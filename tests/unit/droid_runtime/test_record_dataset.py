"""Robots that record: `DatasetRecorder` writes LeRobot v3.0 episodes off the loop's thread, keeps and marks failed and
aborted ones, leaves a valid dataset when killed mid-episode, appends; `dreamzero-eval --record-dataset` writes a
dataset that `dreamzero-make-metadata` and `dreamzero-train` read as it is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("imageio_ffmpeg")
pytest.importorskip("pyarrow")

from dreamzero.lerobot_dataset import LeRobotDataset
from dreamzero_client.errors import ConfigError
from dreamzero_droid.lerobot import DatasetRecorder, episode_marks

CAM = "observation.images.front"


def _step(rec: DatasetRecorder, i: int) -> None:
    frame = np.full((16, 24, 3), (i * 7) % 255, np.uint8)
    rec.add_frame({CAM: frame}, {"observation.state": np.arange(3) + i, "action": [i, -i]})


def test_episodes_marked_kept_and_appended(tmp_path):
    root = tmp_path / "ds"
    with DatasetRecorder(root, fps=10, robot_type="test") as rec:
        rec.begin_episode("reach")
        for i in range(5):
            _step(rec, i)
        rec.end_episode(success=True)
        rec.begin_episode("grasp")
        for i in range(3):
            _step(rec, i)
        rec.end_episode(success=False, note="dropped it")
        rec.begin_episode("reach")
        rec.end_episode(success=None)  # no frames: not written, no gap in the indices
        rec.begin_episode("grasp")
        _step(rec, 0)
        _step(rec, 1)
    # close() ended the open episode as aborted; the loop thread only queued
    assert rec.frames_queued == 10 and rec.write_seconds > 0 and rec.write_cpu_seconds > 0
    marks = episode_marks(root)
    assert [(m["episode_index"], m["length"], m["success"], m["outcome"]) for m in marks] == [
        (0, 5, True, "success"),
        (1, 3, False, "failure"),
        (2, 2, None, "aborted"),
    ]
    assert marks[1]["note"] == "dropped it"
    ds = LeRobotDataset(root)
    assert ds.episode_indices == [0, 1, 2] and ds.info["total_frames"] == 10
    cols = ds.episode_columns(1, ["observation.state", "action"])
    np.testing.assert_allclose(cols["action"][:, 0], [0, 1, 2])

    with DatasetRecorder(root, fps=10, robot_type="test") as rec:  # a later session appends
        rec.begin_episode("reach")
        for i in range(4):
            _step(rec, i)
        rec.end_episode(success=True)
    assert LeRobotDataset(root).episode_indices == [0, 1, 2, 3]
    with DatasetRecorder(root, fps=10) as rec:
        rec.begin_episode("x")
        with pytest.raises(ConfigError, match=r"images\['observation.images.front'\].*even"):
            rec.add_frame({CAM: np.zeros((15, 24, 3), np.uint8)}, {"observation.state": [0, 0, 0], "action": [0, 0]})
        with pytest.raises(ConfigError, match="no episode is open"):
            rec.end_episode(success=True)
            rec.add_frame({CAM: np.zeros((16, 24, 3), np.uint8)}, {})
    assert LeRobotDataset(root).episode_indices == [0, 1, 2, 3]  # the episode without frames left nothing


def test_a_client_killed_mid_episode_leaves_a_valid_dataset(tmp_path):
    root = tmp_path / "ds"
    script = textwrap.dedent(f"""
        import os, numpy as np
        from dreamzero_droid.lerobot import DatasetRecorder
        rec = DatasetRecorder({str(root)!r}, fps=10)
        for e in range(2):
            rec.begin_episode("reach")
            for i in range(6):
                rec.add_frame({{{CAM!r}: np.zeros((16, 24, 3), np.uint8)}}, {{"observation.state": [i, 0, 0]}})
            if e == 0:
                rec.end_episode(success=True)
                rec.flush()
        rec.flush()  # the second episode's frames are on disk, its end never comes
        os._exit(9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    ds = LeRobotDataset(root)
    assert ds.episode_indices == [0] and len(ds.episode_columns(0, ["observation.state"])["observation.state"]) == 6
    with DatasetRecorder(root, fps=10) as rec:  # the next session writes over the unfinished episode's files
        rec.begin_episode("reach")
        rec.add_frame({CAM: np.zeros((16, 24, 3), np.uint8)}, {"observation.state": [1, 2, 3]})
        rec.end_episode(success=False)
    assert LeRobotDataset(root).episode_indices == [0, 1]


def test_eval_records_a_dataset_that_make_metadata_and_train_read(tmp_path, capsys):
    import torch

    from dreamzero.metadata_cli import main as make_metadata
    from dreamzero.train.cli import main as train
    from eval.cli import main as evaluate

    torch.set_num_threads(1)
    ds = tmp_path / "recorded"
    argv = ["--policy", "embedded", "--scenes", "1", "--episodes", "2", "--max-steps", "20", "--render", "fast",
            "--image-size", "90", "160", "--out", str(tmp_path / "eval"), "--no-progress", "--no-video", "--no-report",
            "--record-dataset", str(ds)]  # fmt: skip
    assert evaluate(argv) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["recorded_dataset"]["episodes"] == 2 and summary["recorded_dataset"]["frames"] == 40
    marks = episode_marks(ds)
    assert [m["length"] for m in marks] == [20, 20]
    assert [m["success"] for m in marks] == [ep["success"] for ep in summary["episode_records"]]
    info = json.loads((ds / "meta" / "info.json").read_text())
    assert info["features"]["observation.images.wrist_image_left"]["shape"] == [180, 320, 3]  # as the policy saw it
    assert info["features"]["observation.state"]["shape"] == [8] == info["features"]["action"]["shape"]

    meta = tmp_path / "metadata.json"
    assert make_metadata(["generate", str(ds), "--preset", "oxe_droid", "-o", str(meta), "--no-progress"]) == 0
    assert "oxe_droid" in json.loads(meta.read_text())
    capsys.readouterr()
    argv = ["--dataset", str(ds), "--metadata", str(meta), "--out", str(tmp_path / "run"), "--steps", "1",
            "--batch-size", "1", "--blocks", "1"]  # fmt: skip
    assert train(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
