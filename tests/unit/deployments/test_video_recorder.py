"""`video.save_dir`: MP4 segments per session (restart, end, every N chunks), read back; the disk cap; the replica."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.config.sections import VideoArgs
from deployments.config.settings import PolicySettings
from deployments.policy import PolicyDeployment
from dreamzero.types import ModelBatch
from dreamzero.video_recorder import VideoRecorder, read_mp4

H, W = 32, 64


def chunk(level: int, t: int = 8) -> np.ndarray:
    """Flat grey frames (H.264 keeps them to a few grey levels), brighter frame by frame."""
    return np.stack([np.full((H, W, 3), (level + 3 * i) % 256, np.uint8) for i in range(t)])


def segments(root) -> list:
    return sorted(root.rglob("*.mp4"), key=lambda p: p.name)


def test_segments_on_every_n_chunks_restart_and_end_read_back(tmp_path):
    rec = VideoRecorder(tmp_path, every_n_chunks=2)
    obs = np.zeros((4, H, W, 3), np.uint8)
    for k in range(3):
        rec.add("robot/1", "inc-a", chunk(40 * k), obs)  # chunks 1-2: a segment; chunk 3 waits
    rec.add("robot/1", "inc-b", chunk(200), obs)  # restarted: the chunk-3 segment is written first
    rec.end(["robot/1"])
    rec.wait()
    files = segments(tmp_path)
    assert [p.parent.name for p in files] == ["robot_1"] * 3  # the id is one safe path component
    assert [p.name for p in files] == ["robot_1-inc-a-000.mp4", "robot_1-inc-a-001.mp4", "robot_1-inc-b-000.mp4"]
    first, second, third = (read_mp4(p) for p in files)
    assert first.shape == (16, H, W, 3) and second.shape == third.shape == (8, H, W, 3)
    want = np.concatenate([chunk(0), chunk(40)])
    assert np.abs(first.astype(int) - want.astype(int)).mean() < 3  # lossy, but the frames are the ones sent
    assert abs(int(third[0].mean()) - 200) < 4


def test_with_input_puts_the_real_frames_that_followed_beside(tmp_path):
    rec = VideoRecorder(tmp_path, every_n_chunks=10, with_input=True)
    real = np.full((4, 2 * H, 2 * W, 3), 250, np.uint8)  # the next call's canvas, at the size the client sent
    rec.add("s", "i", chunk(10), np.zeros((1, 2 * H, 2 * W, 3), np.uint8))
    rec.add("s", "i", chunk(60), real)
    rec.close()
    (path,) = segments(tmp_path)
    video = read_mp4(path)
    assert video.shape == (16, H, 2 * W, 3)
    assert abs(int(video[:8, :, W:].mean()) - 250) < 4  # chunk 1's prediction beside what followed it
    assert int(video[8:, :, W:].max()) < 8  # nothing followed the last chunk: black
    assert abs(int(video[0, :, :W].mean()) - 10) < 4


def test_the_disk_cap_deletes_the_oldest_first(tmp_path):
    rng = np.random.default_rng(0)
    noise = lambda: rng.integers(0, 256, (8, H, W, 3), dtype=np.uint8)  # noqa: E731 - incompressible frames
    probe = VideoRecorder(tmp_path / "probe", every_n_chunks=1)
    probe.add("p", "i", noise(), np.zeros((1, H, W, 3), np.uint8))
    probe.close()
    size = segments(tmp_path / "probe")[0].stat().st_size
    rec = VideoRecorder(tmp_path / "capped", every_n_chunks=1, max_bytes=int(2.5 * size))
    for k in range(6):
        rec.add(f"s{k}", "i", noise(), np.zeros((1, H, W, 3), np.uint8))
        rec.wait()
    left = segments(tmp_path / "capped")
    assert sum(p.stat().st_size for p in left) <= 2.5 * size * 1.2 and len(left) <= 3
    assert "s5" in {p.parent.name for p in left} and "s0" not in {p.parent.name for p in left}


@pytest.fixture(scope="module")
def recording_policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("recorded")
    settings = PolicySettings(
        pipeline={"num_inference_steps": 2, "dit_step_mask": None},
        video=VideoArgs(save_dir=str(root), every_n_chunks=2),
    )
    return PolicyDeployment(settings), root


def model_batch(ids, t, seed, **kw) -> ModelBatch:
    rng = np.random.default_rng(seed)
    n = len(ids)
    return ModelBatch(
        images=rng.integers(0, 256, (n, t, H, W, 3), dtype=np.uint8),
        state=np.zeros((n, 1, 64), np.float32),
        state_mask=np.ones((n, 1, 64), bool),
        prompts=["pick"] * n,
        session_ids=list(ids),
        **kw,
    )


def test_the_replica_records_every_session_and_answers_only_who_asked(recording_policy):
    policy, root = recording_policy
    for k in range(2):
        out = asyncio.run(policy.generate(model_batch(["r0", "r1"], 1 if k == 0 else 4, k)))
        assert out.result.video is None  # recorded, but nobody asked: the reply is as before
    out = asyncio.run(policy.generate(model_batch(["r0"], 4, 3, return_video=[True])))
    assert out.result.video[0].shape == (8, H, W, 3)
    asyncio.run(policy.drop_sessions(["r0", "r1"]))
    policy.recorder.wait()
    names = sorted(p.parent.name for p in root.rglob("*.mp4"))
    assert names == ["r0", "r0", "r1"]  # r0: chunks 1-2, then chunk 3 at its end; r1: chunks 1-2
    assert all(read_mp4(p).shape[1:] == (H, W, 3) for p in root.rglob("*.mp4"))
