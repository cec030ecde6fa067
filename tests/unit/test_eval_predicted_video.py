"""`dreamzero-eval --predicted-video`: the imagined-vs-real alignment, and a MuJoCo run through the embedded policy
whose report shows every episode's imagined vs real video and error curve."""

from __future__ import annotations

import json

import numpy as np

from dreamzero.embodiments import get_embodiment
from dreamzero.video_recorder import read_mp4
from dreamzero_client import droid
from eval.cli import main
from eval.imagined import BLOCK_STEPS, ImaginedTrack, psnr


def grey_obs(level: int) -> dict:
    img = np.full((180, 320, 3), level, np.uint8)
    return {**{cam: img for cam in droid.CAMERAS}, "joint_position": np.zeros(7), "gripper_position": np.zeros(1)}


def test_each_predicted_frame_meets_the_real_frame_of_its_time():
    """Grey level = step: a prediction of the right greys scores far better than the same frames one block late;
    frames past the episode's end are not compared."""
    track = ImaginedTrack(get_embodiment("oxe_droid"))
    want = [BLOCK_STEPS + off for off in droid.FRAME_OFFSETS]  # the steps chunk 0's frames show: 1, 8, 16, 24
    hw = (32, 64)
    right = np.stack([np.full((*hw, 3), 5 * s, np.uint8) for s in want for _ in range(2)])
    late = np.stack([np.full((*hw, 3), 5 * (s + 8), np.uint8) for s in want for _ in range(2)])
    track.predicted(0, right)
    track.predicted(8, late)  # chunk 1 covers steps 9..32; the episode ends at step 28
    for step in range(29):
        track.observed(step, grey_obs(5 * step))
    real = track._real(track.chunks[0])
    # the canvas holds black padding around the views: the views' grey is the brightest pixel
    assert [int(real[2 * i].max()) for i in range(4)] == [5 * s for s in want]
    assert all(np.array_equal(real[2 * i], real[2 * i + 1]) for i in range(4))
    assert [r is None for r in track._real(track.chunks[1])] == [False] * 6 + [True] * 2  # step 32 is past the end
    assert psnr(right, right) == float("inf")


def test_mujoco_run_reports_imagined_vs_real(tmp_path, monkeypatch):
    monkeypatch.setenv("MUJOCO_GL", "egl")
    out = tmp_path / "run"
    argv = ["--sim", "mujoco", "--scenes", "1", "--max-steps", "24", "--render", "fast", "--policy", "embedded",
            "--predicted-video", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (record,) = [json.loads(p.read_text()) for p in (out / "episodes").glob("*.json")]
    imagined = record["imagined"]
    assert [c["step"] for c in imagined["chunks"]] == [0, 8, 16]
    assert imagined["chunks"][0]["frames_compared"] == 8 and imagined["chunks"][2]["frames_compared"] == 4
    assert all(c["psnr_db"] > 0 and 0 <= c["mae"] <= 255 for c in imagined["chunks"])
    h, w = imagined["frame_hw"]
    video = read_mp4(out / imagined["video"])
    assert video.shape == (3 * 8, h, 2 * w, 3)
    page = (out / "report.html").read_text()
    assert (
        "Imagined vs real" in page
        and imagined["video"] in page
        and (out / "plots" / "imagined_scene1_ep000.png").is_file()
    )
