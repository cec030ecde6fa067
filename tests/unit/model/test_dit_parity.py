"""Parity of our DiT and inference loop with golden vectors recorded from the upstream DreamZero DiT.

Fixture: tests/fixtures/dit-parity (its README says what the files hold and how they were recorded). Tolerance 1e-4;
upstream's own float64 round-off is ~5e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dreamzero.config import PipelineConfig
from dreamzero.model.dit import CausalWanDiT
from dreamzero.pipeline import branch_rows, cfg_row_layout, denoise_block, prefill_block

TOL = 1e-4


@pytest.fixture(scope="module")
def fixture(parity_fixture):
    d = parity_fixture
    vectors = np.load(d / "vectors.npz")
    return {
        "dir": d,
        "config": json.loads((d / "config.json").read_text()),
        "calls": json.loads((d / "calls.json").read_text()),
        "v": {k: torch.from_numpy(vectors[k]) for k in vectors.files},
    }


def _load_dit(d: Path, config: dict, tmp: Path) -> CausalWanDiT:
    """The fixture's DiT through the checkpoint loader users use (`dreamzero.checkpoint.load_model`).

    The fixture holds DiT tensors only, so we write a release-layout directory whose config.json carries the
    fixture's `diffusion_model_cfg` (tiny encoders beside it) and whose index points every `action_head.model.*`
    key at the fixture's own `weights.safetensors`; the encoder tensors come from a small saved shard.
    """
    from dreamzero.checkpoint import INDEX_FILE, load_model, save_model
    from dreamzero.config import from_checkpoint_config, preset
    from dreamzero.model.dreamzero import DreamZeroModel

    cfg = from_checkpoint_config({"action_head_cfg": {"config": {"diffusion_model_cfg": config}}})
    tiny = preset("tiny")
    cfg.text_encoder, cfg.image_encoder, cfg.vae = tiny.text_encoder, tiny.image_encoder, tiny.vae
    save_model(DreamZeroModel.from_config(cfg, seed=1), tmp, save_tokenizer=False)
    (tmp / "dit.safetensors").symlink_to(d / "weights.safetensors")
    index = json.loads((tmp / INDEX_FILE).read_text())
    for key in list(index["weight_map"]):
        if key.startswith("action_head.model."):
            index["weight_map"][key] = "dit.safetensors"
    (tmp / INDEX_FILE).write_text(json.dumps(index))
    model = load_model(tmp, device="cpu", dtype=torch.float32, require_tokenizer=False)
    return model.model.eval()


@pytest.fixture(scope="module")
def dit(fixture, tmp_path_factory):
    return _load_dit(fixture["dir"], fixture["config"], tmp_path_factory.mktemp("parity-checkpoint"))


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


def _sessions(x: torch.Tensor, n: int) -> torch.Tensor:
    """The fixture's one session [1, ...] duplicated into n session rows [n, ...] (same inputs in every row)."""
    return x.expand(n, *x.shape[1:]).contiguous()


@torch.no_grad()
@pytest.mark.parametrize("sessions", [1, 2])
def test_free_running_two_chunks_through_the_loop(fixture, dit, sessions):
    """Our scheduler + static step mask + CFG (cond and uncond rows of every session in one forward) reproduce both
    chunks; with two sessions (the fixture's session in two rows) each row must match on its own."""
    v, session = fixture["v"], fixture["calls"]["session"]
    cfg = PipelineConfig()
    assert cfg.cfg_scale == session["cfg_scale"] and cfg.num_inference_steps == session["num_inference_steps"]
    assert cfg.sigma_shift == session["sigma_shift"] and list(cfg.dit_step_mask) == session["dit_step_mask"]
    guided = cfg.cfg_scale != 1.0

    # the forward rows as the pipeline lays them out: which session and CFG branch each row holds
    layout = cfg_row_layout(sessions, guided)
    assert sorted(layout) == sorted((s, b) for s in range(sessions) for b in ("cond", "uncond"))
    text = {"cond": v["context_cond"], "uncond": v["context_uncond"]}
    ctx = dit.embed_context(
        torch.cat([text[branch] for _, branch in layout]), torch.cat([v["clip_feature"] for _ in layout])
    )
    rows = lambda x: branch_rows(_sessions(x, sessions), guided)  # noqa: E731  per-session input -> forward rows
    ys = _sessions(v["ys"], sessions)
    caches = prefill_block(
        dit, rows(v["first_frame_latent"]), context_emb=ctx, kv_cache=None, start_frame=0, y=rows(v["ys"][:, :, 0:1])
    )
    heads, head_dim = dit.cfg.num_heads, dit.cfg.head_dim
    frame_tokens = dit.cfg.frame_seqlen
    assert caches.layers[0].shape == (2, len(layout), frame_tokens, heads, head_dim) and caches.lengths is None
    for chunk, csf in ((1, 1), (2, 3)):
        if chunk == 2:
            caches = prefill_block(
                dit, rows(v["chunk2_observed_latents"]), context_emb=ctx, kv_cache=caches, start_frame=1,
                y=rows(v["ys"][:, :, 1:3]),
            )  # fmt: skip
            assert caches.layers[0].shape[:3] == (2, len(layout), 3 * frame_tokens)
        res = denoise_block(
            dit,
            cfg,
            video_noise=_sessions(v[f"chunk{chunk}_noise_obs"], sessions),
            action_noise=_sessions(v[f"chunk{chunk}_noise_action"], sessions),
            state=_sessions(v[f"chunk{chunk}_state"], sessions),
            context_emb=ctx,
            kv_cache=caches,
            start_frame=csf,
            y=ys[:, :, csf : csf + 2],
        )
        assert res.dit_steps == 8
        assert res.action.shape[0] == res.video.shape[0] == sessions
        for row in range(sessions):
            where = f"chunk {chunk}, session row {row} of {sessions}"
            assert _max_diff(res.action[row : row + 1], v[f"chunk{chunk}_action_pred"]) <= TOL, f"{where}: actions"
            assert _max_diff(res.video[row : row + 1], v[f"chunk{chunk}_video_latents_pred"]) <= TOL, f"{where}: video"
