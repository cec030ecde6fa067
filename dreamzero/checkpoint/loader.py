"""One entry point for every checkpoint layout: detect it, check names and shapes, stream the tensors."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dreamzero.checkpoint.diffusers import MODEL_INDEX_FILE, diffusers_source, diffusers_spec, read_diffusers_config
from dreamzero.checkpoint.full_weights import FULL_WEIGHTS_FILE, FullWeightsSource
from dreamzero.checkpoint.hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, hf_source, read_config, release_spec
from dreamzero.checkpoint.stream import check_layout, finish, stream_into
from dreamzero.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

LAYOUTS = ("hf", "full_weights", "diffusers")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def detect_layout(path: str | os.PathLike) -> str:
    """ "diffusers" for a folder with model_index.json; "hf" for one with config.json next to
    model.safetensors(.index.json); "full_weights" for a .pt/.pth/.bin file or a folder holding full_weights.pt;
    else "hf" when config.json is there (its loader then names the missing weights)."""
    path = Path(path)
    if path.is_file():
        if path.suffix in _TORCH_SUFFIXES:
            return "full_weights"
        raise CheckpointError(f"{str(path)!r} is a file but not a torch state dict ({'/'.join(_TORCH_SUFFIXES)})")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if (path / MODEL_INDEX_FILE).is_file():
        return "diffusers"
    has_config = (path / CONFIG_FILE).is_file()
    has_safetensors = (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file()
    if has_config and has_safetensors:
        return "hf"
    if (path / FULL_WEIGHTS_FILE).is_file():
        return "full_weights"
    if has_config or has_safetensors:  # an incomplete hf folder: its reader names what is missing
        return "hf"
    if (path / "adapter_config.json").is_file():  # a LoRA run's checkpoint holds the adapters only, not a model
        raise CheckpointError(
            f"{path} is a LoRA checkpoint (adapter_config.json, adapter_model.safetensors), not a model: merge it into "
            f"its base first, `python -m dreamzero.train.lora merge {path} <merged>`, and load <merged>"
        )
    raise CheckpointError(
        f"{path} is no checkpoint layout we know: expected {MODEL_INDEX_FILE} (diffusers), {CONFIG_FILE} with "
        f"{INDEX_FILE} or {SINGLE_FILE} (hf), or {FULL_WEIGHTS_FILE} (full_weights)"
    )


def _resolve_config(config, fallback):
    """config: None (use `fallback()`), a preset name or a DreamZeroConfig."""
    from dreamzero.config import DreamZeroConfig, preset

    if config is None:
        return fallback()
    if isinstance(config, str):
        try:
            return preset(config)
        except ConfigError as exc:
            raise CheckpointError(f"config: {exc}") from exc
    if isinstance(config, DreamZeroConfig):
        return config
    raise CheckpointError(f"config must be a preset name or a DreamZeroConfig, got {type(config).__name__}")


def _full_weights_config(file: Path):
    if (file.parent / CONFIG_FILE).is_file():
        return read_config(file.parent)
    raise CheckpointError(
        f"{file} stores no config and there is no {CONFIG_FILE} beside it: pass config= a preset name "
        "(e.g. 'libero_5b') or a DreamZeroConfig"
    )


def _described_by(config, own: str) -> str:
    """What the tensor names are checked against, for the error message."""
    if config is None:
        return own
    return f"config {config!r}" if isinstance(config, str) else "the given config"


def _open(path: Path, layout: str, config):
    """(config, source, spec maker, what the names are checked against, folder of tokenizer/ etc.)"""
    if layout == "hf":
        cfg = _resolve_config(config, lambda: read_config(path))
        return cfg, hf_source(path), release_spec, _described_by(config, "its config.json"), path
    if layout == "full_weights":
        file = path / FULL_WEIGHTS_FILE if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"{file} does not exist")
        cfg = _resolve_config(config, lambda: _full_weights_config(file))
        described = _described_by(config, f"the {CONFIG_FILE} beside it")
        return cfg, FullWeightsSource(file), release_spec, described, file.parent
    cfg = _resolve_config(config, lambda: read_diffusers_config(path))
    return cfg, diffusers_source(path), diffusers_spec, _described_by(config, "its component configs"), path


def load_model(
    path: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    tokenizer_path: str | os.PathLike | None = None,
    require_tokenizer: bool = True,
    layout: str | None = None,
    config=None,
    placement=None,
):
    """Load a DreamZeroModel from any checkpoint layout, streaming tensor by tensor.

    layout: "hf" | "full_weights" | "diffusers", or None to detect it (`detect_layout`). config: a preset name or a
    DreamZeroConfig; required for a full_weights.pt without a config.json beside it, otherwise it replaces what the
    checkpoint says. device / dtype default to `dreamzero.device.select_device()` (CUDA + bf16 when present, else
    CPU + fp32). The tokenizer comes from `tokenizer_path`, the config, `<folder>/tokenizer` or
    $DREAMZERO_TOKENIZER_PATH; with require_tokenizer=False a missing one only logs a warning.
    Names, shapes and files are all checked before any tensor data is read.

    placement: a `dreamzero.placement.Placement` (or its mapping; None: everything on `device`, in `dtype`). Each
    component is read straight onto its own device: a text / image encoder placed "cpu" or "offload" never touches
    the GPU. With dit_weights="fp8" the DiT's Linear layers become fp8 on the meta skeleton and each weight is
    quantised as it arrives, so the DiT is never held on the device in `dtype` (one tensor at a time is).
    """
    from dreamzero.device import select_device
    from dreamzero.model.dreamzero import DreamZeroModel
    from dreamzero.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    path = Path(path)
    if layout is None:
        layout = detect_layout(path)
    elif layout not in LAYOUTS:
        raise CheckpointError(f"layout must be one of {LAYOUTS} or None (detect), got {layout!r}")
    from dreamzero.placement import Placement

    dev, dt = select_device(device, dtype)
    placement = Placement.parse(placement, field="placement")
    cfg, source, make_spec, described_by, folder = _open(path, layout, config)

    # 1. everything that can be checked without reading tensor data
    found = source.shapes()
    tokenizer = None
    try:
        tokenizer = load_tokenizer(resolve_tokenizer_path(tokenizer_path, cfg.text_encoder.tokenizer_path, folder))
    except CheckpointError:
        if require_tokenizer:
            raise
        log.warning("no tokenizer for %s: the text encoder cannot encode prompts", path, exc_info=True)
    if tokenizer is not None and len(tokenizer) > cfg.text_encoder.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {len(tokenizer)} tokens but text_encoder.vocab_size is {cfg.text_encoder.vocab_size}"
        )
    with torch.device("meta"):
        model = DreamZeroModel(cfg)
    spec = make_spec(model)
    check_layout(spec.expected, found, source.where, spec.ignore, spec.optional, described_by)

    # 2. stream one tensor at a time into the meta skeleton, each component onto its own device; 3. buffers are
    # never stored: recreate them
    devices = placement.devices(dev)
    setters = _fp8_setters(model.model) if placement.dit_weights == "fp8" else None
    stream_into(model, spec, source, found, devices, dt, setters)
    model = finish(model, devices)
    model.text_encoder.tokenizer = tokenizer
    place_text_encoder(model.text_encoder, placement.text_encoder, dev)
    model.placement = placement
    return model


def _fp8_setters(dit) -> dict:
    """Turn the DiT's Linear layers (on the meta skeleton) into fp8 ones; release name -> the layer's quantiser."""
    try:
        from dreamzero.model.fp8 import Fp8Linear, convert_linears_to_fp8_
    except ImportError as exc:
        raise ConfigError(
            f"placement.dit_weights='fp8' needs dreamzero.model.fp8, which failed to import: {exc}"
        ) from exc
    convert_linears_to_fp8_(dit)
    return {f"model.{n}.weight": m.set_weight for n, m in dit.named_modules() if isinstance(m, Fp8Linear)}


def place_text_encoder(text_encoder, where: str, serving_device: torch.device) -> None:
    """How a loaded text encoder runs for its placement: "cpu" runs unpadded on the host (same rows up to rounding,
    a fraction of the flops); "offload" computes on the serving device block by block from host weights."""
    text_encoder.trim_padding = where == "cpu"
    text_encoder.offload_to(serving_device if where == "offload" else None)
