"""Predicted video: the VAE's streaming decode, the pipeline's per-session decoder state, its bytes in admission."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dreamzero.config import preset
from dreamzero.errors import InvalidObservation
from dreamzero.model.vae import WanVAE
from dreamzero.pipeline import DreamZeroPipeline
from dreamzero.types import ModelBatch

H, W = 32, 64  # the tiny canvas


@pytest.mark.parametrize("kind", ["wan2.1", "wan2.2"])
def test_chunk_by_chunk_decode_is_the_whole_decode(kind):
    """Anchor, then chunks of 2 latent frames, each decoded from the previous chunk's state == one decode of all."""
    cfg = preset("tiny").vae
    if kind == "wan2.2":  # libero's VAE at a few channels
        cfg = dataclasses.replace(preset("libero_5b").vae, base_dim=16, decoder_base_dim=32)
    torch.manual_seed(0)
    vae = WanVAE(cfg).eval()
    s = vae.spatial_factor
    z = torch.randn(2, cfg.z_dim, 5, 32 // s, 64 // s)
    whole = vae.decode(z)
    parts, state = [], None
    for a, b in ((0, 1), (1, 3), (3, 5)):
        out, state = vae.decode_causal(z[:, :, a:b], state)
        parts.append(out)
    assert [p.shape[2] for p in parts] == [1, 8, 8]
    torch.testing.assert_close(torch.cat(parts, 2), whole, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def pipe():
    return DreamZeroPipeline.load(
        device="cpu", dtype="float32", max_sessions=8, overrides={"num_inference_steps": 2, "dit_step_mask": None}
    )


def batch(ids, t, seed, **kw) -> ModelBatch:
    rng = np.random.default_rng(seed)
    n = len(ids)
    return ModelBatch(
        images=rng.integers(0, 256, (n, t, H, W, 3), dtype=np.uint8),
        state=rng.standard_normal((n, 1, 64)).astype(np.float32),
        state_mask=np.ones((n, 1, 64), bool),
        prompts=["pick up the cube"] * n,
        session_ids=list(ids),
        **kw,
    )


def test_session_video_is_the_whole_episode_decode(pipe):
    """Three chunks with return_video: each 8 uint8 frames at the canvas, together the decode of [anchor latent,
    every chunk's predicted latents] (less the anchor frame) to one grey level; the state is kept and counted."""
    frames, latents = [], []
    first = batch(["v"], 1, 0, return_video=[True])
    for k in range(3):
        b = first if k == 0 else batch(["v"], 4, k, return_video=[True])
        res = pipe.generate(b, return_latents=True)
        assert res.video is not None and res.video[0].dtype == np.uint8 and res.video[0].shape == (8, H, W, 3)
        frames.append(res.video[0])
        latents.append(torch.from_numpy(res.video_latents))
        state, _ = pipe.store.lookup("v")
        assert state.video_state is not None and state.nbytes() > 0
    vae = pipe.model.vae
    anchor = torch.from_numpy(first.images[0, 0]).permute(2, 0, 1).float()[None, :, None] / 127.5 - 1.0
    whole = vae.decode(torch.cat([vae.encode(anchor)[:, :, :1], *latents], 2))[:, :, 1:]
    want = ((whole.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)[0].numpy()
    got = np.concatenate(frames)
    assert got.shape == want.shape == (24, H, W, 3)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_without_the_option_nothing_is_decoded(pipe):
    """No return_video: no frames, no decoder state; a row that stops asking drops its state, a mixed batch stacks
    (a new row and a continuing row both give 8 frames) and a row that does not ask gets None."""
    res = pipe.generate(batch(["n"], 1, 5))
    assert res.video is None and "video" not in res.timings_ms
    assert pipe.store.lookup("n")[0].video_state is None
    pipe.generate(batch(["m"], 1, 6, return_video=[True]))
    res = pipe.generate(batch(["m", "n", "new"], 4, 7, return_video=[False, True, True]))
    assert res.video[0] is None and res.video[1].shape == res.video[2].shape == (8, H, W, 3)
    assert pipe.store.lookup("m")[0].video_state is None and pipe.store.lookup("n")[0].video_state is not None
    with pytest.raises(InvalidObservation, match="return_video"):
        pipe.generate(batch(["x", "y"], 1, 8, return_video=[True]))


def test_admission_counts_the_decoder_state(pipe):
    """With a byte budget, a session asking for video reserves its footprint plus the decoder state's bytes, which
    bound what the state really holds."""
    extra = pipe.video_state_bytes((H, W))
    assert extra > 0
    peak = pipe.footprint((H, W)).peak
    store = pipe.store
    old = store.max_bytes
    store.max_bytes = 10**12
    try:
        pipe.admit(batch(["a1", "a2"], 1, 9, return_video=[True, False]))
        assert store._reserved["a1"] == peak + extra and store._reserved["a2"] == peak
        store.release(["a1", "a2"])
        pipe.generate(batch(["held"], 1, 10, return_video=[True]))
        held = pipe.store.lookup("held")[0]
        held_video = sum(t.numel() * t.element_size() for t in held.video_state if isinstance(t, torch.Tensor))
        assert 0 < held_video <= extra
    finally:
        store.max_bytes = old


def test_asking_for_video_leaves_the_actions_alone(pipe):
    """The same inputs and seed with and without return_video: identical actions and session reports."""
    plain = [pipe.generate(batch(["same-a"], t, 20 + t)) for t in (1, 4)]
    asked = [pipe.generate(batch(["same-b"], t, 20 + t, return_video=[True])) for t in (1, 4)]
    for p, a in zip(plain, asked):
        np.testing.assert_array_equal(p.actions, a.actions)
        assert (p.sessions[0].step, p.sessions[0].frame_position) == (a.sessions[0].step, a.sessions[0].frame_position)
