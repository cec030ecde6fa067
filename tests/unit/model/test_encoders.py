"""Encoders on tiny configs: key remaps both ways, T5 padding rows, CLIP block-31 output, VAE normalisation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dreamzero.config import ImageEncoderConfig, VAEConfig, preset
from dreamzero.model.dreamzero import DreamZeroModel, init_random_weights
from dreamzero.model.image_encoder import CLIP_MEAN, CLIP_STD, CLIPImageEncoder, hf_to_openclip, openclip_to_hf
from dreamzero.model.text_encoder import T5TextEncoder, hf_to_wan, wan_to_hf
from dreamzero.model.tokenizer import build_local_tokenizer, clean_prompt
from dreamzero.model.vae import WAN21_LATENT_MEAN, WAN21_LATENT_STD, WanVAE, diffusers_to_wan


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    model = DreamZeroModel.from_config(cfg, device="cpu", dtype=torch.float32, seed=0)
    model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
    return model


# -- text --------------------------------------------------------------------------------------------------------------


def test_t5_names_round_trip_and_match_the_documented_remap(tiny):
    names = [n for n, _ in tiny.text_encoder.t5.named_parameters()]
    for n in names:
        assert wan_to_hf(hf_to_wan(n)) == n
    assert hf_to_wan("shared.weight") == "token_embedding.weight"
    assert hf_to_wan("encoder.block.3.layer.0.SelfAttention.k.weight") == "blocks.3.attn.k.weight"
    assert hf_to_wan("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight") == (
        "blocks.0.pos_embedding.embedding.weight"
    )
    assert hf_to_wan("encoder.block.1.layer.1.DenseReluDense.wi_0.weight") == "blocks.1.ffn.gate.0.weight"
    assert hf_to_wan("encoder.block.1.layer.1.DenseReluDense.wi_1.weight") == "blocks.1.ffn.fc1.weight"
    assert hf_to_wan("encoder.block.1.layer.1.DenseReluDense.wo.weight") == "blocks.1.ffn.fc2.weight"
    assert hf_to_wan("encoder.final_layer_norm.weight") == "norm.weight"
    with pytest.raises(KeyError):
        wan_to_hf("blocks.0.attn.qkv.weight")


def test_t5_rows_past_the_prompt_are_zero_and_padding_does_not_leak(tiny):
    enc = tiny.text_encoder
    prompts = ["pick up the red cup", "open   the drawer and put the marker inside it"]
    out = enc.encode(prompts)
    assert out.shape == (2, 512, 32)
    _, mask = enc.tokenize(prompts)
    lengths = mask.sum(1)
    for i, n in enumerate(lengths.tolist()):
        assert n > 2
        assert torch.all(out[i, n:] == 0)
        assert torch.all(out[i, :n].abs().sum(-1) > 0)
    # the same prompt alone or next to a longer one gives the same rows (the mask hides padding)
    alone = enc.encode(prompts[:1])
    torch.testing.assert_close(alone[0], out[0], rtol=1e-5, atol=1e-6)


def test_t5_tokenizer_cleans_whitespace_and_appends_eos(tiny):
    assert clean_prompt("  pick &amp; place \n the   cup ") == "pick & place the cup"
    ids, mask = tiny.text_encoder.tokenize(["pick up", "pick    up"])
    assert torch.equal(ids[0], ids[1])
    n = int(mask[0].sum())
    assert ids[0, n - 1] == 1 and ids[0, n:].eq(0).all()  # </s> then <pad>


def test_local_tokenizer_has_exactly_the_requested_vocabulary():
    tok = build_local_tokenizer(384)
    assert len(tok) == 384
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert max(tok("Any TEXT, even \u00fcnicode & digits 0123!")["input_ids"]) < 384
    with pytest.raises(ValueError, match="vocab_size"):
        build_local_tokenizer(50)


# -- image -------------------------------------------------------------------------------------------------------------


def test_clip_names_round_trip_with_the_fused_qkv(tiny):
    enc = tiny.image_encoder
    for n, _ in enc.clip.named_parameters():
        oc, part = hf_to_openclip(n)
        hf = openclip_to_hf(oc)
        assert hf[part or 0] == n
        assert len(hf) == (3 if part is not None else 1)
    assert hf_to_openclip("encoder.layers.1.self_attn.v_proj.bias") == ("transformer.1.attn.to_qkv.bias", 2)
    assert hf_to_openclip("vision_model.encoder.layers.0.mlp.fc2.weight") == ("transformer.0.mlp.2.weight", None)
    names = {t.name: t for t in enc.release_tensors()}
    qkv = names["visual.transformer.0.attn.to_qkv.weight"]
    assert qkv.sources == tuple(f"clip.encoder.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    assert qkv.shape == (96, 32)
    assert names["visual.cls_embedding"].shape == (1, 1, 32)
    assert names["visual.pos_embedding"].shape == (1, 257, 32)
    assert names["log_scale"].shape == () and names["visual.head"].shape == (32, 16)


def test_clip_encode_is_block_31_without_post_norm(tiny):
    enc = tiny.image_encoder
    x = torch.rand(2, 3, 40, 72, generator=torch.Generator().manual_seed(0)) * 2 - 1
    out = enc.encode(x)
    assert out.shape == (2, 257, 32)
    # independent reference: the same tower with its last block removed, before the post-LayerNorm
    pixels = torch.nn.functional.interpolate(x, size=(224, 224), mode="bicubic", align_corners=False)
    pixels = (pixels * 0.5 + 0.5 - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    layers = enc.clip.encoder.layers
    try:
        enc.clip.encoder.layers = layers[:-1]
        ref = enc.clip(pixel_values=pixels).last_hidden_state
    finally:
        enc.clip.encoder.layers = layers
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, enc.clip(pixel_values=pixels).last_hidden_state, atol=1e-3)


def test_clip_layernorm_runs_in_float32_under_bf16():
    cfg = ImageEncoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    enc = CLIPImageEncoder(cfg)
    init_random_weights(enc, 0)
    ln = enc.clip.pre_layrnorm
    x = torch.randn(2, 5, 32) * 30 + 100
    ref = torch.nn.functional.layer_norm(x, (32,), ln.weight, ln.bias, ln.eps)
    enc = enc.to(torch.bfloat16)
    out = ln(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=2e-2)


# -- VAE ---------------------------------------------------------------------------------------------------------------


def test_wan21_vae_remap_matches_the_original_layout():
    cfg = VAEConfig()
    with torch.device("meta"):
        vae = WanVAE(cfg)
    names = {n: diffusers_to_wan(n, cfg) for n, _ in vae.autoencoder.named_parameters()}
    assert len(set(names.values())) == len(names) == 194
    assert names["quant_conv.weight"] == "conv1.weight" and names["post_quant_conv.bias"] == "conv2.bias"
    assert names["encoder.conv_in.weight"] == "encoder.conv1.weight"
    assert names["encoder.norm_out.gamma"] == "encoder.head.0.gamma"
    assert names["decoder.conv_out.weight"] == "decoder.head.2.weight"
    assert names["encoder.mid_block.attentions.0.to_qkv.weight"] == "encoder.middle.1.to_qkv.weight"
    assert names["decoder.mid_block.resnets.1.norm2.gamma"] == "decoder.middle.2.residual.3.gamma"
    assert names["encoder.down_blocks.3.conv_shortcut.weight"] == "encoder.downsamples.3.shortcut.weight"
    assert names["encoder.down_blocks.5.time_conv.weight"] == "encoder.downsamples.5.time_conv.weight"
    assert names["encoder.down_blocks.0.conv2.bias"] == "encoder.downsamples.0.residual.6.bias"
    # decoder: flat list of 4 stages x (3 resnets + 1 resample), the last stage without resample: 0..14
    assert names["decoder.up_blocks.0.upsamplers.0.resample.1.weight"] == "decoder.upsamples.3.resample.1.weight"
    assert names["decoder.up_blocks.1.resnets.0.conv_shortcut.weight"] == "decoder.upsamples.4.shortcut.weight"
    assert names["decoder.up_blocks.2.upsamplers.0.resample.1.bias"] == "decoder.upsamples.11.resample.1.bias"
    assert names["decoder.up_blocks.3.resnets.2.norm1.gamma"] == "decoder.upsamples.14.residual.0.gamma"


def test_wan22_vae_remap_uses_the_nested_blocks():
    cfg = preset("libero_5b").vae
    with torch.device("meta"):
        vae = WanVAE(cfg)
    names = {n: diffusers_to_wan(n, cfg) for n, _ in vae.autoencoder.named_parameters()}
    assert len(set(names.values())) == len(names)
    assert names["encoder.down_blocks.1.resnets.0.conv_shortcut.weight"] == (
        "encoder.downsamples.1.downsamples.0.shortcut.weight"
    )
    assert names["encoder.down_blocks.1.downsampler.time_conv.weight"] == (
        "encoder.downsamples.1.downsamples.2.time_conv.weight"
    )
    assert (
        names["decoder.up_blocks.0.upsampler.resample.1.weight"] == "decoder.upsamples.0.upsamples.3.resample.1.weight"
    )
    assert names["decoder.up_blocks.3.resnets.2.conv2.weight"] == "decoder.upsamples.3.upsamples.2.residual.6.weight"
    assert vae.autoencoder.encoder.conv_in.weight.shape[1] == 12  # 2x2 patchified RGB
    assert vae.spatial_factor == 16 and vae.temporal_factor == 4


def test_vae_encode_normalises_the_posterior_mode_and_decode_inverts(tiny):
    vae = tiny.vae
    video = torch.rand(1, 3, 5, 32, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    z = vae.encode(video)
    assert z.shape == (1, 16, 2, 4, 8)  # 1 + (5-1)/4 frames, 8x smaller
    mu = vae.autoencoder.encode(video).latent_dist.mode()
    mean = torch.tensor(WAN21_LATENT_MEAN).view(1, 16, 1, 1, 1)
    std = torch.tensor(WAN21_LATENT_STD).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(z, (mu - mean) / std, rtol=1e-5, atol=1e-5)
    decoded = vae.decode(z)
    assert decoded.shape == video.shape
    torch.testing.assert_close(decoded, vae.autoencoder.decode(mu).sample, rtol=1e-4, atol=1e-4)


def test_vae_fast_norms_and_layout_give_the_stock_numbers(tiny):
    """Every diffusers norm is swapped for the sum-of-squares one; encode and decode match the stock diffusers module
    (F.normalize, contiguous input) to float rounding, in fp32 and in bf16."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    from dreamzero.model.vae import use_fast_norms

    vae = tiny.vae
    norms = [m for m in vae.modules() if isinstance(m, WanRMS_norm)]
    assert norms and all(type(m) is not WanRMS_norm for m in norms)
    stock = WanVAE(vae.cfg)
    stock.load_state_dict(vae.state_dict())
    for m in stock.modules():  # back to diffusers' own forward
        if isinstance(m, WanRMS_norm):
            m.__class__ = WanRMS_norm
    video = torch.rand(2, 3, 9, 32, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        want = stock.autoencoder.encode(video).latent_dist.mode()
        mean, inv_std = vae._stats(want)
        torch.testing.assert_close(vae.encode(video), (want - mean) * inv_std, rtol=1e-5, atol=1e-5)
        z = vae.encode(video)
        torch.testing.assert_close(vae.decode(z), stock.decode(z), rtol=1e-4, atol=1e-4)
        x = torch.randn(2, 8, 3, 4, 4).bfloat16()
        norm = WanRMS_norm(8, images=False)
        fast = WanRMS_norm(8, images=False)
        assert use_fast_norms(fast) == 1
        torch.testing.assert_close(fast(x), norm(x), rtol=0.02, atol=0.02)  # bf16 output, fp32 statistics both


def test_vae_rejects_statistics_of_the_wrong_width():
    with pytest.raises(ValueError, match="z_dim"):
        WanVAE(dataclasses.replace(VAEConfig(), z_dim=8))
    with pytest.raises(ValueError, match="kind"):
        WanVAE(dataclasses.replace(VAEConfig(), kind="wan3"))


def test_text_encoder_without_tokenizer_says_how_to_get_one():
    enc = T5TextEncoder(preset("tiny").text_encoder)
    with pytest.raises(RuntimeError, match="tokenizer"):
        enc.encode(["hi"])


# -- independent references written from the original (Wan / open-clip) module structure --------------------------


def _release_state(module) -> dict[str, torch.Tensor]:
    """The module's tensors under their release names, as save_model writes them."""
    from dreamzero.checkpoint import _release_value

    params = dict(module.named_parameters())
    return {rt.name: _release_value(rt, params) for rt in module.release_tensors()}


def _t5_bucket(rel: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    # bidirectional T5 bucketing of (key position - query position)
    half = num_buckets // 2
    bucket = (rel > 0).long() * half
    rel = rel.abs()
    exact = half // 2
    large = exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(max_distance / exact) * (half - exact))
    large = torch.minimum(large.long(), torch.full_like(rel, half - 1))
    return bucket + torch.where(rel < exact, rel, large)


def _wan_t5_reference(w: dict[str, torch.Tensor], ids, mask, cfg) -> torch.Tensor:
    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    b, n = ids.shape
    h, d = cfg.num_heads, cfg.d_kv
    x = w["token_embedding.weight"][ids]
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    buckets = _t5_bucket(rel, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance)
    neg = torch.finfo(x.dtype).min
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        y = rms(x, w[p + "norm1.weight"])
        q, k, v = (torch.nn.functional.linear(y, w[p + f"attn.{c}.weight"]).view(b, n, h, d) for c in "qkv")
        bias = w[p + "pos_embedding.embedding.weight"][buckets].permute(2, 0, 1)[None]  # [1, h, n, n]
        bias = bias.masked_fill(mask[:, None, None, :] == 0, neg)
        att = (torch.einsum("binc,bjnc->bnij", q, k) + bias).softmax(-1)  # T5: no 1/sqrt(d) scaling
        o = torch.einsum("bnij,bjnc->binc", att, v).reshape(b, n, h * d)
        x = x + torch.nn.functional.linear(o, w[p + "attn.o.weight"])
        y = rms(x, w[p + "norm2.weight"])
        gate = torch.nn.functional.gelu(torch.nn.functional.linear(y, w[p + "ffn.gate.0.weight"]), approximate="tanh")
        y = torch.nn.functional.linear(y, w[p + "ffn.fc1.weight"]) * gate
        x = x + torch.nn.functional.linear(y, w[p + "ffn.fc2.weight"])
    return rms(x, w["norm.weight"])


def test_t5_matches_a_reference_built_from_the_wan_tensors(tiny):
    enc = tiny.text_encoder
    prompts = ["pick up the red cup and place it in the bowl", "close the drawer"]
    ids, mask = enc.tokenize(prompts)
    ref = _wan_t5_reference(_release_state(enc), ids, mask, enc.cfg) * mask[..., None]
    torch.testing.assert_close(enc.encode(prompts), ref, rtol=1e-4, atol=1e-5)


def _openclip_reference(w: dict[str, torch.Tensor], pixels: torch.Tensor, cfg) -> torch.Tensor:
    F = torch.nn.functional
    width, heads = cfg.hidden_size, cfg.num_attention_heads
    x = F.conv2d(pixels, w["visual.patch_embedding.weight"], stride=cfg.patch_size).flatten(2).transpose(1, 2)
    x = torch.cat([w["visual.cls_embedding"].expand(x.shape[0], -1, -1), x], dim=1) + w["visual.pos_embedding"]
    x = F.layer_norm(x, (width,), w["visual.pre_norm.weight"], w["visual.pre_norm.bias"], 1e-5)
    for i in range(cfg.num_hidden_layers - 1):  # DreamZero stops after block 31 of 32
        p = f"visual.transformer.{i}."
        y = F.layer_norm(x, (width,), w[p + "norm1.weight"], w[p + "norm1.bias"], 1e-5)
        q, k, v = F.linear(y, w[p + "attn.to_qkv.weight"], w[p + "attn.to_qkv.bias"]).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + F.linear(o, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        y = F.layer_norm(x, (width,), w[p + "norm2.weight"], w[p + "norm2.bias"], 1e-5)
        y = F.gelu(F.linear(y, w[p + "mlp.0.weight"], w[p + "mlp.0.bias"]))
        x = x + F.linear(y, w[p + "mlp.2.weight"], w[p + "mlp.2.bias"])
    return x


def test_clip_matches_a_reference_built_from_the_openclip_tensors(tiny):
    enc = tiny.image_encoder
    image = torch.rand(2, 3, 48, 96, generator=torch.Generator().manual_seed(5)) * 2 - 1
    ref = _openclip_reference(_release_state(enc), enc.preprocess(image), enc.cfg)
    torch.testing.assert_close(enc.encode(image), ref, rtol=1e-4, atol=1e-4)
