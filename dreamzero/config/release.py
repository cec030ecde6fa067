"""A release checkpoint's `config.json` <-> `DreamZeroConfig` (`from_checkpoint_config`, `to_checkpoint_config`)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from dreamzero.config.networks import DiTConfig, DreamZeroConfig, ImageEncoderConfig
from dreamzero.config.pipeline import PipelineConfig, describe_errors, unknown_knob_message
from dreamzero.config.presets import preset
from dreamzero.errors import ConfigError

log = logging.getLogger("dreamzero.config")

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
