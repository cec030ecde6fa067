"""The shape of a DreamZero model: the DiT, the text and image encoders, the VAE, and `DreamZeroConfig` holding them.

Field names of `DiTConfig` follow the upstream `CausalWanModel` constructor (so a release `config.json`'s
`action_head_cfg.config.diffusion_model_cfg` maps onto it 1:1); fields we added are marked "(ours)".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dreamzero.config.pipeline import PipelineConfig


@dataclass
class DiTConfig:
    """Shape of the causal Wan DiT with action/state registers."""

    # "i2v" (14B: first-frame `y` latent + CLIP), "ti2v" (5B: CLIP only, no `y`) or "t2v" (neither); upstream builds
    # the image branch (`img_emb`, `k_img` / `v_img` / `norm_k_img`) for i2v and ti2v
    model_type: str = "i2v"
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
        return self.model_type in ("i2v", "ti2v")

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
    projection_dim: int = 1024  # width of the (unused) contrastive head kept in the checkpoint


@dataclass
class VAEConfig:
    """Wan VAE (maps onto diffusers.AutoencoderKLWan)."""

    kind: str = "wan2.1"  # "wan2.1" (z=16, 8x spatial) or "wan2.2" (z=48, 16x spatial)
    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    decoder_base_dim: int | None = None  # Wan 2.2 decodes from a wider base (256); None = base_dim


@dataclass
class DreamZeroConfig:
    """Everything needed to build a DreamZero model; `preset(name)` or `from_checkpoint_config(dict)` make one."""

    name: str = "custom"
    dit: DiTConfig = field(default_factory=DiTConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    image_encoder: ImageEncoderConfig | None = field(default_factory=ImageEncoderConfig)  # None only without CLIP (t2v)
    vae: VAEConfig = field(default_factory=VAEConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    action_horizon: int = 24
    embodiment_tag: str = "oxe_droid"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["pipeline"] = self.pipeline.model_dump()
        return out
