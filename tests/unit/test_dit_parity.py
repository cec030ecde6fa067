"""Parity of our DiT and inference loop with golden vectors recorded from the upstream DreamZero DiT.

Fixture: shared/fixtures/dit-parity (README there says exactly how upstream was driven). Tolerance 1e-4; upstream's
own float64 round-off is ~2e-6.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dreamzero.config import DiTConfig, PipelineConfig
from dreamzero.model.dit import CausalWanDiT
from dreamzero.pipeline import denoise_block, prefill_block

TOL = 1e-4


def _fixture_dir() -> Path:
    env = os.environ.get("DREAMZERO_PARITY_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "dit-parity"
    if not (path / "vectors.npz").exists():
        pytest.skip(f"DiT parity fixture not found at {path} (set DREAMZERO_PARITY_DIR)")
    return path


@pytest.fixture(scope="module")
def fixture():
    d = _fixture_dir()
    vectors = np.load(d / "vectors.npz")
    return {
        "dir": d,
        "config": json.loads((d / "config.json").read_text()),
        "calls": json.loads((d / "calls.json").read_text()),
        "v": {k: torch.from_numpy(vectors[k]) for k in vectors.files},
    }


def _load_dit(d: Path, config: dict) -> CausalWanDiT:
    """The fixture's DiT through the checkpoint loader users use."""
    try:
        from dreamzero.checkpoint import load_dit  # engineer B's loader (DiT-only release layout)
    except ImportError:
        load_dit = None
    if load_dit is not None:
        return load_dit(d / "weights.safetensors", config, dtype=torch.float32).eval()
    from safetensors.torch import load_file

    fields = {f for f in DiTConfig.__dataclass_fields__}
    cfg = DiTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in fields})
    dit = CausalWanDiT(cfg)
    prefix = "action_head.model."
    state = {k.removeprefix(prefix): v for k, v in load_file(d / "weights.safetensors").items()}
    dit.load_state_dict(state, strict=True)
    return dit.eval()


@pytest.fixture(scope="module")
def dit(fixture):
    return _load_dit(fixture["dir"], fixture["config"])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def test_teacher_forced_forwards_match_upstream(fixture, dit):
    v, calls = fixture["v"], fixture["calls"]["forwards"]
    assert len(calls) == 36
    caches: dict[str, list[torch.Tensor] | None] = {"cond": None, "uncond": None}
    get = lambda name: None if name is None else v[name]  # noqa: E731
    for call in calls:
        a = call["args"]
        cache = caches[call["branch"]]
        assert (0 if cache is None else cache[0].shape[2]) == call["kv_cache_len_before"]
        out = dit(
            get(a["x"]),
            get(a["timestep"]),
            kv_cache=cache,
            current_start_frame=call["current_start_frame"],
            context=get(a["context"]),
            clip_feature=get(a["clip_feature"]),
            y=get(a["y"]),
            action=get(a["action"]),
            timestep_action=get(a["timestep_action"]),
            state=get(a["state"]),
        )
        where = f"forward {call['index']} ({call['kind']}, {call['branch']})"
        assert _max_diff(out.video, v[call["outputs"]["video_pred"]]) <= TOL, where
        if call["kind"] == "denoise":
            assert out.kv_cache is None, where  # denoise passes never write the cache
            assert _max_diff(out.action, v[call["outputs"]["action_pred"]]) <= TOL, where
        else:
            assert out.action is None
            caches[call["branch"]] = out.kv_cache
            assert out.kv_cache[0].shape[2] == call["kv_cache_len_after"], where
            assert _max_diff(torch.stack(out.kv_cache), v[call["outputs"]["kv_cache_after"]]) <= TOL, where


@torch.no_grad()
def test_debug_intermediates_match(fixture, dit):
    """Localises a regression: the chunk-2 denoise forward's text/image embeddings and register encoders."""
    v = fixture["v"]
    assert _max_diff(dit.text_embedding(v["context_cond"]), v["debug_f20_text_embedding"]) <= TOL
    assert _max_diff(dit.img_emb(v["clip_feature"]), v["debug_f20_img_emb"]) <= TOL
    assert (
        _max_diff(dit.action_encoder(v["f20_action"], v["f20_timestep_action"]), v["debug_f20_action_encoder"]) <= TOL
    )
    assert _max_diff(dit.state_encoder(v["chunk2_state"]), v["debug_f20_state_encoder"]) <= TOL


@torch.no_grad()
def test_free_running_two_chunks_through_the_loop(fixture, dit):
    """Our scheduler + static step mask + CFG (cond and uncond batched in one forward) reproduce both chunks."""
    v, session = fixture["v"], fixture["calls"]["session"]
    cfg = PipelineConfig()
    assert cfg.cfg_scale == session["cfg_scale"] and cfg.num_inference_steps == session["num_inference_steps"]
    assert cfg.sigma_shift == session["sigma_shift"] and list(cfg.dit_step_mask) == session["dit_step_mask"]

    two = lambda x: torch.cat([x, x])  # noqa: E731  (cond rows, then uncond rows)
    ys = v["ys"]
    ctx = dit.embed_context(torch.cat([v["context_cond"], v["context_uncond"]]), two(v["clip_feature"]))
    caches = prefill_block(
        dit, two(v["first_frame_latent"]), context_emb=ctx, kv_cache=None, start_frame=0, y=two(ys[:, :, 0:1])
    )
    assert caches[0].shape == (2, 2, 8, 2, 32)
    for chunk, csf in ((1, 1), (2, 3)):
        if chunk == 2:
            caches = prefill_block(
                dit, two(v["chunk2_observed_latents"]), context_emb=ctx, kv_cache=caches, start_frame=1,
                y=two(ys[:, :, 1:3]),
            )  # fmt: skip
            assert caches[0].shape[2] == 24
        res = denoise_block(
            dit,
            cfg,
            video_noise=v[f"chunk{chunk}_noise_obs"],
            action_noise=v[f"chunk{chunk}_noise_action"],
            state=v[f"chunk{chunk}_state"],
            context_emb=ctx,
            kv_cache=caches,
            start_frame=csf,
            y=ys[:, :, csf : csf + 2],
        )
        assert res.dit_steps == 8
        assert _max_diff(res.action, v[f"chunk{chunk}_action_pred"]) <= TOL, f"chunk {chunk} actions"
        assert _max_diff(res.video, v[f"chunk{chunk}_video_latents_pred"]) <= TOL, f"chunk {chunk} video"
