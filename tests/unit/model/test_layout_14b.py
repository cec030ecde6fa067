"""The droid_14b preset built on the meta device has the release checkpoint's tensor names and shapes.

Release facts (GEAR-Dreams/DreamZero-DROID): 2146 tensors, ~45.9 GB in bf16, every key under `action_head.` with the
prefixes `model.`, `text_encoder.`, `image_encoder.model.` (visual tower + logit scale), `vae.model.`.
Nothing here allocates parameter memory.
"""

from __future__ import annotations

import collections
import math
import resource

import pytest

from dreamzero.config import preset
from dreamzero.model.dreamzero import DreamZeroModel


@pytest.fixture(scope="module")
def layout():
    peak_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = DreamZeroModel.from_config(preset("droid_14b"), device="meta")
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kb
    assert grown_kb < 1_000_000, f"building on meta raised peak memory by {grown_kb / 1e6:.1f} GB"
    assert all(p.is_meta for p in model.parameters())
    return model, {t.name: t.shape for t in model.release_tensors()}


def test_total_count_and_groups(layout):
    _, shapes = layout
    assert len(shapes) == 2146
    groups = collections.Counter()
    for name in shapes:
        assert name.startswith("action_head.")
        for prefix in ("model.", "text_encoder.", "image_encoder.model.visual.", "image_encoder.model.", "vae.model."):
            if name.startswith("action_head." + prefix):
                groups[prefix] += 1
                break
        else:
            pytest.fail(f"{name} has none of the release prefixes")
    # DiT 1317 = 9 top-level modules (28 tensors) + 40 blocks x 32; T5 242 = 24 x 10 + 2; CLIP 392 visual + log_scale;
    # Wan 2.1 VAE 194
    assert groups == {
        "model.": 1317,
        "text_encoder.": 242,
        "image_encoder.model.visual.": 392,
        "image_encoder.model.": 1,
        "vae.model.": 194,
    }
    # 22.95 B values = the release's 45.9 GB in bf16
    assert sum(math.prod(s) for s in shapes.values()) == pytest.approx(22.95e9, rel=2e-3)


def test_dit_shapes(layout):
    _, s = layout
    dit = "action_head.model."
    assert s[dit + "patch_embedding.weight"] == (5120, 36, 1, 2, 2)
    assert s[dit + "text_embedding.0.weight"] == (5120, 4096)
    assert s[dit + "time_embedding.0.weight"] == (5120, 256)
    assert s[dit + "time_projection.1.weight"] == (6 * 5120, 5120)
    assert s[dit + "blocks.39.self_attn.q.weight"] == (5120, 5120)
    assert s[dit + "blocks.0.self_attn.norm_q.weight"] == (5120,)
    assert s[dit + "blocks.0.cross_attn.k_img.weight"] == (5120, 5120)
    assert s[dit + "blocks.0.cross_attn.norm_k_img.weight"] == (5120,)
    assert s[dit + "blocks.0.ffn.0.weight"] == (13824, 5120)
    assert s[dit + "blocks.0.ffn.2.weight"] == (5120, 13824)
    assert s[dit + "blocks.0.modulation"] == (1, 6, 5120)
    assert s[dit + "head.head.weight"] == (16 * 4, 5120)
    assert s[dit + "head.modulation"] == (1, 2, 5120)
    assert s[dit + "img_emb.proj.1.weight"] == (1280, 1280)
    assert s[dit + "img_emb.proj.3.weight"] == (5120, 1280)
    assert "action_head.model.blocks.40.self_attn.q.weight" not in s
    # DreamZero registers: CategorySpecificLinear W [1, in, out], b [1, out]
    assert s[dit + "state_encoder.layer1.W"] == (1, 64, 1024)
    assert s[dit + "state_encoder.layer2.W"] == (1, 1024, 5120)
    assert s[dit + "action_encoder.W1.W"] == (1, 32, 5120)
    assert s[dit + "action_encoder.W2.W"] == (1, 2 * 5120, 5120)
    assert s[dit + "action_encoder.W3.W"] == (1, 5120, 5120)
    assert s[dit + "action_encoder.W3.b"] == (1, 5120)
    assert s[dit + "action_decoder.layer1.W"] == (1, 5120, 1024)
    assert s[dit + "action_decoder.layer2.W"] == (1, 1024, 32)


def test_encoder_shapes(layout):
    _, s = layout
    t5 = "action_head.text_encoder."
    assert s[t5 + "token_embedding.weight"] == (256384, 4096)
    assert s[t5 + "blocks.23.attn.q.weight"] == (4096, 4096)
    assert s[t5 + "blocks.0.ffn.gate.0.weight"] == (10240, 4096)
    assert s[t5 + "blocks.0.ffn.fc2.weight"] == (4096, 10240)
    assert s[t5 + "blocks.5.pos_embedding.embedding.weight"] == (32, 64)
    assert s[t5 + "norm.weight"] == (4096,)
    clip = "action_head.image_encoder.model.visual."
    assert s[clip + "patch_embedding.weight"] == (1280, 3, 14, 14)
    assert s[clip + "cls_embedding"] == (1, 1, 1280)
    assert s[clip + "pos_embedding"] == (1, 257, 1280)
    assert s[clip + "transformer.31.attn.to_qkv.weight"] == (3 * 1280, 1280)
    assert s[clip + "transformer.31.mlp.0.weight"] == (5120, 1280)
    assert clip + "transformer.32.norm1.weight" not in s
    assert s[clip + "head"] == (1280, 1024)
    assert s["action_head.image_encoder.model.log_scale"] == ()
    vae = "action_head.vae.model."
    assert s[vae + "conv1.weight"] == (32, 32, 1, 1, 1)
    assert s[vae + "encoder.conv1.weight"] == (96, 3, 3, 3, 3)
    assert s[vae + "decoder.head.2.weight"] == (3, 96, 3, 3, 3)
    assert s[vae + "decoder.upsamples.14.residual.6.weight"] == (96, 96, 3, 3, 3)


def test_meta_build_allocates_nothing(layout):
    model, _ = layout
    assert not any(t.device.type != "meta" for t in model.parameters())
    assert model.num_parameters() > 20e9
