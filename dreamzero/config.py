"""Configuration of a DreamZero model: the DiT shape, the encoders, the inference-loop knobs, and named presets.

Field names of `DiTConfig` follow the upstream `CausalWanModel` constructor (so a release `config.json`'s
`action_head_cfg.config.diffusion_model_cfg` maps onto it 1:1); fields we added are marked "(ours)".
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field

from dreamzero.errors import ConfigError


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
    model_input_hw: tuple[int, int] | None = None  # in-model bilinear resize of the input (5B: 160x320); None: as sent
    prompt_cache_size: int = 32  # T5 rows of recent prompts shared by all sessions (ours; 0 = encode per session)
    # i2v conditioning encoded chunk by chunk from a per-session VAE state (ours; ~0.6 GB per 14B DROID session until
    # its window is full); False: the whole window at the restart, as upstream, no state
    conditioning_by_chunk: bool = True


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
        return dataclasses.asdict(self)


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


def validate_pipeline_config(cfg: PipelineConfig) -> None:
    """Fail early, naming the field, on knobs the loop cannot honour."""
    for name in ("dynamic_skip", "conditioning_by_chunk"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"pipeline.{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.num_inference_steps < 1:
        raise ConfigError(f"pipeline.num_inference_steps must be >= 1, got {cfg.num_inference_steps}")
    if cfg.dit_step_mask is not None:
        mask = tuple(bool(m) for m in cfg.dit_step_mask)
        if len(mask) != cfg.num_inference_steps:
            raise ConfigError(
                f"pipeline.dit_step_mask has {len(mask)} entries but num_inference_steps is {cfg.num_inference_steps}; "
                "give one bool per step or null for every step"
            )
        if not mask[0]:
            raise ConfigError("pipeline.dit_step_mask[0] must be true: the first step has no prediction to reuse")
    if cfg.dynamic_skip_warmup < 1:
        raise ConfigError(f"pipeline.dynamic_skip_warmup must be >= 1, got {cfg.dynamic_skip_warmup}")
    for thr, n in cfg.dynamic_skip_thresholds:
        if not (-1.0 <= thr <= 1.0) or n < 0:
            raise ConfigError(f"pipeline.dynamic_skip_thresholds entry ({thr}, {n}) needs -1 <= sim <= 1, steps >= 0")
    if cfg.prompt_cache_size < 0:
        raise ConfigError(f"pipeline.prompt_cache_size must be >= 0, got {cfg.prompt_cache_size}")
    if cfg.model_input_hw is not None and (len(cfg.model_input_hw) != 2 or min(cfg.model_input_hw) < 1):
        raise ConfigError(f"pipeline.model_input_hw must be (height, width) or null, got {cfg.model_input_hw}")


def apply_overrides(config: PipelineConfig, overrides: dict | None) -> PipelineConfig:
    """PipelineConfig with fields replaced by name; unknown names fail with the known ones."""
    if not overrides:
        return config
    known = {f.name for f in dataclasses.fields(PipelineConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown pipeline override(s) {unknown}; known: {sorted(known)}")
    out = dataclasses.replace(config, **overrides)
    validate_pipeline_config(out)
    return out


PRESETS = {"droid_14b": _droid_14b, "libero_5b": _libero_5b, "tiny": _tiny}


def preset(name: str) -> DreamZeroConfig:
    """A named preset; an unknown name fails with the known ones and the closest match."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}.{hint}")
    return PRESETS[name]()


# -- release config.json <-> DreamZeroConfig ------------------------------------------------------------------------

_HEAD = "action_head_cfg.config"


