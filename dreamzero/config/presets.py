"""Named model configs (`preset(name)`): the released shapes, the CPU-sized ones and the one-layer slices."""

from __future__ import annotations

import dataclasses
import difflib

from dreamzero.config.networks import DiTConfig, DreamZeroConfig, ImageEncoderConfig, TextEncoderConfig, VAEConfig
from dreamzero.config.pipeline import PipelineConfig
from dreamzero.errors import ConfigError


def _droid_14b() -> DreamZeroConfig:
    return DreamZeroConfig(name="droid_14b")


def _libero_5b() -> DreamZeroConfig:
    return DreamZeroConfig(
        name="libero_5b",
        dit=DiTConfig(
            model_type="ti2v",
            frame_seqlen=50,
            in_dim=48,
            dim=3072,
            ffn_dim=14336,
            out_dim=48,
            num_heads=24,
            num_layers=30,
            concat_first_frame_latent=False,  # the anchor frame enters through CLIP only
            num_action_per_block=16,
        ),
        image_encoder=ImageEncoderConfig(),  # the same ViT-H/14 (block-31 output) as 14B, run on the anchor frame
        vae=VAEConfig(kind="wan2.2", base_dim=160, z_dim=48, dim_mult=(1, 2, 4, 4), decoder_base_dim=256),
        pipeline=PipelineConfig(model_input_hw=(160, 320)),
        action_horizon=16,
        embodiment_tag="libero_sim",
    )


def _tiny() -> DreamZeroConfig:
    # Same architecture, tiny widths; the canvas is resized in-model to 32x64 (latent 4x8, 8 tokens per latent frame:
    # the upstream parity fixture's geometry), so a chunk runs fast on a CPU and, as on a GPU, per-call overhead rather
    # than per-row compute dominates: batching sessions pays off.
    return DreamZeroConfig(
        name="tiny",
        dit=DiTConfig(
            frame_seqlen=8,
            dim=64,
            ffn_dim=128,
            text_dim=32,
            num_heads=2,
            num_layers=2,
            hidden_size=32,
            image_dim=32,
        ),
        text_encoder=TextEncoderConfig(vocab_size=384, d_model=32, d_ff=64, num_heads=2, d_kv=16, num_layers=2),
        image_encoder=ImageEncoderConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=16
        ),
        vae=VAEConfig(base_dim=8, z_dim=16, num_res_blocks=1),
        pipeline=PipelineConfig(model_input_hw=(32, 64)),
    )


def _small() -> DreamZeroConfig:
    # The tiny encoders (frozen, random: they only have to carry the pixels through) with a 64x128 canvas (each
    # exterior view 32x64 px, so the 5 cm cube spans a few pixels; latent 8x16, 32 tokens per latent frame) and a
    # DiT 2x wider and 3x deeper than tiny's: the preset of the embedded trained default, sized to train on a CPU.
    # No classifier-free guidance: its training never drops the prompt, so it has no unconditional branch to guide by.
    tiny = _tiny()
    return dataclasses.replace(
        tiny,
        name="small",
        dit=dataclasses.replace(tiny.dit, frame_seqlen=32, dim=128, ffn_dim=512, num_heads=4, num_layers=6),
        pipeline=PipelineConfig(model_input_hw=(64, 128), cfg_scale=1.0),
    )


#: vocabulary of the slice presets' T5: the locally built tokenizer's pieces. The real 256384 x 4096 embedding alone
#: would be 2.1 GB in bf16, and a lookup table's row width (4096) is all a slice needs to keep.
SLICE_VOCAB = 384


def _slice(real: DreamZeroConfig, name: str) -> DreamZeroConfig:
    # A real preset cut to its fewest layers: every width, head count, FFN size, token count (frame_seqlen, frames
    # per block, actions, state), encoder width and the whole VAE stay the real ones, so each layer holds the real
    # checkpoint's tensor shapes and runs on the real canvas. Kept: 1 DiT block, 1 T5 block and 2 CLIP blocks (the
    # DiT reads CLIP's penultimate hidden state: with one block none would run). The VAE has no layer count to cut
    # and stays whole (Wan 2.1: 127 M values; Wan 2.2: 705 M). Only the T5 vocabulary shrinks (SLICE_VOCAB).
    assert real.image_encoder is not None
    return dataclasses.replace(
        real,
        name=name,
        dit=dataclasses.replace(real.dit, num_layers=1),
        text_encoder=dataclasses.replace(real.text_encoder, num_layers=1, vocab_size=SLICE_VOCAB),
        image_encoder=dataclasses.replace(real.image_encoder, num_hidden_layers=2),
    )


def _droid_14b_slice() -> DreamZeroConfig:
    return _slice(_droid_14b(), "droid_14b_slice")


def _libero_5b_slice() -> DreamZeroConfig:
    return _slice(_libero_5b(), "libero_5b_slice")


PRESETS = {
    "droid_14b": _droid_14b,
    "libero_5b": _libero_5b,
    "tiny": _tiny,
    "small": _small,
    "droid_14b_slice": _droid_14b_slice,  # CPU rehearsals of the real shapes (docs/model.md, "Slice presets")
    "libero_5b_slice": _libero_5b_slice,
}


def preset(name: str) -> DreamZeroConfig:
    """A named preset; an unknown name fails with the known ones and the closest match."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}.{hint}")
    return PRESETS[name]()
