"""The batched inference loop: determinism, reset rules in mixed batches, KV growth, batching invariance, shapes.

Loop logic runs on the tiny DiT with small deterministic stand-in encoders (tests/support/pipeline.py: fast, and
independent of the encoder implementations); `test_tiny_preset_end_to_end` runs the real tiny DreamZeroModel.
"""
# Longer than ~400 lines on purpose: it covers the dreamzero/pipeline/ package concern by concern.

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dreamzero.config import DiTConfig, PipelineConfig, preset
from dreamzero.errors import ConfigError, InvalidObservation
from dreamzero.model.dit import CausalWanDiT
from dreamzero.pipeline import DreamZeroPipeline, StepPlan
from dreamzero.types import ModelBatch
from tests.support.pipeline import H, make_batch, make_model, make_pipe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return make_model()


def rows(batch: ModelBatch, idx: list[int]) -> ModelBatch:
    """The sub-batch of rows `idx` (same arrays, so the inputs are identical)."""
    pick = lambda v: None if v is None else [v[i] for i in idx]  # noqa: E731
    return ModelBatch(
        images=batch.images[idx], state=batch.state[idx], state_mask=batch.state_mask[idx],
        prompts=pick(batch.prompts), session_ids=pick(batch.session_ids), negative_prompts=pick(batch.negative_prompts),
        reset_mask=pick(batch.reset_mask), expected_steps=pick(batch.expected_steps), seeds=pick(batch.seeds),
    )  # fmt: skip


# -- tests ----------------------------------------------------------------------------------------------------------


def test_shapes_reports_and_timings(model):
    pipe = make_pipe(model, fast=False)
    res = pipe.generate(make_batch(["a", "b"]), return_latents=True)
    assert res.actions.shape == (2, 24, 32) and res.actions.dtype == np.float32
    assert np.isfinite(res.actions).all() and np.abs(res.actions).max() > 0
    assert res.video_latents.shape == (2, 16, 2, 4, 8)
    assert [(s.step, s.restarted, s.restart_reason, s.frame_position) for s in res.sessions] == [
        (1, True, "new_session", 3)
    ] * 2
    assert res.dit_steps == 8  # upstream static mask
    assert {"text", "clip", "vae", "prefill", "denoise", "total"} <= set(res.timings_ms)
    assert pipe.action_horizon == 24 and pipe.max_action_dim == 32
    assert pipe.stats()["live"] == 2 and pipe.stats()["restarts"]["new_session"] == 2


def test_same_seed_same_chunk_different_seed_differs(model):
    batch = make_batch(["a"], seeds=[7])
    first = make_pipe(model).generate(batch).actions
    again = make_pipe(model).generate(batch).actions
    other = make_pipe(model).generate(dataclasses.replace(batch, seeds=[8])).actions
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).max() > 1e-3


def test_explicit_noise_equals_the_seeded_noise(model):
    """`noise=` (parity / replay) and the per-row seed path feed the loop the same way."""
    batch = make_batch(["a", "b"], seeds=[3, 4])
    seeded = make_pipe(model).generate(batch)
    v = torch.stack([torch.randn(16, 2, 4, 8, generator=torch.Generator().manual_seed(s)) for s in (3, 4)])
    a = torch.stack([torch.randn(24, 32, generator=torch.Generator().manual_seed(s)) for s in (3, 4)])
    given = make_pipe(model).generate(batch, noise={"video": v.numpy(), "action": a.numpy()})
    np.testing.assert_array_equal(seeded.actions, given.actions)
    other = make_pipe(model).generate(batch, noise={"video": v.numpy(), "action": a.flip(0).numpy()})
    assert np.abs(other.actions - seeded.actions).max() > 1e-3


def test_batch_equals_each_session_alone(model):
    """Row results do not depend on the batch: same noise per seed, per-row caches, per-row conditioning."""
    pipe = make_pipe(model)
    first = make_batch(["a", "b"], seeds=[1, 2])
    nxt = make_batch(["a", "b"], t=4, seeds=[1, 2])
    pipe.generate(first)
    together = pipe.generate(nxt).actions
    for i in range(2):
        alone = make_pipe(model)
        alone.generate(rows(first, [i]))
        np.testing.assert_allclose(alone.generate(rows(nxt, [i])).actions[0], together[i], atol=1e-5, rtol=0)


