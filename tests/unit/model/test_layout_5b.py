"""The libero_5b preset built on the meta device has the release's tensor names and shapes (RLinf
DreamZero-WAN2.2-5B-LIBERO): a ti2v DiT that keeps Wan's i2v image branch, the same CLIP tower as 14B, the Wan 2.2
VAE. Nothing here allocates parameter memory.

How the expected counts were derived: upstream's classes (dreamzero0/dreamzero, groot/vla/model/dreamzero/modules)
instantiated on the meta device with the 5B kwargs and their state_dict keys counted:
- `CausalWanModel(model_type="ti2v", dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48,
  ...)`: 997 = 37 top-level tensors + 30 blocks x 32. Top level: patch_embedding 2, text_embedding 4,
  time_embedding 4, time_projection 2, head 3 (head.head w/b + modulation), img_emb 8 (proj.0/1/3/4 w/b: ti2v builds
  `img_emb = MLPProj(1280, dim)` like i2v), state_encoder 4, action_encoder 6, action_decoder 4. A block: self_attn
  q/k/v/o w/b + norm_q/norm_k = 10; cross_attn (i2v_cross_attn for every model_type but t2v) 10 + k_img/v_img w/b
  + norm_k_img = 15; norm3 w/b 2; ffn.0/ffn.2 w/b 4; modulation 1.
- `WanTextEncoder()`: 242 = 24 blocks x 10 + token_embedding + norm (as 14B).
- `WanImageEncoder().model` visual tower + log_scale: 393 (as 14B; the textual tower is not in the release).
- `WanVideoVAE38()` (z_dim 48, dim 160, dec_dim 256): 196.
Total 1828 tensors, 12,624,368,637 values; every name and shape matched our release_tensors() one for one.
"""

from __future__ import annotations

import collections
import math

import pytest

from dreamzero.config import ImageEncoderConfig, preset
from dreamzero.model.dreamzero import DreamZeroModel


@pytest.fixture(scope="module")
def layout():
    model = DreamZeroModel.from_config(preset("libero_5b"), device="meta")
    assert all(p.is_meta for p in model.parameters())
    return model, {t.name: t.shape for t in model.release_tensors()}


def test_counts_per_component(layout):
    _, shapes = layout
    groups = collections.Counter(name.split(".")[1] for name in shapes)
    assert all(name.startswith("action_head.") for name in shapes)
    assert groups == {"model": 997, "text_encoder": 242, "image_encoder": 393, "vae": 196}
    values = collections.Counter()
    for name, shape in shapes.items():
        values[name.split(".")[1]] += math.prod(shape)
    assert values == {"model": 5_606_692_832, "image_encoder": 632_076_801, "text_encoder": 5_680_910_336,
                      "vae": 704_688_668}  # fmt: skip


def test_dit_keeps_the_image_branch(layout):
    model, s = layout
    cfg = model.config
    assert cfg.dit.model_type == "ti2v" and cfg.dit.has_image_input and not cfg.dit.concat_first_frame_latent
    dit = "action_head.model."
    assert s[dit + "patch_embedding.weight"] == (3072, 48, 1, 2, 2)  # in_dim 48: noisy latent only, no y
    assert s[dit + "head.head.weight"] == (48 * 4, 3072)
    assert s[dit + "text_embedding.0.weight"] == (3072, 4096)
    assert s[dit + "time_embedding.0.weight"] == (3072, 256)
    assert s[dit + "blocks.29.self_attn.q.weight"] == (3072, 3072)
    assert "action_head.model.blocks.30.self_attn.q.weight" not in s
    assert s[dit + "blocks.0.ffn.0.weight"] == (14336, 3072)
    for block in (0, 29):
        assert s[dit + f"blocks.{block}.cross_attn.k_img.weight"] == (3072, 3072)
        assert s[dit + f"blocks.{block}.cross_attn.v_img.bias"] == (3072,)
        assert s[dit + f"blocks.{block}.cross_attn.norm_k_img.weight"] == (3072,)
    assert s[dit + "img_emb.proj.0.weight"] == (1280,)
    assert s[dit + "img_emb.proj.1.weight"] == (1280, 1280)
    assert s[dit + "img_emb.proj.3.weight"] == (3072, 1280)
    assert s[dit + "img_emb.proj.4.weight"] == (3072,)
    assert s[dit + "state_encoder.layer1.W"] == (1, 64, 1024)
    assert s[dit + "action_encoder.W1.W"] == (1, 32, 3072)
    assert s[dit + "action_decoder.layer2.W"] == (1, 1024, 32)
    assert cfg.dit.frame_seqlen == 50 and cfg.dit.num_frame_per_block == 2 and cfg.dit.max_chunk_size == 4
    assert cfg.dit.num_action_per_block == cfg.action_horizon == 16 and cfg.dit.num_heads == 24


def test_clip_and_vae(layout):
    model, s = layout
    assert model.config.image_encoder == ImageEncoderConfig() == preset("droid_14b").image_encoder
    clip = "action_head.image_encoder.model."
    assert s[clip + "visual.transformer.31.attn.to_qkv.weight"] == (3 * 1280, 1280)
    assert s[clip + "visual.pos_embedding"] == (1, 257, 1280)
    assert s[clip + "log_scale"] == ()
    vae = "action_head.vae.model."
    assert s[vae + "encoder.conv1.weight"] == (160, 12, 3, 3, 3)  # 2x2 patchified RGB
    assert s[vae + "decoder.conv1.weight"] == (1024, 48, 3, 3, 3)  # decoder base 256 x 4, z 48
    assert vae + "decoder.upsamples.0.upsamples.3.resample.1.weight" in s


def test_diffusers_component_names_map_one_to_one(layout):
    """The -Diffusers export's components hold the same tensors under HF / diffusers names: DiT 997 (no prefix),
    UMT5EncoderModel 242 (embed_tokens tied to shared), CLIPVisionModel 519 = 3 embeddings + pre/post LayerNorm 4 +
    32 layers x 16 (the release's 392 visual tensors minus the contrastive head, with each fused qkv weight / bias
    split in three: + 32 x 4; no logit scale), AutoencoderKLWan 196."""
    from dreamzero.checkpoint.diffusers import diffusers_spec

    model, release = layout
    spec = diffusers_spec(model)
    groups = collections.Counter(t.name.split("/")[0] for t in spec.expected)
    assert groups == {"transformer": 997, "text_encoder": 242, "image_encoder": 519, "vae": 196}
    assert sum(math.prod(t.shape) for t in spec.expected) == sum(math.prod(s) for s in release.values()) - (
        1280 * 1024 + 1  # CLIP's contrastive head and logit scale are not in this layout
    )
    assert set(spec.fills) == {"image_encoder.head", "image_encoder.log_scale"}
    assert sorted(spec.optional)[:2] == [
        "image_encoder/encoder.layers.31.layer_norm1.bias",
        "image_encoder/encoder.layers.31.layer_norm1.weight",
    ]
    assert len(spec.optional) == 16 + 2  # the unused last block and post_layernorm
