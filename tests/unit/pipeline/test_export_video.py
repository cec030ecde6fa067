"""`dreamzero-export-video`: camera videos through the embedded trained policy -> input, predicted and side-by-side
MP4s (+ GIF) that read back with the documented frame counts; bad arguments exit 2 naming the option."""

from __future__ import annotations

import json

import numpy as np

from dreamzero.export_video import main
from dreamzero.video_recorder import read_mp4, write_mp4

VIEWS = ("video.exterior_image_1_left", "video.exterior_image_2_left", "video.wrist_image_left")


def test_camera_videos_export_input_and_predicted_video(tmp_path):
    rng = np.random.default_rng(0)
    args = []
    for i, key in enumerate(VIEWS):
        frames = np.clip(rng.normal(60 * i + 40, 10, (30, 180, 320, 3)), 0, 255).astype(np.uint8)
        write_mp4(tmp_path / f"{i}.mp4", frames, 15)
        args += ["--video", f"{key}={tmp_path / f'{i}.mp4'}"]
    out = tmp_path / "out"
    assert main([*args, "--prompt", "put the cube in the bowl", "--chunks", "2", "--gif", "--out", str(out)]) == 0
    summary = json.loads((out / "export.json").read_text())
    h, w = summary["frame_hw"]
    assert summary["chunks"] == 2 and summary["frames_per_chunk"] == 8
    assert read_mp4(out / "predicted.mp4").shape == (16, h, w, 3)
    assert read_mp4(out / "side_by_side.mp4").shape == (16, h, 2 * w, 3)
    assert read_mp4(out / "input.mp4").shape == (1 + 4, h, w, 3)  # the first query's frame, then a 4-frame block
    assert (out / "side_by_side.gif").stat().st_size > 0


def test_bad_arguments_name_the_option(tmp_path, capsys):
    assert main(["--video", "video.nope=x.mp4", "--out", str(tmp_path)]) == 2
    assert "--prompt" in capsys.readouterr().err
    assert main(["--video", "video.nope=x.mp4", "--prompt", "p", "--chunks", "0", "--out", str(tmp_path)]) == 2
    assert "--chunks" in capsys.readouterr().err


def test_a_lerobot_episode_exports_with_its_task(tmp_path):
    from tests.support.train_data import TASK, write_synthetic_dataset

    root = write_synthetic_dataset(tmp_path / "ds", n_episodes=2, length=40)
    out = tmp_path / "out"
    assert main(["--dataset", str(root), "--episode", "1", "--out", str(out)]) == 0
    summary = json.loads((out / "export.json").read_text())
    assert summary["prompt"] == TASK and summary["chunks"] == 2  # steps 0 and 24 of 40
    assert read_mp4(out / "predicted.mp4").shape[0] == 16
    assert main(["--dataset", str(root), "--episode", "7", "--out", str(out)]) == 2
