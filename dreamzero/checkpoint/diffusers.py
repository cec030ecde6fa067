"""Layout "diffusers": the component folders of the `-Diffusers` export (as sglang's DreamZero pipeline reads it).

    model_index.json          component -> [library, class]
    transformer/              config.json (`_class_name` DreamZeroCausalWanModel, the DiT kwargs) + safetensors
                              with our DiT names (no `action_head.model.` prefix)
    text_encoder/             transformers UMT5EncoderModel (config.json + safetensors, HF names)
    image_encoder/            transformers CLIPVisionModel (HF names, `vision_model.` level optional); the block
                              after the one DreamZero reads, `post_layernorm` and `visual_projection` may be absent
                              or present and are never used; no logit scale
    vae/                      diffusers AutoencoderKLWan (Wan 2.2 config: z_dim 48, is_residual)
    experiment_cfg/metadata.json, tokenizer/ (optional)

Our modules hold exactly these HF / diffusers classes, so names map 1:1 onto our parameters (no fused tensors).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from dreamzero.checkpoint.files import read_json, read_safetensors_folder
from dreamzero.checkpoint.stream import LayoutSpec, SafetensorsSource
from dreamzero.errors import CheckpointError, ConfigError
from dreamzero.model.release import ReleaseTensor

MODEL_INDEX_FILE = "model_index.json"
TRANSFORMER_CLASS = "DreamZeroCausalWanModel"
#: component folder -> (library, class) as model_index.json names them
COMPONENTS = {
    "transformer": ("dreamzero", TRANSFORMER_CLASS),
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "image_encoder": ("transformers", "CLIPVisionModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
}
_WEIGHTS_STEM = {"transformer": "diffusion_pytorch_model", "vae": "diffusion_pytorch_model"}
_CLIP_LEVEL = "vision_model."  # transformers < 5 and most exported files nest the CLIP tower one level deeper
# diffusers' spelling of the VAE's temporal downsampling flags
_VAE_KEYS = {"base_dim": "base_dim", "z_dim": "z_dim", "dim_mult": "dim_mult", "num_res_blocks": "num_res_blocks"}
_VAE_KEYS.update({"temperal_downsample": "temporal_downsample", "decoder_base_dim": "decoder_base_dim"})


def _component_config(path: Path, component: str) -> dict:
    folder = path / component
    if not folder.is_dir():
        raise CheckpointError(f"{path} has {MODEL_INDEX_FILE} but no {component}/ folder")
    return read_json(folder / "config.json", f"{component} config")


def read_diffusers_config(path: str | os.PathLike):
    """DreamZeroConfig from the component configs (what they leave out comes from the matching preset)."""
    from dreamzero.config import from_checkpoint_config

    path = Path(path)
    index = read_json(path / MODEL_INDEX_FILE, "model index")
    dit = _component_config(path, "transformer")
    if dit.get("_class_name") != TRANSFORMER_CLASS:
        raise CheckpointError(
            f"{path / 'transformer' / 'config.json'}: _class_name is {dit.get('_class_name')!r}, expected "
            f"{TRANSFORMER_CLASS!r} (a transformer with diffusers' Wan names is not a DreamZero export)"
        )
    text = _component_config(path, "text_encoder")
    image = _component_config(path, "image_encoder")
    image = image.get("vision_config", image) if isinstance(image.get("vision_config"), dict) else image
    vae_raw = _component_config(path, "vae")
    vae = {ours: vae_raw[theirs] for theirs, ours in _VAE_KEYS.items() if vae_raw.get(theirs) is not None}
    vae["kind"] = "wan2.2" if vae_raw.get("is_residual") or vae_raw.get("z_dim") == 48 else "wan2.1"
    release = {
        "action_head_cfg": {
            "config": {
                "diffusion_model_cfg": dit,
                "text_encoder_cfg": text,
                "image_encoder_cfg": image,
                "vae_cfg": vae,
            }
        },
    }
    if isinstance(index.get("dreamzero"), dict):  # written by save_diffusers: name, embodiment, pipeline knobs
        release["dreamzero"] = index["dreamzero"]
    try:
        return from_checkpoint_config(release)
    except ConfigError as exc:
        raise CheckpointError(f"{path} (diffusers layout): {exc}") from exc


def _clip_names(model) -> tuple[int, list[tuple[str, str, tuple[int, ...]]]]:
    """(layers, [(name without the `vision_model.` level, our parameter name, shape)]) of the CLIP tower."""
    out = []
    for name, p in model.image_encoder.clip.named_parameters():
        out.append((name.removeprefix(_CLIP_LEVEL), "image_encoder.clip." + name, tuple(p.shape)))
    return model.image_encoder.cfg.num_hidden_layers, out


def diffusers_spec(model) -> LayoutSpec:
    """Names `component/key` for every tensor of the layout, and what may be absent or extra."""
    expected, optional = [], set()
    for name, t in model.model.state_dict(keep_vars=True).items():
        expected.append(ReleaseTensor(f"transformer/{name}", (f"model.{name}",), tuple(t.shape)))
    for name, p in model.text_encoder.t5.named_parameters():  # tied embed_tokens is reported once, as shared
        expected.append(ReleaseTensor(f"text_encoder/{name}", (f"text_encoder.t5.{name}",), tuple(p.shape)))
    for name, p in model.vae.autoencoder.named_parameters():
        expected.append(ReleaseTensor(f"vae/{name}", (f"vae.autoencoder.{name}",), tuple(p.shape)))
    ignore = ("text_encoder/encoder.embed_tokens.weight",)
    fills = {}
    if model.image_encoder is not None:
        layers, clip = _clip_names(model)
        unused = (f"encoder.layers.{layers - 1}.", "post_layernorm.")  # DreamZero reads the block before the last
        for name, ours, shape in clip:
            expected.append(ReleaseTensor(f"image_encoder/{name}", (ours,), shape))
            if name.startswith(unused):
                optional.add(f"image_encoder/{name}")
        ignore += ("image_encoder/visual_projection.", "image_encoder/embeddings.position_ids")
        # never used by DreamZero and not part of this layout
        fills["image_encoder.head"] = torch.zeros
        fills["image_encoder.log_scale"] = lambda shape: torch.full(shape, math.log(1 / 0.07))
    return LayoutSpec(expected, frozenset(optional), ignore, fills)


def diffusers_source(path: Path) -> SafetensorsSource:
    files: dict[str, tuple[Path, str]] = {}
    for component in COMPONENTS:
        folder = path / component
        if not folder.is_dir():
            raise CheckpointError(f"{path} has {MODEL_INDEX_FILE} but no {component}/ folder")
        weight_map = read_safetensors_folder(folder)
        if not weight_map:
            raise CheckpointError(f"{folder} holds no safetensors weights")
        for key, file in weight_map.items():
            name = key.removeprefix(_CLIP_LEVEL) if component == "image_encoder" else key
            if f"{component}/{name}" in files:
                raise CheckpointError(f"{folder}: {key!r} is stored twice (with and without {_CLIP_LEVEL!r})")
            files[f"{component}/{name}"] = (folder / file, key)
    return SafetensorsSource(f"diffusers checkpoint {path}", files)


def save_diffusers(model, path: str | os.PathLike, shard_size: int = 5 * 2**30, save_tokenizer: bool = True) -> Path:
    """Write `model` in the diffusers component layout (CLIP keys under `vision_model.`, the contrastive head as
    `visual_projection`, as transformers' CLIPVisionModelWithProjection stores them)."""
    import diffusers

    from dreamzero.checkpoint.hf import save_tokenizer_of, values_of, write_shards
    from dreamzero.model.image_encoder import clip_vision_config
    from dreamzero.model.text_encoder import umt5_config
    from dreamzero.model.vae import diffusers_kwargs

    if model.image_encoder is None:
        raise CheckpointError("the diffusers layout needs an image encoder (image_encoder/ is required)")
    path = Path(path)
    spec = diffusers_spec(model)
    by_name = values_of(model, spec.expected)
    by_name["image_encoder.visual_projection"] = model.image_encoder.head.detach().t()
    cfg = model.config
    configs = {
        "transformer": {"_class_name": TRANSFORMER_CLASS, **dataclasses.asdict(cfg.dit)},
        "text_encoder": {**umt5_config(cfg.text_encoder).to_dict(), "architectures": ["UMT5EncoderModel"]},
        "image_encoder": {**clip_vision_config(cfg.image_encoder).to_dict(), "architectures": ["CLIPVisionModel"]},
        "vae": {"_class_name": "AutoencoderKLWan", **diffusers_kwargs(cfg.vae)},
    }
    for component, config in configs.items():
        folder = path / component
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2, default=list) + "\n")
        tensors = [
            dataclasses.replace(rt, name=_stored_key(component, rt.name))
            for rt in spec.expected
            if rt.name.startswith(component + "/")
        ]
        if component == "image_encoder":
            head = (cfg.image_encoder.projection_dim, cfg.image_encoder.hidden_size)
            tensors.append(ReleaseTensor("visual_projection.weight", ("image_encoder.visual_projection",), head))
        stem = _WEIGHTS_STEM.get(component, "model")
        write_shards(folder, tensors, by_name, stem, f"{stem}.safetensors.index.json", shard_size)
    index = {"_class_name": "DreamZeroPipeline", "_diffusers_version": diffusers.__version__}
    index.update({c: list(lib_cls) for c, lib_cls in COMPONENTS.items()})
    index["dreamzero"] = {"name": cfg.name, "embodiment_tag": cfg.embodiment_tag}
    index["dreamzero"]["pipeline"] = cfg.pipeline.model_dump(mode="json")
    (path / MODEL_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    save_tokenizer_of(model, path, save_tokenizer)
    return path


def _stored_key(component: str, name: str) -> str:
    key = name.removeprefix(component + "/")
    return _CLIP_LEVEL + key if component == "image_encoder" else key
