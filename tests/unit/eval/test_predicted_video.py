"""`dreamzero-eval --predicted-video`: the imagined-vs-real alignment, and a MuJoCo run through the embedded policy
whose report shows every episode's imagined vs real video and error curve."""

from __future__ import annotations

import json

import numpy as np

from dreamzero.embodiments import get_embodiment
from dreamzero.video_recorder import read_mp4
from dreamzero_droid import droid
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


def test_libero_run_with_predicted_video(tmp_path):
    """`dreamzero-eval-libero --predicted-video`: the request asks for video, each episode's record and report carry
    imagined vs real (a fake client answering grey frames; fake envs)."""
    from eval.libero.runner import run_libero_evaluation
    from eval.report import write_report
    from tests.support.libero import FakeBackend, FakeClient, libero_config

    class VideoClient(FakeClient):
        def generate(self, observation, prompts, session_ids, **kw):
            result = super().generate(observation, prompts, session_ids, **kw)
            assert kw.get("return_video") is True
            result.video = np.full((len(session_ids), 8, 32, 64, 3), 128, np.uint8)
            return result

    config = libero_config(tmp_path, predicted_video=True, max_steps=8, action_chunk=4)
    run_libero_evaluation(FakeBackend(num_init_states=1), VideoClient(), config)
    rec = json.loads((tmp_path / "episodes" / "task01_init000.json").read_text())  # never succeeds: all 8 steps
    assert [c["step"] for c in rec["imagined"]["chunks"]] == [0, 4]
    assert rec["imagined"]["chunks"][0]["frames_compared"] == 4  # steps 1 and 6 of 8 exist, 11 and 16 do not
    assert read_mp4(tmp_path / rec["imagined"]["video"]).shape == (16, 32, 128, 3)
    assert "Imagined vs real" in write_report(tmp_path).read_text()
