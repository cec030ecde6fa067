"""Configuration of a DreamZero model: the DiT shape, the encoders, the inference-loop knobs, and named presets.

Field names of `DiTConfig` follow the upstream `CausalWanModel` constructor (so a release `config.json`'s
`action_head_cfg.config.diffusion_model_cfg` maps onto it 1:1); fields we added are marked "(ours)".
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from dreamzero.errors import ConfigError


@dataclass
class DiTConfig:
    """Shape of the causal Wan DiT with action/state registers."""

    model_type: str = "i2v"  # "i2v" (14B: first-frame `y` conditioning + CLIP) or "ti2v" (5B: neither)
    patch_size: tuple[int, int, int] = (1, 2, 2)
    frame_seqlen: int = 880  # video tokens per latent frame (44x80 latent / 2x2 patches for DROID 14B)
    text_len: int = 512
    in_dim: int = 36  # 16 noisy latent + 20 `y` channels (14B); 48 for 5B
    dim: int = 5120
    ffn_dim: int = 13824
    freq_dim: int = 256
    text_dim: int = 4096  # T5 d_model
    out_dim: int = 16
    num_heads: int = 40
    num_layers: int = 40
    max_chunk_size: int = 4
    sink_size: int = 0
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    num_frame_per_block: int = 2
    action_dim: int = 32
    max_state_dim: int = 64
    max_num_embodiments: int = 1
    hidden_size: int = 1024  # hidden width of the state encoder / action decoder MLPs
    num_action_per_block: int = 24
    num_state_per_block: int = 1
    concat_first_frame_latent: bool = True
    image_dim: int = 1280  # (ours) CLIP feature width fed to img_emb; upstream hard-codes 1280
    rope_theta: float = 10000.0  # (ours)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def has_image_input(self) -> bool:
        return self.model_type == "i2v"

    @property
    def max_attention_frames(self) -> int:
        """Latent frames the KV cache may hold: (max_chunk_size * num_frame_per_block + 1) = 9 on DROID."""
        return self.max_chunk_size * self.num_frame_per_block + 1


@dataclass
class TextEncoderConfig:
    """UMT5 encoder (maps onto transformers.UMT5Config)."""

    vocab_size: int = 256384
    d_model: int = 4096
    d_ff: int = 10240
    num_heads: int = 64
    d_kv: int = 64
    num_layers: int = 24
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    tokenizer_path: str | None = None  # local directory of the tokenizer (google/umt5-xxl for real checkpoints)


@dataclass
class ImageEncoderConfig:
    """open-clip ViT-H/14 vision tower (maps onto transformers.CLIPVisionConfig); we use block 31 of 32."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    image_size: int = 224
    patch_size: int = 14


@dataclass
class VAEConfig:
    """Wan VAE (maps onto diffusers.AutoencoderKLWan)."""

    kind: str = "wan2.1"  # "wan2.1" (z=16, 8x spatial) or "wan2.2" (z=48, 16x spatial)
    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)


@dataclass
class PipelineConfig:
    """Inference-loop knobs (all overridable per deployment)."""

    num_inference_steps: int = 16
    sigma_shift: float = 5.0
    cfg_scale: float = 5.0
    # upstream default: run the DiT on 8 of 16 steps and reuse the last prediction on the others
    dit_step_mask: tuple[bool, ...] | None = (
        True, True, True, False, False, False, True, False, False, False, True, False, False, True, True, True,
    )  # fmt: skip
    dynamic_skip: bool = False  # cosine-similarity skipping (replaces the static mask when True)
    dynamic_skip_warmup: int = 2
    dynamic_skip_thresholds: tuple[tuple[float, int], ...] = ((0.95, 4), (0.93, 2))  # (cos sim >, steps to skip)
    default_seed: int = 1140
    num_frames: int = 33  # frames of the conditioning window (8 * max_chunk_size + 1)
    model_input_hw: tuple[int, int] | None = None  # in-model bilinear resize of the canvas (5B: 160x320); None = as sent


@dataclass
class DreamZeroConfig:
    """Everything needed to build a DreamZero model; `preset(name)` or `from_checkpoint_config(dict)` make one."""

    name: str = "custom"
    dit: DiTConfig = field(default_factory=DiTConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    image_encoder: ImageEncoderConfig | None = field(default_factory=ImageEncoderConfig)  # None for 5B
    vae: VAEConfig = field(default_factory=VAEConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    action_horizon: int = 24
    embodiment_tag: str = "oxe_droid"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _droid_14b() -> DreamZeroConfig:
    return DreamZeroConfig(name="droid_14b")


def _libero_5b() -> DreamZeroConfig:
    return DreamZeroConfig(
        name="libero_5b",
        dit=DiTConfig(
            model_type="ti2v", frame_seqlen=50, in_dim=48, dim=3072, ffn_dim=14336, out_dim=48, num_heads=24,
            num_layers=30, concat_first_frame_latent=False, num_action_per_block=16,
        ),
        image_encoder=None,
        vae=VAEConfig(kind="wan2.2", base_dim=160, z_dim=48, dim_mult=(1, 2, 4, 4)),
        pipeline=PipelineConfig(model_input_hw=(160, 320)),
        action_horizon=16,
        embodiment_tag="libero_sim",
    )


def _tiny() -> DreamZeroConfig:
    # Same architecture, tiny widths; the canvas is resized in-model to 64x128 so a chunk runs fast on a CPU.
    return DreamZeroConfig(
        name="tiny",
        dit=DiTConfig(
            frame_seqlen=32, dim=64, ffn_dim=128, text_dim=32, num_heads=2, num_layers=2, hidden_size=32,
            image_dim=32,
        ),
        text_encoder=TextEncoderConfig(vocab_size=384, d_model=32, d_ff=64, num_heads=2, d_kv=16, num_layers=2),
        image_encoder=ImageEncoderConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
        ),
        vae=VAEConfig(base_dim=8, z_dim=16, num_res_blocks=1),
        pipeline=PipelineConfig(model_input_hw=(64, 128)),
    )


PRESETS = {"droid_14b": _droid_14b, "libero_5b": _libero_5b, "tiny": _tiny}


def preset(name: str) -> DreamZeroConfig:
    """A named preset; an unknown name fails with the known ones and the closest match."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}.{hint}")
    return PRESETS[name]()
