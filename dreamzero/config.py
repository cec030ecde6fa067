"""Configuration of a DreamZero model: the DiT shape, the encoders, the inference-loop knobs, and named presets.

Field names of `DiTConfig` follow the upstream `CausalWanModel` constructor (so a release `config.json`'s
`action_head_cfg.config.diffusion_model_cfg` maps onto it 1:1); fields we added are marked "(ours)".
"""
# Longer than ~400 lines on purpose: the config dataclasses, the presets and the release config.json mapping must
# agree field by field.

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from dreamzero.errors import ConfigError

log = logging.getLogger(__name__)


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


_Step = Annotated[StrictInt, Field(ge=0)]
_Pixels = Annotated[StrictInt, Field(ge=1)]
_Similarity = Annotated[StrictFloat, Field(ge=-1.0, le=1.0)]
# upstream default: run the DiT on 8 of 16 steps and reuse the last prediction on the others
_UPSTREAM_STEP_MASK = (
    True, True, True, False, False, False, True, False, False, False, True, False, False, True, True, True,
)  # fmt: skip


class PipelineConfig(BaseModel):
    """Inference-loop knobs (all overridable per deployment: `pipeline:` in serve_config.yaml, `overrides=` of
    `DreamZeroPipeline.load`). Validated on construction and frozen: a PipelineConfig in hand is always usable;
    `with_overrides` makes a changed copy."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    num_inference_steps: StrictInt = Field(16, ge=1, description="Flow-matching scheduler steps per action chunk.")
    sigma_shift: StrictFloat = Field(5.0, gt=0, description="Timestep shift of the flow-UniPC sigma schedule.")
    cfg_scale: StrictFloat = Field(
        5.0, description="Classifier-free guidance scale on the video; 1.0 runs no unconditional rows at all."
    )
    dit_step_mask: tuple[StrictBool, ...] | None = Field(
        _UPSTREAM_STEP_MASK,
        description="One bool per scheduler step: run the DiT (true) or reuse the last prediction (false); the "
        "first entry must be true. null runs the DiT on every step. Ignored when dynamic_skip is true.",
    )
    dynamic_skip: StrictBool = Field(
        False, description="Skip DiT steps by the cosine similarity of successive predictions instead of the mask."
    )
    dynamic_skip_warmup: StrictInt = Field(
        2, ge=1, description="Steps that always run before dynamic skipping may start."
    )
    dynamic_skip_thresholds: tuple[tuple[_Similarity, _Step], ...] = Field(
        ((0.95, 4), (0.93, 2)),
        description="[similarity, steps] pairs: when the cosine similarity exceeds `similarity` (-1..1), skip the "
        "next `steps` (>= 0) DiT steps; the highest matching threshold wins.",
    )
    default_seed: StrictInt = Field(1140, ge=0, description="Noise seed of rows whose request carries none.")
    num_frames: StrictInt = Field(
        33, ge=1, description="Frames of the i2v conditioning window (8 * max_chunk_size + 1 on DROID)."
    )
    model_input_hw: tuple[_Pixels, _Pixels] | None = Field(
        None,
        description="[height, width] the input frames are resized to inside the model (bilinear; 5B: [160, 320]); "
        "null keeps the size sent.",
    )
    prompt_cache_size: StrictInt = Field(
        32, ge=0, description="T5 rows of recent prompts shared by all sessions (ours); 0 encodes per session."
    )
    conditioning_by_chunk: StrictBool = Field(
        True,
        description="Encode the i2v conditioning chunk by chunk from a per-session VAE state (ours; about 0.6 GB "
        "per 14B DROID session until its window is full); false encodes the whole window at each restart, as "
        "upstream, and keeps no state.",
    )
    compile: Literal["none", "dit", "all"] = Field(
        "none",
        description="torch.compile level: none (eager), dit (each DiT block), all (also the text/image encoders and "
        "the VAE). Compiled models are warmed up at load. See docs/model.md, 'Compile levels'.",
    )

    @field_validator("dit_step_mask")
    @classmethod
    def _first_step_runs(cls, mask: tuple[bool, ...] | None) -> tuple[bool, ...] | None:
        if mask is not None and (not mask or not mask[0]):
            raise ValueError("the first entry must be true (step 0 has no prediction to reuse); or use null")
        return mask

    @model_validator(mode="after")
    def _mask_covers_every_step(self) -> PipelineConfig:
        mask = self.dit_step_mask
        if mask is not None and len(mask) != self.num_inference_steps:
            raise ValueError(
                f"dit_step_mask has {len(mask)} entries but num_inference_steps is {self.num_inference_steps}; "
                "give one bool per step, or null to run the DiT on every step"
            )
        return self

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> PipelineConfig:
        """A copy with the knobs in `overrides` replaced, validated as a whole; a bad or unknown knob raises
        ConfigError naming it (and the closest known name)."""
        if not overrides:
            return self
        return parse_pipeline_config({**self.model_dump(), **overrides})


def parse_pipeline_config(data: Mapping[str, Any]) -> PipelineConfig:
    """`data` (e.g. from YAML / JSON) as a PipelineConfig, or ConfigError listing every bad knob."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"pipeline must be a mapping of knob names to values, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(describe_errors(err, "pipeline")) from None


