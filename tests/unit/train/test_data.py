"""Training clips and the training schedule: shapes, the served frame layout, and normalisation that serving undoes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("imageio_ffmpeg")

from dreamzero.embodiments import get_embodiment
from dreamzero.embodiments.base import PostprocessContext
from dreamzero.errors import ConfigError
from dreamzero.lerobot_dataset import LeRobotDataset, get_preset
from dreamzero.metadata_cli import compute_metadata
from dreamzero.train.data import ClipSampler, load_episodes, make_clip
from dreamzero.train.schedule import TrainingSchedule
from tests.support.train_data import TASK, write_synthetic_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = write_synthetic_dataset(tmp_path_factory.mktemp("train_data") / "ds", length=60)
    meta = compute_metadata(LeRobotDataset(root), get_preset("oxe_droid"), progress=False)
    embodiment = get_embodiment("oxe_droid", meta)
    return root, embodiment, load_episodes(root, embodiment)


def test_episodes_load_with_video_frames(dataset):
    _, embodiment, episodes = dataset
    assert len(episodes) == 2 and episodes[0].task == TASK
    ep = episodes[0]
    assert len(ep) == 60 and ep.state["state.joint_position"].shape == (60, 7)
    assert set(ep.views) == set(embodiment.video_keys)
    assert ep.views[embodiment.wrist_key].shape == (60, 64, 112, 3)


def test_clip_layout_and_shapes(dataset):
    _, embodiment, episodes = dataset
    clip = make_clip(episodes[0], t0=3, blocks=2, embodiment=embodiment)
    assert clip.anchor.shape == (*embodiment.canvas_hw, 3)
    assert clip.block_frames.shape == (2, 4, *embodiment.canvas_hw, 3)
    assert clip.state.shape == (2, embodiment.max_state_dim) and not clip.state[:, 8:].any()
    assert clip.actions.shape == (2, 24, embodiment.max_action_dim)
    assert np.abs(clip.actions).max() <= 1.0 and not clip.actions[..., 8:].any()
    assert clip.action_mask.sum() == 8
    assert clip.prompt == embodiment.format_prompt(TASK)
    # the last frame of block 0 is the frame at t0 + 24, which is the anchor of a clip starting there
    later = make_clip(episodes[0], t0=27, blocks=1, embodiment=embodiment)
    np.testing.assert_array_equal(clip.block_frames[0, -1], later.anchor)


def test_serving_postprocess_recovers_the_demo_actions(dataset):
    """Normalised actions of a clip -> embodiment.postprocess (what serving runs) -> the recorded joint targets."""
    _, embodiment, episodes = dataset
    ep, t0 = episodes[1], 5
    clip = make_clip(ep, t0=t0, blocks=2, embodiment=embodiment)
    for k in range(2):
        s = t0 + 24 * k
        ctx = PostprocessContext(
            embodiment.tag, {key: v[s : s + 1].astype(np.float64) for key, v in ep.state.items()}, batched=True
        )
        robot = embodiment.postprocess(clip.actions[k][None], ctx)[0]
        want = ep.action["action.joint_position"][s : s + 24]
        inside = np.abs(clip.actions[k, :, :7]) < 1.0  # clipped entries cannot round-trip
        np.testing.assert_allclose(robot[:, :7][inside], want[inside], atol=1e-5)
        np.testing.assert_array_equal(robot[:, 7], ep.action["action.gripper_position"][s : s + 24, 0])


def test_sampler_is_seeded(dataset):
    _, embodiment, episodes = dataset
    a = ClipSampler(episodes, embodiment, blocks=1, seed=3).sample(2)
    b = ClipSampler(episodes, embodiment, blocks=1, seed=3).sample(2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.actions, y.actions)


def test_schedule_tables():
    s = TrainingSchedule()
    assert s.sigmas.shape == (1000,) and float(s.sigmas[0]) == pytest.approx(1.0)
    assert bool((s.sigmas[1:] < s.sigmas[:-1]).all())  # strictly decreasing noise
    assert float(s.weights.mean()) == pytest.approx(1.0, rel=1e-5) and float(s.weights.min()) == 0.0
    # the bell peaks at timestep ~500
    assert abs(float(s.timesteps[int(s.weights.argmax())]) - 500) < 5
    x0, noise = torch.ones(2, 3), torch.zeros(2, 3)
    out = s.add_noise(x0, noise, torch.tensor([0, 999]))
    np.testing.assert_allclose(out[0].numpy(), 0.0, atol=1e-6)  # sigma 1: pure noise
    assert float(out[1, 0]) > 0.99  # the last entry is nearly clean


def test_start_stride_bounds_the_clip_starts(dataset):
    _, embodiment, episodes = dataset
    any_start = ClipSampler(episodes, embodiment, blocks=1, seed=5)
    assert [c.actions.tolist() for c in any_start.sample(3)] == [
        any_start.clip(k).actions.tolist() for k in ClipSampler(episodes, embodiment, blocks=1, seed=5).sample_keys(3)
    ]  # sample() is clip(key) over sample_keys(): the same seeded draws
    strided = ClipSampler(episodes, embodiment, blocks=1, seed=5, start_stride=8)
    keys = strided.sample_keys(200)
    starts = {t0 for _, t0 in keys}
    span = len(episodes[0]) - embodiment.action_horizon  # 36: starts 0, 8, ..., 32
    assert starts == set(range(0, span, 8)), starts
    with pytest.raises(ConfigError, match="start_stride"):
        ClipSampler(episodes, embodiment, blocks=1, start_stride=0)