def _coerce(value, tp, where: str):
    """Convert a JSON value to the dataclass field type `tp`, or fail naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} entries, got {len(value)}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }
    if tp in ok:
        if not ok[tp]:
            raise ConfigError(f"{where} must be {tp.__name__}, got {value!r}")
        return tp(value)
    raise ConfigError(f"{where}: unsupported field type {tp}")


def _overlay(base, source: dict | None, where: str):
    """A copy of dataclass `base` with every key of `source` that names one of its fields (unknown keys ignored:
    upstream configs also carry `_target_`, pretrained paths and training-only knobs)."""
    if source is None:
        return base
    if not isinstance(source, dict):
        raise ConfigError(f"{where} must be an object, got {type(source).__name__}")
    hints = typing.get_type_hints(type(base))
    changes = {
        f.name: _coerce(source[f.name], hints[f.name], f"{where}.{f.name}")
        for f in dataclasses.fields(base)
        if f.name in source
    }
    return dataclasses.replace(base, **changes)


def _guess_vae_kind(vae_cfg: dict | None, dit: DiTConfig) -> str:
    if isinstance(vae_cfg, dict) and isinstance(vae_cfg.get("kind"), str):
        return vae_cfg["kind"]
    text = " ".join(str(v) for v in (vae_cfg or {}).values()).lower()
    if "2.2" in text or "2_2" in text or dit.out_dim == 48:
        return "wan2.2"
    return "wan2.1"


def from_checkpoint_config(data: dict) -> DreamZeroConfig:
    """Build a DreamZeroConfig from a release `config.json` (already parsed).

    Reads `action_head_cfg.config.diffusion_model_cfg` (the DiT constructor kwargs), the head-level
    `num_frames` / `num_frame_per_block` / `max_state_dim` / `max_action_dim`, `action_horizon`, and the encoder
    sub-configs when they name our fields; anything absent comes from the matching preset (`droid_14b` for i2v,
    `libero_5b` for ti2v). A `dreamzero` block (written by `save_model`) restores name, embodiment and pipeline knobs.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config.json must hold an object, got {type(data).__name__}")
    head = (data.get("action_head_cfg") or {}).get("config") if isinstance(data.get("action_head_cfg"), dict) else None
    if not isinstance(head, dict):
        raise ConfigError(f"config.json has no {_HEAD} object; is this a DreamZero checkpoint?")
    dmc = head.get("diffusion_model_cfg")
    if not isinstance(dmc, dict):
        raise ConfigError(f"config.json has no {_HEAD}.diffusion_model_cfg object")
    model_type = dmc.get("model_type", "i2v")
    if model_type not in ("i2v", "ti2v"):
        raise ConfigError(f"{_HEAD}.diffusion_model_cfg.model_type must be 'i2v' or 'ti2v', got {model_type!r}")
    base = preset("libero_5b" if model_type == "ti2v" else "droid_14b")

    dit = _overlay(base.dit, dmc, f"{_HEAD}.diffusion_model_cfg")
    head_fields = {"num_frame_per_block": "num_frame_per_block", "max_state_dim": "max_state_dim"}
    head_fields["max_action_dim"] = "action_dim"
    for key, name in head_fields.items():
        if key in head:
            dit = dataclasses.replace(dit, **{name: _coerce(head[key], int, f"{_HEAD}.{key}")})

    text = _overlay(base.text_encoder, head.get("text_encoder_cfg"), f"{_HEAD}.text_encoder_cfg")
    image = None
    if dit.has_image_input:
        image_base = base.image_encoder or ImageEncoderConfig()
        image = _overlay(image_base, head.get("image_encoder_cfg"), f"{_HEAD}.image_encoder_cfg")
    kind = _guess_vae_kind(head.get("vae_cfg"), dit)
    vae_base = preset("libero_5b").vae if kind == "wan2.2" else preset("droid_14b").vae
    vae = _overlay(vae_base, head.get("vae_cfg"), f"{_HEAD}.vae_cfg")

    ours = data.get("dreamzero") or {}
    if not isinstance(ours, dict):
        raise ConfigError("config.json: dreamzero must be an object")
    pipeline = _overlay(base.pipeline, ours.get("pipeline"), "dreamzero.pipeline")
    if "num_frames" in head:
        pipeline = dataclasses.replace(pipeline, num_frames=_coerce(head["num_frames"], int, f"{_HEAD}.num_frames"))
    horizon = _coerce(data.get("action_horizon", dit.num_action_per_block), int, "action_horizon")
    return DreamZeroConfig(
        name=_coerce(ours.get("name", "checkpoint"), str, "dreamzero.name"),
        dit=dit,
        text_encoder=text,
        image_encoder=image,
        vae=vae,
        pipeline=pipeline,
        action_horizon=horizon,
        embodiment_tag=_coerce(ours.get("embodiment_tag", base.embodiment_tag), str, "dreamzero.embodiment_tag"),
    )


def to_checkpoint_config(cfg: DreamZeroConfig) -> dict:
    """The release `config.json` layout for `cfg` (what `from_checkpoint_config` reads back)."""
    asdict = dataclasses.asdict
    return {
        "model_type": "vla",
        "action_horizon": cfg.action_horizon,
        "action_dim": cfg.dit.action_dim,
        "action_head_cfg": {
            "config": {
                "num_frames": cfg.pipeline.num_frames,
                "num_frame_per_block": cfg.dit.num_frame_per_block,
                "max_state_dim": cfg.dit.max_state_dim,
                "max_action_dim": cfg.dit.action_dim,
                "diffusion_model_cfg": asdict(cfg.dit),
                "text_encoder_cfg": asdict(cfg.text_encoder),
                "image_encoder_cfg": asdict(cfg.image_encoder) if cfg.image_encoder is not None else None,
                "vae_cfg": asdict(cfg.vae),
            }
        },
        "dreamzero": {"name": cfg.name, "embodiment_tag": cfg.embodiment_tag, "pipeline": asdict(cfg.pipeline)},
    }