def pipeline_overrides_arg(text: str) -> dict[str, Any]:
    """argparse type of a `--pipeline` option: a JSON object of knobs. Names are checked here, so a typo fails before
    any work; values are checked with the model's own pipeline, where they apply."""
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(overrides, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of pipeline knobs, got {text!r}")
    for name in overrides:
        if name not in PipelineConfig.model_fields:
            raise argparse.ArgumentTypeError(unknown_knob_message(name))
    return overrides


def unknown_knob_message(name: str, where: str = "pipeline") -> str:
    """The one place that names an unknown pipeline knob: the closest known name and the full list."""
    known = list(PipelineConfig.model_fields)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {where} knob {name!r}.{hint} Known knobs: {known}"


_TYPE_NAMES = {  # pydantic error type -> what the field wants, in config-file words
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "int"),
    **dict.fromkeys(("float_type", "float_parsing"), "float"),
    "string_type": "str",
    **dict.fromkeys(("tuple_type", "list_type"), "a list"),
    **dict.fromkeys(("dict_type", "model_type", "dataclass_type"), "an object"),
}


def describe_errors(err: ValidationError, where: str) -> str:
    """A pydantic ValidationError as one line per problem, each naming the field (`where.field`) and the fix."""
    lines = []
    for e in err.errors():
        loc = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"])
        loc = loc.removeprefix(".")
        got = e.get("input")
        if e["type"] == "extra_forbidden":
            lines.append(unknown_knob_message(str(e["loc"][-1]), where))
            continue
        kind = _TYPE_NAMES.get(e["type"])
        if kind is not None:
            lines.append(f"{loc} must be {kind}, got {got!r}")
            continue
        msg = "missing; give a value" if e["type"] == "missing" else e["msg"].removeprefix("Value error, ")
        if not isinstance(got, (dict, list, tuple)) and e["type"] not in ("value_error", "missing"):
            msg += f", got {got!r}"
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


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


def apply_overrides(config: PipelineConfig, overrides: Mapping[str, Any] | None) -> PipelineConfig:
    """`config.with_overrides(overrides)` (kept for callers that hold a config and a dict)."""
    return config.with_overrides(overrides)


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


# -- release config.json <-> DreamZeroConfig ------------------------------------------------------------------------

_HEAD = "action_head_cfg.config"


def _validated(tp, value, where: str):
    """`value` (JSON data) as type `tp` (a config dataclass, PipelineConfig, or a scalar type), checked strictly as
    JSON: no bool for an int, no float for an int, lists of the right length for tuples; errors name the field."""
    try:
        return TypeAdapter(tp).validate_json(json.dumps(value), strict=True)
    except ValidationError as err:
        raise ConfigError(describe_errors(err, where)) from None
    except (TypeError, ValueError) as err:  # json.dumps: not JSON data at all
        raise ConfigError(f"{where}: not JSON data ({err})") from None


def _fields(cfg) -> dict[str, Any]:
    return cfg.model_dump() if isinstance(cfg, BaseModel) else dataclasses.asdict(cfg)


def _overlay(base, source: dict | None, where: str):
    """A copy of config `base` with every key of `source` that names one of its fields, validated (unknown keys
    ignored: upstream configs also carry `_target_`, pretrained paths and training-only knobs)."""
    if source is None:
        return base
    if not isinstance(source, dict):
        raise ConfigError(f"{where} must be an object, got {type(source).__name__}")
    current = _fields(base)
    return _validated(type(base), {**current, **{k: v for k, v in source.items() if k in current}}, where)


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
            dit = dataclasses.replace(dit, **{name: _validated(int, head[key], f"{_HEAD}.{key}")})

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
    saved = ours.get("pipeline")
    for key in saved if isinstance(saved, dict) else ():
        if key not in PipelineConfig.model_fields:  # e.g. a knob of another version: keep loading, but say so
            log.warning("config.json: ignoring %s", unknown_knob_message(key, "dreamzero.pipeline"))
    pipeline = _overlay(base.pipeline, saved, "dreamzero.pipeline")
    if "num_frames" in head:
        num_frames = _validated(int, head["num_frames"], f"{_HEAD}.num_frames")
        pipeline = _validated(PipelineConfig, {**pipeline.model_dump(), "num_frames": num_frames}, f"{_HEAD}")
    horizon = _validated(int, data.get("action_horizon", dit.num_action_per_block), "action_horizon")
    return DreamZeroConfig(
        name=_validated(str, ours.get("name", "checkpoint"), "dreamzero.name"),
        dit=dit,
        text_encoder=text,
        image_encoder=image,
        vae=vae,
        pipeline=pipeline,
        action_horizon=horizon,
        embodiment_tag=_validated(str, ours.get("embodiment_tag", base.embodiment_tag), "dreamzero.embodiment_tag"),
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
        "dreamzero": {"name": cfg.name, "embodiment_tag": cfg.embodiment_tag, "pipeline": cfg.pipeline.model_dump()},
    }