def test_rows_at_different_positions_share_forwards(model):
    """A continuing session and a new one in one call equal the same sessions run apart, in one forward per step."""
    pipe = make_pipe(model)
    pipe.generate(make_batch(["old"]))
    mixed = make_batch(["old", "new"], t=4)
    calls = []
    hook = pipe.dit.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    try:
        res = pipe.generate(mixed)
    finally:
        hook.remove()
    assert [s.frame_position for s in res.sessions] == [5, 3]
    # restart prefill of "new" (2 rows), observed prefill of "old" (2 rows), then 3 guided steps over all 4 rows
    assert calls == [2, 2, 4, 4, 4]
    ref = make_pipe(model)
    ref.generate(make_batch(["old"]))
    np.testing.assert_allclose(ref.generate(rows(mixed, [0])).actions[0], res.actions[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(make_pipe(model).generate(rows(mixed, [1])).actions[0], res.actions[1], atol=1e-5)


def test_staggered_sessions_batched_equal_each_alone(model):
    """Sessions one, two and three chunks apart, through a window-full restart, batched every call: every chunk, every
    stored cache and every frame position equal the same session run alone (padding never leaks into a result)."""
    ids = ["s0", "s1", "s2"]
    together, alone = make_pipe(model), {sid: make_pipe(model) for sid in ids}
    for k, sid in enumerate(ids):  # stagger: s0 is three chunks ahead of s2
        for j in range(len(ids) - k):
            b = make_batch([sid], t=1 if j == 0 else 4, seed_offset=10 * k + j, seeds=[k])
            together.generate(b)
            alone[sid].generate(b)
    for step in range(5):
        batch = make_batch(ids, t=4, seed_offset=100 + step, seeds=[0, 1, 2])
        res = together.generate(batch)
        assert len({s.frame_position for s in res.sessions}) > 1  # really mixed positions
        for i, sid in enumerate(ids):
            own = alone[sid].generate(rows(batch, [i]))
            np.testing.assert_allclose(own.actions[0], res.actions[i], atol=1e-5, rtol=0)
            assert own.sessions[0].frame_position == res.sessions[i].frame_position
            assert own.sessions[0].restarted == res.sessions[i].restarted
            mine, theirs = together.store.lookup(sid)[0].kv_cache, alone[sid].store.lookup(sid)[0].kv_cache
            assert [c.shape for c in mine] == [c.shape for c in theirs]
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_each_reset_trigger_restarts_only_its_session(model):
    pipe = make_pipe(model, max_sessions=5)
    ids = ["reset", "prompt", "mismatch", "keep", "keep2"]
    pipe.generate(make_batch(ids))
    batch = make_batch(ids + ["fresh"], t=4)
    batch.prompts = [f"pick up the block {i}" for i in ids + ["fresh"]]
    batch.prompts[1] = "a different task"
    batch.reset_mask = [True, False, False, False, False, False]
    batch.expected_steps = [None, None, 5, 1, None, None]
    res = pipe.generate(batch)
    got = {s.session_id: (s.restarted, s.restart_reason, s.step) for s in res.sessions}
    assert got == {
        "reset": (True, "reset_requested", 1),
        "prompt": (True, "prompt_changed", 1),
        "mismatch": (True, "step_mismatch", 1),
        "keep": (False, None, 2),
        "keep2": (False, None, 2),
        "fresh": (True, "new_session", 1),
    }
    # max_sessions=5 and 6 live rows: the least recently used one was evicted and says so on its next call
    evicted = [sid for sid in ids + ["fresh"] if sid not in pipe.store]
    assert len(evicted) == 1
    res = pipe.generate(make_batch(evicted, t=4))
    assert res.sessions[0].restart_reason == "evicted"


def test_single_frame_after_first_call_restarts(model):
    pipe = make_pipe(model)
    pipe.generate(make_batch(["a"]))
    res = pipe.generate(make_batch(["a"], t=1))
    assert res.sessions[0].restart_reason == "single_frame" and res.sessions[0].frame_position == 3


def test_explicit_reset_and_drop(model):
    pipe = make_pipe(model)
    pipe.generate(make_batch(["a", "b"]))
    pipe.reset_sessions(["a", "unknown"])
    res = pipe.generate(make_batch(["a", "b"], t=4))
    assert [s.restart_reason for s in res.sessions] == ["reset_requested", None]
    assert pipe.drop_sessions(["b"]) == 1
    assert pipe.generate(make_batch(["b"], t=4)).sessions[0].restart_reason == "new_session"


def test_kv_cache_grows_on_prefill_only_and_window_restarts(model):
    pipe = make_pipe(model)
    s = model.config.dit.frame_seqlen
    lengths, positions, reasons = [], [], []
    for call in range(6):
        res = pipe.generate(make_batch(["a"], t=1 if call == 0 else 4))
        state, _ = pipe.store.lookup("a")
        lengths.append(state.kv_len())
        positions.append(res.sessions[0].frame_position)
        reasons.append(res.sessions[0].restart_reason)
        assert len(state.kv_cache) == 2 and state.kv_cache[0].shape[1] == 2  # layers; cond + uncond rows
    # anchor frame, then 2 observed frames per chunk; the denoised block is never cached
    assert lengths == [1 * s, 3 * s, 5 * s, 7 * s, 1 * s, 3 * s]
    assert positions == [3, 5, 7, 9, 3, 5]
    assert reasons == ["new_session", None, None, None, "window_full", None]
    assert max(lengths) <= pipe.dit.kv_window


def test_dit_truncates_the_cache_to_the_window(model):
    dit = model.model
    cfg = dit.cfg
    full = [torch.randn(2, 1, dit.kv_window, cfg.num_heads, cfg.head_dim) for _ in dit.blocks]
    x = torch.randn(1, 16, 2, 4, 8)
    y = torch.randn(1, 20, 2, 4, 8)
    ctx = dit.embed_context(torch.randn(1, 512, cfg.text_dim), torch.randn(1, 257, cfg.image_dim))
    with torch.no_grad():
        out = dit(x, torch.zeros(1, 2, dtype=torch.long), kv_cache=full, current_start_frame=9, context_emb=ctx, y=y)
    assert out.kv_cache[0].shape[2] == dit.kv_window
    # the oldest 2 frames were dropped, the rest shifted: old tokens [2S:] now lead the cache
    torch.testing.assert_close(out.kv_cache[0][:, :, : -2 * cfg.frame_seqlen], full[0][:, :, 2 * cfg.frame_seqlen :])


def test_folded_text_padding_equals_attending_to_all_512(model):
    """embed_context folds the shared zero padding of T5 rows into one weighted key: the same denoise output as the
    full 512-token context, for prompts of different lengths in one batch."""
    from dreamzero.model.dit import CrossContext

    dit = model.model
    cfg = dit.cfg
    text = torch.zeros(2, cfg.text_len, cfg.text_dim)
    text[0, :7], text[1, :30] = torch.randn(7, cfg.text_dim), torch.randn(30, cfg.text_dim)
    clip = torch.randn(2, 257, cfg.image_dim)
    folded = dit.embed_context(text, clip)
    assert folded.emb.shape[1] == 257 + 31 and folded.text_repeats == cfg.text_len - 30
    with torch.no_grad():
        full = CrossContext(torch.cat([dit.img_emb(clip), dit.text_embedding(text)], dim=1))
        cache = [torch.randn(2, 2, 3 * cfg.frame_seqlen, cfg.num_heads, cfg.head_dim) for _ in dit.blocks]
        kw = dict(
            kv_cache=cache, current_start_frame=3, y=torch.randn(2, 20, 2, 4, 8), action=torch.randn(2, 24, 32),
            timestep_action=torch.full((2, 24), 500), state=torch.randn(2, 1, 64),
        )  # fmt: skip
        x, t = torch.randn(2, 16, 2, 4, 8), torch.full((2, 2), 500)
        a, b = dit(x, t, context_emb=folded, **kw), dit(x, t, context_emb=full, **kw)
    torch.testing.assert_close(a.video, b.video, atol=2e-5, rtol=0)
    torch.testing.assert_close(a.action, b.action, atol=2e-5, rtol=0)
    # a prompt that fills every position leaves nothing to fold
    assert dit.embed_context(torch.randn(1, cfg.text_len, cfg.text_dim), clip[:1]).text_repeats == 1
    # bf16 attention keeps all 512 keys: log(count) would not survive bf16 rounding
    dit.attention_dtype = torch.bfloat16
    try:
        kept = dit.embed_context(text, clip)
    finally:
        dit.attention_dtype = None
    assert kept.text_repeats == 1 and kept.emb.shape[1] == 257 + cfg.text_len
    dit.fold_text_padding = False  # the switch the batching benchmark compares against
    try:
        assert dit.embed_context(text, clip).emb.shape[1] == 257 + cfg.text_len
    finally:
        dit.fold_text_padding = True


def test_without_guidance_one_branch(model):
    pipe = make_pipe(model, cfg_scale=1.0)
    res = pipe.generate(make_batch(["a"]))
    state, _ = pipe.store.lookup("a")
    assert state.branches == ("cond",) and state.kv_cache[0].shape[1] == 1 and set(state.text_cache) == {"cond"}
    assert res.actions.shape == (1, 24, 32)


def test_step_plans():
    every = StepPlan(PipelineConfig(dit_step_mask=None))
    assert all(every.should_run(i) for i in range(16))
    dyn = StepPlan(PipelineConfig(dynamic_skip=True))
    v = torch.ones(1, 8)
    ran = []
    for i in range(16):
        if dyn.should_run(i):
            ran.append(i)
            dyn.observe(i, v + 0.01 * i)  # nearly parallel velocities: skip 4 once the 2 warm-up steps ran
    assert ran == [0, 1, 6, 11]
    dyn = StepPlan(PipelineConfig(dynamic_skip=True))
    g = torch.Generator().manual_seed(0)
    ran = [i for i in range(16) if dyn.should_run(i) and dyn.observe(i, torch.randn(1, 8, generator=g)) is None]
    assert ran == list(range(16))  # unrelated velocities: never skip


def test_dynamic_skipping_runs_fewer_steps(model):
    pipe = make_pipe(model, fast=False, dynamic_skip=True, dynamic_skip_thresholds=((-1.0, 3),))
    res = pipe.generate(make_batch(["a"]))
    assert res.dit_steps == 5  # steps 0 1 (skip 3) 5 (skip 3) 9 (skip 3) 13 (skip 2)
    assert np.isfinite(res.actions).all()


def test_bad_input_names_the_field(model):
    pipe = make_pipe(model)
    with pytest.raises(InvalidObservation) as e:
        pipe.generate(make_batch(["a", "a"]))
    assert e.value.field == "session_ids"
    bad = make_batch(["a"])
    bad.images = bad.images.astype(np.float32)
    with pytest.raises(InvalidObservation) as e:
        pipe.generate(bad)
    assert e.value.field == "images"
    bad = make_batch(["a"], t=3)
    with pytest.raises(InvalidObservation, match="1 or 4 frames"):
        pipe.generate(bad)
    bad = make_batch(["a"])
    bad.state = bad.state[:, :, :8]
    with pytest.raises(InvalidObservation) as e:
        pipe.generate(bad)
    assert e.value.field == "state"
    with pytest.raises(InvalidObservation) as e:
        pipe.generate(make_batch(["a"], seeds=[1, 2]))
    assert e.value.field == "seeds"
    with pytest.raises(InvalidObservation) as e:
        pipe.generate(make_batch(["a"], prompts=[None]))
    assert e.value.field == "prompts"
    assert len(pipe.store) == 0  # nothing half-created


def test_bad_config_names_the_field(model):
    with pytest.raises(ConfigError, match="dit_step_mask"):
        make_pipe(model, dit_step_mask=(True,) * 8)
    with pytest.raises(ConfigError, match="unknown pipeline knob .cfg_scal.. Did you mean .cfg_scale."):
        make_pipe(model, cfg_scal=3.0)
    with pytest.raises(ConfigError, match="prompt_cache_size"):
        make_pipe(model, prompt_cache_size=-1)
    for name in ("dynamic_skip", "conditioning_by_chunk"):
        with pytest.raises(ConfigError, match=f"pipeline.{name} must be true or false"):
            make_pipe(model, **{name: "yes"})


@pytest.mark.parametrize("cache_size", [0, 2])
def test_prompts_are_encoded_once_across_sessions(model, cache_size):
    """New sessions reuse the T5 rows of prompts seen before (the negative prompt above all); the cache is an LRU of
    `prompt_cache_size` prompts, and 0 turns it off."""
    encoded: list[str] = []
    real = model.text_encoder.encode
    text = SimpleNamespace(encode=lambda prompts: (encoded.extend(prompts), real(prompts))[1], text_len=512)
    pipe = make_pipe(SimpleNamespace(**{**vars(model), "text_encoder": text}), prompt_cache_size=cache_size)
    first = pipe.generate(make_batch(["a", "b"], prompts=["stack the cups"] * 2))
    pipe.generate(make_batch(["c"], prompts=["stack the cups"]))
    pipe.generate(make_batch(["d"], prompts=["open the drawer"]))
    pipe.generate(make_batch(["e"], prompts=["wipe the table"]))  # the LRU (size 2) drops "stack the cups"
    pipe.generate(make_batch(["f"], prompts=["stack the cups"]))
    negative = pipe.store.lookup("a")[0].negative_prompt
    if cache_size:
        assert encoded == [negative, "stack the cups", "open the drawer", "wipe the table", "stack the cups"]
    else:
        assert encoded.count(negative) == 5 and encoded.count("stack the cups") == 3
    # the cache changes no number
    ref = make_pipe(model, prompt_cache_size=0).generate(make_batch(["a", "b"], prompts=["stack the cups"] * 2))
    np.testing.assert_array_equal(ref.actions, first.actions)


def test_ti2v_variant_uses_clip_but_no_first_frame_latent():
    model = make_model("ti2v")
    pipe = make_pipe(model)
    pipe.generate(make_batch(["a"]))
    res = pipe.generate(make_batch(["a"], t=4), return_latents=True)
    assert res.actions.shape == (1, 16, 32) and res.video_latents.shape == (1, 48, 2, 4, 8)
    state, _ = pipe.store.lookup("a")
    assert state.y is None and state.clip_feature.shape == (1, 257, model.config.dit.image_dim)
    assert state.kv_len() == 3 * 8


def test_wrong_canvas_size_is_reported_and_forgets_the_batch(model):
    pipe = make_pipe(model, model_input_hw=None)
    pipe.generate(make_batch(["a", "b"]))
    batch = make_batch(["a"], t=4)
    batch.images = batch.images[:, :, : H // 2]
    with pytest.raises(InvalidObservation, match="canvas size cannot change"):
        pipe.generate(batch)
    with pytest.raises(InvalidObservation, match="frame_seqlen"):
        pipe.generate(dataclasses.replace(make_batch(["c"]), images=batch.images[:, :1]))
    # "a" may hold a half-advanced cache: it is dropped, never reused; "b" is untouched
    assert "a" not in pipe.store and "b" in pipe.store


def test_tiny_preset_end_to_end():
    """`DreamZeroPipeline.load()` with no checkpoint: the embedded tiny DreamZeroModel (T5, CLIP, VAE, DiT)."""
    pipe = DreamZeroPipeline.load(device="cpu", dtype="float32", max_sessions=4, overrides={"dit_step_mask": None})
    assert pipe.config.dit_step_mask is None and pipe.store.max_sessions == 4
    res = pipe.generate(make_batch(["a"]), return_latents=True)
    assert res.actions.shape == (1, 24, 32) and res.video_latents.shape == (1, 16, 2, 4, 8)
    assert np.isfinite(res.actions).all() and res.dit_steps == 16
    res = pipe.generate(make_batch(["a"], t=4))
    assert res.sessions[0].step == 2 and res.sessions[0].frame_position == 5


def test_droid_shaped_dit_forward():
    """DROID token geometry (44x80 latent -> 880 tokens per frame, head_dim 128 -> RoPE split 44/42/42) at a tiny
    width: a prefill then a denoise pass, checking the output layout and that registers never enter the cache."""
    from dreamzero.model.dit import video_rope_angles

    cfg = DiTConfig(frame_seqlen=880, dim=256, ffn_dim=64, text_dim=16, num_heads=2, num_layers=1, hidden_size=16,
                    image_dim=16)  # fmt: skip
    # time / height / width own 22 / 21 / 21 complex pairs (44 / 42 / 42 channels): moving one axis moves only its own
    grid = video_rope_angles(2, 2, 2, 0, cfg.head_dim, 1e4, torch.device("cpu")).view(2, 2, 2, 64)
    moved = [(grid[1, 0, 0] != grid[0, 0, 0]), (grid[0, 1, 0] != grid[0, 0, 0]), (grid[0, 0, 1] != grid[0, 0, 0])]
    assert [m.nonzero().flatten().tolist() for m in moved] == [
        list(range(0, 22)),
        list(range(22, 43)),
        list(range(43, 64)),
    ]
    torch.manual_seed(0)
    dit = CausalWanDiT(cfg).eval()
    ctx = dit.embed_context(torch.randn(1, 512, 16), torch.randn(1, 257, 16))
    with torch.no_grad():
        pre = dit(torch.randn(1, 16, 1, 44, 80), torch.zeros(1, 1, dtype=torch.long), kv_cache=None,
                  current_start_frame=0, context_emb=ctx, y=torch.randn(1, 20, 1, 44, 80))  # fmt: skip
        assert pre.kv_cache[0].shape == (2, 1, 880, 2, 128) and pre.video.shape == (1, 16, 1, 44, 80)
        out = dit(torch.randn(1, 16, 2, 44, 80), torch.full((1, 2), 999), kv_cache=pre.kv_cache,
                  current_start_frame=1, context_emb=ctx, y=torch.randn(1, 20, 2, 44, 80),
                  action=torch.randn(1, 24, 32), timestep_action=torch.full((1, 24), 999),
                  state=torch.randn(1, 1, 64))  # fmt: skip
    assert out.video.shape == (1, 16, 2, 44, 80) and out.action.shape == (1, 24, 32) and out.kv_cache is None
    assert torch.isfinite(out.video).all() and torch.isfinite(out.action).all()


def test_stale_state_with_a_matching_step_is_caught_by_the_incarnation(model):
    """Stale state whose step count happens to equal the client's (it restarted elsewhere meanwhile) restarts."""
    pipe = make_pipe(model)
    first = pipe.generate(make_batch(["s"])).sessions[0]
    assert first.incarnation and first.step == 1
    cont = make_batch(["s"], t=4)
    cont.expected_steps, cont.expected_incarnations = [1], [first.incarnation]
    same = pipe.generate(cont).sessions[0]
    assert (same.restarted, same.step, same.incarnation) == (False, 2, first.incarnation)
    # the client's step-2 state lived on another replica: same step, other incarnation -> no silent reuse
    stale = make_batch(["s"], t=4)
    stale.expected_steps, stale.expected_incarnations = [2], ["from-another-replica"]
    res = pipe.generate(stale).sessions[0]
    assert (res.restarted, res.restart_reason, res.step) == (True, "step_mismatch", 1)
    assert res.incarnation != first.incarnation


def test_conditioning_encoded_chunk_by_chunk_equals_the_whole_window():
    """The i2v conditioning ([anchor, zero frames] through the causal Wan VAE) is encoded only as far as each chunk
    needs, from the session's encoder state, batched with the other rows; at the end of the window it equals the
    window encoded at once, as upstream does at the restart. The state counts in the session's bytes until then."""
    pipe = DreamZeroPipeline.load(None, device="cpu", max_sessions=4)  # the embedded tiny model: a real Wan VAE
    nfpb, window = pipe.dit_cfg.num_frame_per_block, 1 + (pipe.config.num_frames - 1) // 4
    pipe.generate(make_batch(["w", "v"], t=1))
    state = pipe.store.lookup("w")[0]
    assert state.y.shape[2] == 1 + nfpb and state.vae_state is not None
    extra = sum(t.numel() * t.element_size() for t in state.vae_state if t is not None)
    held, kept = state.nbytes(), state.vae_state
    state.vae_state = None
    assert extra > 0 and held - state.nbytes() == extra
    state.vae_state = kept
    pipe.generate(make_batch(["v"], t=4))  # "v" one chunk ahead: the two then extend in different calls and groups
    for k in range((window - 1 - nfpb) // nfpb):
        pipe.generate(make_batch(["w", "v"][: 2 if k < 1 else 1], t=4, seed_offset=k))
    state = pipe.store.lookup("w")[0]
    assert state.y.shape[2] == window and state.vae_state is None
    video = torch.zeros(1, 3, pipe.config.num_frames, *state.first_frame.shape[-2:])
    video[:, :, 0] = state.first_frame.float()
    torch.testing.assert_close(state.y[:, 4:].float(), pipe.model.vae.encode(video), atol=1e-5, rtol=0)
    assert state.y[0, :4, 0].eq(1).all() and state.y[0, :4, 1:].eq(0).all()


def test_conditioning_by_chunk_off_encodes_the_window_at_the_restart_with_the_same_chunks(model):
    """`conditioning_by_chunk: false` (upstream's way) keeps no encoder state and gives the same chunks."""
    lazy, whole = make_pipe(model), make_pipe(model, conditioning_by_chunk=False)
    for k in range(5):  # through a window-full restart
        batch = make_batch(["a", "b"], t=1 if k == 0 else 4, seed_offset=k)
        got, want = lazy.generate(batch), whole.generate(batch)
        np.testing.assert_allclose(got.actions, want.actions, atol=1e-5, rtol=0)
        state = whole.store.lookup("a")[0]
        assert state.vae_state is None and state.y.shape[2] == 1 + (whole.config.num_frames - 1) // 4


# -- compile levels and warm-up ---------------------------------------------------------------------------------------


def test_warm_up_leaves_sessions_stats_and_prompt_cache_as_they_were(model):
    pipe = make_pipe(model, max_sessions=4)
    pipe.generate(make_batch(["kept"]))
    before = (pipe.stats(), list(pipe._prompt_rows), pipe.store.lookup("kept")[0].step)
    assert pipe.compiled == [] and pipe.warmup_ms is None
    assert pipe.warm_up() > 0 and pipe.warmup_ms > 0
    assert (pipe.stats(), list(pipe._prompt_rows), pipe.store.lookup("kept")[0].step) == before
    assert pipe.generate(make_batch(["kept"], t=4)).sessions[0].restarted is False


def test_compile_levels_choose_what_is_compiled():
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.pipeline import compile_model

    tiny = DreamZeroModel.from_config(preset("tiny"), device="cpu", dtype=torch.float32, seed=0)
    compiled = lambda m: getattr(m, "_compiled_call_impl", None) is not None  # noqa: E731  (compiled lazily, on call)
    assert compile_model(tiny, "none") == [] and not any(compiled(b) for b in tiny.model.blocks)
    assert compile_model(tiny, "dit") == ["dit.blocks"] and all(compiled(b) for b in tiny.model.blocks)
    assert not compiled(tiny.text_encoder.t5) and not compiled(tiny.vae.autoencoder.encoder)
    assert compile_model(tiny, "all") == ["dit.blocks", "text_encoder.t5", "image_encoder.clip", "vae.encoder"]
    assert all(compiled(m) for m in (tiny.text_encoder.t5, tiny.image_encoder.clip, tiny.vae.autoencoder.encoder))
    with pytest.raises(ConfigError, match="pipeline.compile"):
        compile_model(tiny, "max")


@pytest.mark.slow  # inductor builds C++ kernels for 4 graphs: ~80 s of CPU
def test_compiled_dit_matches_eager_and_warm_up_covers_the_steady_state():
    """`compile: dit` gives the eager results (inductor reorders float operations: within 1e-5 in fp32, measured
    ~5e-7); after the warm-up, new and continuing sessions (any batch size) build no graph; a batch mixing frame
    positions may build one more (the masked path), well under dynamo's recompile limit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fast = {"num_inference_steps": 2, "dit_step_mask": None}
    eager = make_pipe(make_model(), fast=False, **fast)
    pipe = make_pipe(make_model(), fast=False, compile="dit", **fast)
    assert pipe.compiled == ["dit.blocks"]
    pipe.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1

    def same(batch):
        got, want = pipe.generate(batch, return_latents=True), eager.generate(batch, return_latents=True)
        np.testing.assert_allclose(got.actions, want.actions, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got.video_latents, want.video_latents, atol=1e-5, rtol=0)
        assert [s.frame_position for s in got.sessions] == [s.frame_position for s in want.sessions]

    same(make_batch(["a", "b"], t=1))  # new sessions
    same(make_batch(["a", "b"], t=4, seed_offset=1))  # continuing: a longer cache, same graphs
    same(make_batch(["d", "e", "f"], t=1, seed_offset=2))  # three new sessions: the batch size is symbolic
    assert counters["stats"]["unique_graphs"] == graphs, "the warm-up did not cover a plain new/continuing chunk"
    same(make_batch(["a", "b", "c"], t=4, seed_offset=3))  # rows at frames 5, 5 and 1: key mask, per-row RoPE
    assert counters["stats"]["unique_graphs"] <= graphs + 2 < torch._dynamo.config.recompile_limit
